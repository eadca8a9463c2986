"""On-storage format of a checkpoint shard, shared by every tier.

One layout everywhere (shared memory, peer backups, local disk, remote)::

    <tier root>/<job_id>/it-<iteration:012d>/
        shard-<rank:05d>.bin    raw bytes of every tensor/bytes/ndarray leaf, 64-byte aligned
        shard-<rank:05d>.json   ShardMeta: entries (name, dtype, shape, offset, checksum), tree
        shard-<rank:05d>.done   commit marker: the shard digest (present only once sealed)
        VERSION.json            published by one writer once every rank's shard is done

Tensors are never pickled: their bytes go to ``.bin`` and their description to JSON.
The rest of the state (ints, floats, strings, nested dicts/lists/tuples) is a JSON
*tree* in which each leaf is a placeholder ``{"T": i}`` (tensor), ``{"B": i}`` (bytes)
or ``{"N": i}`` (numpy array) that points at ``entries[i]``.

Checksums are xxh3-64 (the ``xxhash`` package): measured 22 GiB/s here against 4 GiB/s
for zlib.crc32, i.e. faster than the copy itself. Each entry has its own digest, so a
reader of part of a shard (DCP resharding) verifies only what it reads; the *shard
digest* hashes the encoded entry list, so it covers names, offsets and entry digests.

Every file is written to ``<name>.tmp.<pid>`` and renamed; readers ignore such names.
"""

from __future__ import annotations

import enum
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeGuard

import msgspec
import numpy as np
import xxhash

if TYPE_CHECKING:
    import torch

from ckpt.errors import InvalidArgument, InvalidTransition

FORMAT_VERSION: Final = 1
ALIGN_BYTES: Final = 64
"""Entry offsets are multiples of this: any dtype view is aligned, copies start on a cache line."""

TMP_MARK: Final = ".tmp."
_JOB_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ITER_RE: Final = re.compile(r"^it-(\d{12})$")
_INT64_MAX: Final = 2**63 - 1


class ShardState(enum.StrEnum):
    """Life of one shard copy. The state machine:

    - ``writing``: the bytes are being copied; no metadata file exists, so no reader sees it.
    - ``copied``: the copy is complete and the metadata written, checksums not yet computed.
      The training rank returns here; everything after is the node agent's.
    - ``sealed``: checksums computed and a done marker written; restorable.
    - ``evicted``: metadata and marker removed; the bytes may be reused for a new snapshot.
    """

    WRITING = "writing"
    COPIED = "copied"
    SEALED = "sealed"
    EVICTED = "evicted"


TRANSITIONS: Final[Mapping[ShardState, frozenset[ShardState]]] = {
    ShardState.WRITING: frozenset({ShardState.COPIED, ShardState.EVICTED}),
    ShardState.COPIED: frozenset({ShardState.SEALED, ShardState.EVICTED}),
    ShardState.SEALED: frozenset({ShardState.EVICTED}),
    ShardState.EVICTED: frozenset({ShardState.WRITING}),
}


def check_transition(old: ShardState, new: ShardState) -> None:
    """Raise ``InvalidTransition`` unless ``old -> new`` is in ``TRANSITIONS``."""
    if new not in TRANSITIONS[old]:
        raise InvalidTransition(f"shard state {old} -> {new} is not allowed")


class EntryKind(enum.StrEnum):
    TENSOR = "tensor"
    BYTES = "bytes"
    NDARRAY = "ndarray"


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One leaf's bytes in ``.bin``: ``dtype`` is a torch name (``float32``) or numpy str."""

    name: str
    kind: EntryKind
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    digest: str | None = None


class ShardMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Everything about one shard except its bytes (the ``.json`` file)."""

    format: int = FORMAT_VERSION
    job_id: str
    iteration: int
    rank: int
    world_size: int
    state: ShardState
    data_bytes: int
    entries: tuple[Entry, ...]
    tree: Any
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    created_unix_s: float

    def shard_digest(self) -> str:
        """Digest of the encoded entry list (covers names, layout and entry digests)."""
        return digest_bytes(msgspec.json.encode(self.entries))


class DoneMarker(msgspec.Struct, frozen=True, kw_only=True):
    """Content of ``.done``: written last, after ``.bin`` and ``.json`` are durable."""

    digest: str
    data_bytes: int


class VersionShard(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    digest: str
    data_bytes: int


class VersionManifest(msgspec.Struct, frozen=True, kw_only=True):
    """Content of ``VERSION.json``: the version is complete and may be restored."""

    job_id: str
    iteration: int
    world_size: int
    shards: tuple[VersionShard, ...]
    published_unix_s: float


def digest_bytes(data: bytes | memoryview) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


# --- paths -------------------------------------------------------------------------


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_RE.match(job_id):
        raise InvalidArgument(
            f"job id {job_id!r}: expected 1-128 of [A-Za-z0-9._-], not starting with . or -"
        )
    return job_id


def check_index(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{name} must be an integer >= 0, got {value!r}")
    return value


def iteration_dir(root: Path, job_id: str, iteration: int) -> Path:
    return root / check_job_id(job_id) / f"it-{check_index(iteration, 'iteration'):012d}"


def parse_iteration_dir(name: str) -> int | None:
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class ShardPaths:
    """The three files of one shard copy in one tier."""

    directory: Path
    rank: int

    @property
    def stem(self) -> str:
        return f"shard-{self.rank:05d}"

    @property
    def bin(self) -> Path:
        return self.directory / f"{self.stem}.bin"

    @property
    def meta(self) -> Path:
        return self.directory / f"{self.stem}.json"

    @property
    def done(self) -> Path:
        return self.directory / f"{self.stem}.done"

    @classmethod
    def of(cls, root: Path, job_id: str, iteration: int, rank: int) -> ShardPaths:
        return cls(iteration_dir(root, job_id, iteration), check_index(rank, "rank"))


def tmp_path(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, durable: bool) -> None:
    """Write ``data`` to ``path`` via a temp file and rename (fsync'd when ``durable``).

    A failure before the rename removes the temp file: ``path`` is the old or the new file.
    """
    tmp = tmp_path(path)
    try:
        with tmp.open("wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def read_meta(path: Path) -> ShardMeta:
    return msgspec.json.decode(path.read_bytes(), type=ShardMeta)


def encode(value: msgspec.Struct) -> bytes:
    return msgspec.json.encode(value)


# --- flattening a state into a JSON tree plus raw leaves ---------------------------

Leaf: TypeAlias = "torch.Tensor | bytes | np.ndarray"
"""What goes to ``.bin``: tensors (any device), bytes-like values, numpy arrays."""


def is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a torch tensor, without importing torch.

    A process that never imported torch holds no tensor. The node agent's checkpoint
    process seals, persists and copies bytes only, and importing torch there cost ~1 s of
    CPU at each agent start, taken from the training ranks on a busy node (measured:
    ``detection.py``'s overhead loop, 2 cores, session 26)."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)  # None: not (yet) imported
    return tensor is not None and isinstance(value, tensor)


@dataclass(frozen=True)
class FlatState:
    """A state split for snapshotting: the JSON tree and its leaves in entry order."""

    tree: Any
    names: tuple[str, ...]
    leaves: tuple[Leaf, ...]


def flatten_state(state: Mapping[str, Any]) -> FlatState:
    """Split ``state`` into a JSON tree and raw leaves; raise ``InvalidArgument`` on anything
    that would need pickling (the message names the path), before anything is written."""
    if not isinstance(state, Mapping):
        raise InvalidArgument(f"state must be a mapping, got {type(state).__name__}")
    names: list[str] = []
    leaves: list[Leaf] = []

    def leaf(tag: str, name: str, value: Leaf) -> dict[str, int]:
        names.append(name)
        leaves.append(value)
        return {tag: len(leaves) - 1}

    def walk(value: Any, path: str) -> Any:  # noqa: PLR0911 - one branch per supported type
        if is_tensor(value):
            if value.layout != sys.modules["torch"].strided or value.is_quantized:
                raise InvalidArgument(
                    f"state[{path}]: only dense tensors can be snapshot, got {value.layout}"
                )
            return leaf("T", path, value.detach())
        if isinstance(value, bytes | bytearray | memoryview):
            return leaf("B", path, bytes(value) if not isinstance(value, bytes) else value)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise InvalidArgument(f"state[{path}]: numpy arrays of Python objects need pickling")
            return leaf("N", path, value)
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return value if -_INT64_MAX - 1 <= value <= _INT64_MAX else {"I": str(value)}
        if isinstance(value, float):
            return value if math.isfinite(value) else {"F": repr(value)}
        if isinstance(value, Mapping):
            return {"D": [[walk(k, f"{path}/<key>"), walk(v, f"{path}/{k}")] for k, v in value.items()]}
        if isinstance(value, list):
            return {"L": [walk(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, tuple):
            return {"U": [walk(v, f"{path}/{i}") for i, v in enumerate(value)]}
        raise InvalidArgument(
            f"state[{path}]: {type(value).__name__} cannot be snapshot without pickling; "
            "use tensors, bytes, numpy arrays, JSON scalars, dicts, lists or tuples"
        )

    tree = {"D": [[walk(key, "<key>"), walk(value, str(key))] for key, value in state.items()]}
    return FlatState(tree, tuple(names), tuple(leaves))


def unflatten_state(tree: Any, leaves: list[Any]) -> dict[Any, Any]:
    """Inverse of ``flatten_state``: rebuild the nested state with ``leaves`` in entry order."""

    def walk(node: Any) -> Any:  # noqa: PLR0911
        if not isinstance(node, dict):
            return node
        ((tag, value),) = node.items()
        if tag in ("T", "B", "N"):
            return leaves[value]
        if tag == "I":
            return int(value)
        if tag == "F":
            return float(value)
        if tag == "D":
            return {_hashable(walk(k)): walk(v) for k, v in value}
        if tag == "L":
            return [walk(v) for v in value]
        if tag == "U":
            return tuple(walk(v) for v in value)
        raise InvalidArgument(f"unknown tree tag {tag!r}")

    result = walk(tree)
    if not isinstance(result, dict):
        raise InvalidArgument("a shard tree must encode a mapping at its root")
    return result


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def leaf_nbytes(value: Leaf) -> int:
    if is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return len(value)


def align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def layout_entries(flat: FlatState) -> tuple[tuple[Entry, ...], int]:
    """Entries (no digests yet) with aligned offsets, and the total data size in bytes."""
    entries: list[Entry] = []
    offset = 0
    for name, value in zip(flat.names, flat.leaves, strict=True):
        offset = align(offset)
        nbytes = leaf_nbytes(value)
        if is_tensor(value):
            kind, dtype, shape = EntryKind.TENSOR, dtype_name(value.dtype), tuple(value.shape)
        elif isinstance(value, np.ndarray):
            kind, dtype, shape = EntryKind.NDARRAY, value.dtype.str, tuple(value.shape)
        else:
            kind, dtype, shape = EntryKind.BYTES, "", (nbytes,)
        entries.append(Entry(name=name, kind=kind, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        offset += nbytes
    return tuple(entries), offset


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    import torch  # only a process that reads tensors pays for it (is_tensor)

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"unknown torch dtype {name!r}")
    return dtype


def entry_digests(entries: tuple[Entry, ...], data: memoryview) -> Iterator[Entry]:
    """``entries`` with their digests computed from ``data`` (the shard's bytes)."""
    for entry in entries:
        yield msgspec.structs.replace(
            entry, digest=digest_bytes(data[entry.offset : entry.offset + entry.nbytes])
        )


def now_unix_s() -> float:
    return time.time()
