"""Checkpoint I/O of the built-in trainer, behind three calls the checkpoint engine can replace.

A version is a folder ``<directory>/iter_<iteration:07d>`` written with
``torch.distributed.checkpoint`` (DCP): every rank writes its own shards and DCP
records global shapes, so a version saved at one layout loads at another (DCP
reshards on load). A version is *published* only when the marker
``<directory>/latest`` names it; rank 0 writes that marker (temporary file, fsync,
rename) after a barrier that every rank reaches only once its shards are on disk. A
crash mid-save therefore leaves the previous version current. Readers trust only the
marker, never the newest folder.

All ranks must call :func:`save` and :func:`load_latest` together (collectives).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

from unicorn_core.errors import InvalidArgument

LATEST_MARKER: Final = "latest"
SKIPPED_FILE: Final = "unicorn-skipped"
"""In a version folder: the iterations the saving run had skipped by then (``A-B,C-D``;
absent: none), so a run that skips data never resumes from a version trained on it."""


def version_dir(directory: str | os.PathLike[str], iteration: int) -> Path:
    """Folder of the version saved after ``iteration`` (Megatron's ``iter_0000100`` naming)."""
    return Path(directory) / f"iter_{iteration:07d}"


def latest_iteration(directory: str | os.PathLike[str]) -> int | None:
    """The published iteration in ``directory``, or None when nothing is published.

    Raises :class:`InvalidArgument` when the marker exists but is not an iteration number
    or names a missing version (a corrupted directory is not the same as an empty one).
    """
    marker = Path(directory) / LATEST_MARKER
    try:
        text = marker.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise InvalidArgument(f"checkpoint marker {marker} holds {text!r}, not an iteration number")
    iteration = int(text)
    if not version_dir(directory, iteration).is_dir():
        raise InvalidArgument(
            f"checkpoint marker {marker} names iteration {iteration}, whose folder is missing"
        )
    return iteration


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _publish(directory: Path, iteration: int) -> None:
    tmp = directory / f".{LATEST_MARKER}.tmp"
    with tmp.open("w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / LATEST_MARKER)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_versions(directory: str | os.PathLike[str]) -> list[int]:
    """Iterations of every complete version folder in ``directory`` (DCP's ``.metadata``
    written), newest first."""
    out = []
    for path in Path(directory).glob("iter_*"):
        number = path.name.removeprefix("iter_")
        if number.isdigit() and (path / ".metadata").is_file():
            out.append(int(number))
    return sorted(out, reverse=True)


def skipped_of(directory: str | os.PathLike[str], iteration: int) -> str:
    """What the run that saved version ``iteration`` had skipped (:data:`SKIPPED_FILE`)."""
    try:
        return (version_dir(directory, iteration) / SKIPPED_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def save(
    state: dict[str, Any], iteration: int, directory: str | os.PathLike[str], *, skipped: str = ""
) -> Path:
    """Write ``state`` as version ``iteration`` and publish it; returns the version folder.

    ``state`` maps names to tensors, plain values or ``Stateful`` objects (DCP calls
    their ``state_dict()``). ``skipped``: the iterations the run skipped so far
    (:data:`SKIPPED_FILE`, written before the version is published).
    """
    if iteration < 0:
        raise InvalidArgument(f"iteration must be >= 0, got {iteration}")
    root = Path(directory)
    if _is_writer():
        root.mkdir(parents=True, exist_ok=True)
    _barrier()
    target = version_dir(root, iteration)
    state_dict_saver.save(state, checkpoint_id=str(target))
    _barrier()  # every rank's shards and DCP's metadata are written
    if _is_writer():
        marker = target / SKIPPED_FILE
        if skipped:
            marker.write_text(f"{skipped}\n")
        else:
            marker.unlink(missing_ok=True)
        _publish(root, iteration)
    _barrier()  # no rank proceeds (or exits) before the version is published
    return target


def load_latest(state: dict[str, Any], directory: str | os.PathLike[str]) -> int | None:
    """Load the published version into ``state`` in place; returns its iteration, or None if none.

    Every rank reads the marker itself (shared file system); ranks that disagree would
    load different versions, so rank 0's answer is broadcast first.
    """
    iteration = latest_iteration(directory) if _is_writer() else None
    if dist.is_initialized():
        box: list[int | None] = [iteration]
        dist.broadcast_object_list(box, src=0)
        iteration = box[0]
    if iteration is None:
        return None
    state_dict_loader.load(state, checkpoint_id=str(version_dir(directory, iteration)))
    return iteration


def load_version(state: dict[str, Any], directory: str | os.PathLike[str], iteration: int) -> int:
    """Load version ``iteration`` (published or older, e.g. to roll back) into ``state`` in place.

    Raises :class:`InvalidArgument` when the version is missing or incomplete (DCP's
    ``.metadata`` is written last, after every rank's shards).
    """
    target = version_dir(directory, iteration)
    if not (target / ".metadata").is_file():
        raise InvalidArgument(f"no complete checkpoint version {target}")
    state_dict_loader.load(state, checkpoint_id=str(target))
    return iteration
