"""The shard commit protocol: the one way a sealed shard copy enters a tier.

Used by persistence (:func:`ckpt.persist.write_shard`: shm to local disk and remote) and
by peer replication (:mod:`ckpt.peer`: a pushed backup, a fetched copy). A shard counts
in a tier only once its done marker exists (:mod:`ckpt.tier`), so the invariant is: the
marker is written last, only over bytes and metadata that were verified in place and,
in a durable tier, are on disk. For ``target`` and a sealed ``meta``, in this order:

1. the folder is created and the old done marker, if any, removed (when ``durable``,
   created folders and the removal are fsync'd: a power cut must not resurrect an old
   marker next to new bytes);
2. ``write_data(fd)`` writes the bytes to a temp file private to this call
   (``shard-R.bin.<n>.tmp.<pid>``); its size must be ``meta.data_bytes``; it is
   fdatasync'd (when ``durable``) and renamed over ``.bin``;
3. the metadata is written by temp file + fsync + rename;
4. every entry's checksum is checked through :class:`OpenShard`, the path readers take;
5. the done marker is written by temp file + fsync + rename (+ folder fsync).

An exception at step 2 removes the temp file; at steps 3-5 it removes ``.bin``, the
metadata and the marker, so a raising call leaves no marker and no file it wrote (an
older copy's files, already markerless after step 1, stay until replaced or evicted). A
crash (kill, power cut) at any point leaves no marker and at worst temp files, which
``TierDir.clean_tmp`` removes. Blocking: async callers run it in a worker thread.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from ckpt.errors import InvalidArgument, ShardUnavailable
from ckpt.format import (
    DoneMarker,
    ShardMeta,
    ShardPaths,
    ShardState,
    encode,
    fsync_dir,
    tmp_path,
    write_atomic,
)
from ckpt.shard import OpenShard
from ckpt.tier import TierDir

_serial: Final = itertools.count()
"""Makes temp names unique within a process: two commits of one shard (a retried push
while the first is still arriving) must not write into the same temp file."""


def commit_shard(target: TierDir, meta: ShardMeta, write_data: Callable[[int], object]) -> ShardPaths:
    """Commit one sealed shard into ``target`` by the protocol above; return its paths.

    ``write_data(fd)`` must write exactly ``meta.data_bytes`` bytes to ``fd`` (a new,
    empty file) and may raise to abort. Returns once the copy is complete (and durable
    where ``target.durable``). Raises ``InvalidArgument`` for another job's shard,
    ``ShardUnavailable('incomplete')`` for an unsealed ``meta`` or a wrong size,
    ``ShardUnavailable('corrupt')`` for a checksum mismatch, and whatever ``write_data``
    raises; after any exception the shard has no done marker in ``target``.
    """
    if meta.job_id != target.job_id:
        raise InvalidArgument(f"a shard of job {meta.job_id} cannot go to {target} of job {target.job_id}")
    if meta.state != ShardState.SEALED or any(entry.digest is None for entry in meta.entries):
        raise ShardUnavailable(
            "incomplete", f"shard {meta.iteration}/{meta.rank} is {meta.state} or lacks checksums, not sealed"
        )
    durable = target.durable
    paths = target.shard(meta.iteration, meta.rank)
    _make_dirs(paths.directory, durable=durable)
    try:
        paths.done.unlink()
    except FileNotFoundError:
        pass
    else:
        if durable:
            fsync_dir(paths.directory)
    _write_bin(paths.bin, meta.data_bytes, write_data, durable=durable)
    try:
        write_atomic(paths.meta, encode(meta), durable=durable)
        with OpenShard(paths, require_sealed=False) as copy:
            copy.verify()
        marker = DoneMarker(digest=meta.shard_digest(), data_bytes=meta.data_bytes)
        write_atomic(paths.done, encode(marker), durable=durable)
    except BaseException:
        for path in (paths.done, paths.meta, paths.bin):  # marker first: never one without its files
            path.unlink(missing_ok=True)
        raise
    return paths


def _make_dirs(directory: Path, *, durable: bool) -> None:
    """``mkdir -p``; when ``durable``, fsync each created folder's parent so it survives a power cut."""
    missing = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    directory.mkdir(parents=True, exist_ok=True)
    if durable:
        for created in reversed(missing):
            fsync_dir(created.parent)


def _write_bin(path: Path, data_bytes: int, write_data: Callable[[int], object], *, durable: bool) -> None:
    """Step 2: the bytes into a private temp file, size checked, synced, renamed to ``path``."""
    tmp = tmp_path(path.with_name(f"{path.name}.{next(_serial)}"))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_data(fd)
        size = os.fstat(fd).st_size
        if size != data_bytes:
            raise ShardUnavailable("incomplete", f"{tmp} holds {size} B, the metadata says {data_bytes} B")
        if durable:
            os.fdatasync(fd)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
