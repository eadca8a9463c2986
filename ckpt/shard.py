"""Reading and sealing one shard copy, in any tier.

Concurrency contract (all tiers, all processes): the ``.bin`` file is the lock. A
snapshot writer holds ``flock(LOCK_EX)`` on it while it evicts, renames and overwrites
it; readers (restore, persistence, sealing, peer serving) hold ``LOCK_SH`` for as long
as they read. A reader re-checks, once locked, that the path still names the inode it
opened and that the metadata still exists, so a slot reused between ``open`` and
``flock`` is reported ``missing`` rather than read. ``flock`` locks die with their
process, so a killed rank or agent never leaves a slot locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

import msgspec
import numpy as np

from ckpt.errors import ShardUnavailable
from ckpt.format import (
    DoneMarker,
    Entry,
    EntryKind,
    ShardMeta,
    ShardPaths,
    ShardState,
    check_transition,
    digest_bytes,
    encode,
    entry_digests,
    read_meta,
    torch_dtype,
    unflatten_state,
    write_atomic,
)

if TYPE_CHECKING:
    import torch

_LOCK_POLL_S: Final = 0.002
VERIFY_THREADS: Final = max(1, min(8, os.cpu_count() or 1))
"""Checksum threads per process: xxh3 releases the GIL on large buffers, and the page
faults of a fresh mapping are taken in parallel too (256 MiB from shm, 2 cores: 41 ms on
one thread, 28 ms on two; ``scripts/bench/ckpt.py``)."""
_PARALLEL_MIN_BYTES: Final = 8 << 20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _verify_pool() -> ThreadPoolExecutor:
    global _pool  # noqa: PLW0603 - one lazily created pool per process
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="ckpt-verify")
        return _pool


def advise_huge_pages(mm: mmap.mmap) -> None:
    """``madvise(MADV_HUGEPAGE)`` where the platform has it; a refusal changes nothing.

    Mapping a 256 MiB shard as 4 KiB pages costs ~65,000 page faults, more than hashing
    it; on a tmpfs with huge pages (``huge=within_size``, or ``huge=advise`` plus this
    call) it is 128 faults, and restore is ~3x faster (``BENCHMARKS.md``).
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            mm.madvise(advice)


def flock_with_timeout(fd: int, operation: int, timeout_s: float, what: str) -> None:
    """``flock(fd, operation)`` retried until ``timeout_s``; ``ShardUnavailable('busy')`` after."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ShardUnavailable("busy", f"{what} stayed locked for {timeout_s:g} s") from None
            time.sleep(_LOCK_POLL_S)


class OpenShard:
    """One shard copy opened for reading under a shared lock (a context manager).

    With ``require_sealed`` (the default) the copy must be sealed: state ``sealed``, every
    entry digested, and a done marker whose digest matches the metadata; otherwise
    ``ShardUnavailable('incomplete' | 'corrupt')``. Entry bytes are verified on first
    access (``verify=True``) or all at once with :meth:`verify`.

    Tensors returned with ``copy=False`` are zero-copy views of a private mapping of the
    file: valid only until :meth:`close` (after which a writer may reuse the file).
    """

    def __init__(
        self, paths: ShardPaths, *, require_sealed: bool = True, lock_timeout_s: float = 5.0
    ) -> None:
        self.paths = paths
        self._verified: set[int] = set()
        self._mm: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        try:
            self._fd = os.open(paths.bin, os.O_RDONLY)
        except FileNotFoundError:
            raise ShardUnavailable("missing", f"{paths.bin} does not exist") from None
        try:
            flock_with_timeout(self._fd, fcntl.LOCK_SH, lock_timeout_s, str(paths.bin))
            self.meta = self._read_meta(require_sealed)
        except BaseException:
            os.close(self._fd)
            raise
        if self.meta.data_bytes:
            self._mm = mmap.mmap(self._fd, self.meta.data_bytes, access=mmap.ACCESS_COPY)
            advise_huge_pages(self._mm)
        self._by_name = {entry.name: i for i, entry in enumerate(self.meta.entries)}

    def _read_meta(self, require_sealed: bool) -> ShardMeta:
        paths = self.paths
        try:
            same = paths.bin.stat().st_ino == os.fstat(self._fd).st_ino
            meta = read_meta(paths.meta)
        except FileNotFoundError:
            same = False
        except msgspec.MsgspecError as exc:
            raise ShardUnavailable("corrupt", f"{paths.meta}: {exc}") from None
        if not same:
            raise ShardUnavailable("missing", f"{paths.meta} vanished (slot reused or evicted)")
        size = os.fstat(self._fd).st_size
        if size < meta.data_bytes:
            raise ShardUnavailable(
                "incomplete", f"{paths.bin} holds {size} bytes, metadata says {meta.data_bytes}"
            )
        if not require_sealed:
            return meta
        if meta.state != ShardState.SEALED or any(e.digest is None for e in meta.entries):
            raise ShardUnavailable("incomplete", f"{paths.meta} is {meta.state}, not sealed")
        try:
            done = msgspec.json.decode(paths.done.read_bytes(), type=DoneMarker)
        except FileNotFoundError:
            raise ShardUnavailable("incomplete", f"{paths.done} is missing") from None
        except msgspec.DecodeError as exc:
            raise ShardUnavailable("corrupt", f"{paths.done}: {exc}") from None
        if done.digest != meta.shard_digest() or done.data_bytes != meta.data_bytes:
            raise ShardUnavailable("corrupt", f"{paths.done} does not match {paths.meta}")
        return meta

    # -- access ---------------------------------------------------------------------

    def entry(self, name: str) -> Entry:
        return self.meta.entries[self._by_name[name]]

    def index(self, name: str) -> int:
        """The position of entry ``name`` (``KeyError`` if the shard has none)."""
        return self._by_name[name]

    def view(self, entry: Entry) -> memoryview:
        """The raw bytes of ``entry`` (not verified)."""
        if self._mm is None:
            return memoryview(b"")
        return memoryview(self._mm)[entry.offset : entry.offset + entry.nbytes]

    def data(self) -> memoryview:
        """All ``data_bytes`` of the shard (not verified)."""
        return memoryview(self._mm) if self._mm is not None else memoryview(b"")

    def fileno(self) -> int:
        """The locked ``.bin`` file's descriptor (for ``sendfile``); valid until :meth:`close`."""
        return self._fd

    def verify_entry(self, index: int) -> None:
        if index in self._verified:
            return
        entry = self.meta.entries[index]
        if entry.digest is None:
            raise ShardUnavailable("incomplete", f"{self.paths.meta}: entry {entry.name} has no checksum")
        actual = digest_bytes(self.view(entry))
        if actual != entry.digest:
            raise ShardUnavailable(
                "corrupt", f"{self.paths.bin}: entry {entry.name} checksum {actual} != {entry.digest}"
            )
        self._verified.add(index)

    def verify(self) -> None:
        """Check every entry's checksum; ``ShardUnavailable('corrupt')`` on the first mismatch."""
        self.verify_entries(range(len(self.meta.entries)))

    def verify_entries(self, indices: Iterable[int]) -> None:
        """Check these entries' checksums, on ``VERIFY_THREADS`` threads when there is
        enough to hash; the first mismatch (in entry order) raises ``ShardUnavailable``."""
        todo = sorted({i for i in indices if i not in self._verified})
        total = sum(self.meta.entries[i].nbytes for i in todo)
        if VERIFY_THREADS == 1 or len(todo) < 2 or total < _PARALLEL_MIN_BYTES:
            for index in todo:
                self.verify_entry(index)
            return
        # Results come back in submission order, so the error raised is the first entry's.
        for _ in _verify_pool().map(self.verify_entry, todo):
            pass

    def value(self, name: str, *, copy: bool = False, verify: bool = True) -> Any:
        """One leaf: a tensor, ``bytes`` or a numpy array (``copy=False``: a view, see class doc)."""
        index = self._by_name[name]
        if verify:
            self.verify_entry(index)
        return self._leaf(self.meta.entries[index], copy)

    def _leaf(self, entry: Entry, copy: bool) -> Any:
        if entry.kind == EntryKind.BYTES:
            return bytes(self.view(entry))
        if entry.kind == EntryKind.NDARRAY:
            array = np.frombuffer(self.view(entry), dtype=np.dtype(entry.dtype)).reshape(entry.shape)
            return array.copy() if copy else array
        import torch  # tensors only: sealing and copying need no torch (format.is_tensor)

        dtype = torch_dtype(entry.dtype)
        if entry.nbytes == 0 or self._mm is None:
            return torch.empty(entry.shape, dtype=dtype)
        if self._base is None:
            self._base = torch.frombuffer(self._mm, dtype=torch.uint8)
        tensor = self._base[entry.offset : entry.offset + entry.nbytes].view(dtype).view(entry.shape)
        return tensor.clone() if copy else tensor

    def state_dict(self, *, copy: bool = True, verify: bool = True) -> dict[Any, Any]:
        """The state as it was snapshot (nested containers rebuilt from the tree)."""
        if verify:
            self.verify()
        return unflatten_state(self.meta.tree, [self._leaf(e, copy) for e in self.meta.entries])

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Release the lock. Zero-copy views stay mapped until they are freed."""
        self._base = None
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # views still exported: the mapping dies with them
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> OpenShard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def seal_shard(paths: ShardPaths, *, durable: bool = False, lock_timeout_s: float = 5.0) -> ShardMeta:
    """Compute a ``copied`` shard's checksums and mark it ``sealed`` (idempotent).

    Runs off the training thread (the node agent, or a rank's helper thread): the rank
    only waits for its copy. Concurrent sealers write identical files, so a race between
    the rank and its agent is harmless.
    """
    with OpenShard(paths, require_sealed=False, lock_timeout_s=lock_timeout_s) as shard:
        meta = shard.meta
        if meta.state == ShardState.SEALED and paths.done.exists():
            return meta
        check_transition(meta.state, ShardState.SEALED)
        entries = tuple(entry_digests(meta.entries, shard.data()))
        sealed = msgspec.structs.replace(meta, state=ShardState.SEALED, entries=entries)
        write_atomic(paths.meta, encode(sealed), durable=durable)
        marker = DoneMarker(digest=sealed.shard_digest(), data_bytes=sealed.data_bytes)
        write_atomic(paths.done, encode(marker), durable=durable)
        return sealed
