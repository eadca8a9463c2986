"""Just-in-time checkpoint: snapshot the last consistent state the moment a failure is seen.

Contract with the training loop (the built-in trainer follows it; any loop can):

1. Build ``JitCheckpointer(writer, state_fn, request_file=...)`` and ``start()`` it.
   ``state_fn()`` returns the state to snapshot (model, optimizer, RNG, data position).
2. Wrap every step that *mutates* that state (optimizer step, scheduler, data-position
   advance) in ``with jit.updating():`` and call ``jit.completed(iteration)`` right
   after, inside or outside the block. Forward and backward passes need no wrapping:
   they do not change the state.
3. Take periodic snapshots through ``jit.snapshot(iteration)`` (same lock, same writer),
   or save in the loop's own format inside ``with jit.saving():``.

Contract with the node agent (on the coordinator's ``checkpoint_now`` order, after a
failure is detected and before teardown): ``request_jit(shm_root, job_id, request_id)``
atomically writes ``<shm_root>/<job_id>/jit-request.json``. Each rank's JIT thread polls
that file (every ``poll_interval_s``; a signal via ``install_signal`` or ``trigger()``
wakes it at once), waits for any in-progress update to finish (at most
``lock_timeout_s``, since a step stuck in a collective with a dead peer may never end),
and snapshots ``state_fn()`` as the last completed iteration, tagging the shard metadata
with ``extra["jit_request"] = request_id``. The agent then collects the answers with
``jit_responses``. The thread never calls a collective, so a dead peer cannot block it;
at most the iteration in flight is lost.

Signals: CPython runs a Python signal handler only when the main thread returns to the
interpreter, never while it waits in C (a collective with a dead peer). ``watch_signals``
therefore listens on the interpreter's wakeup fd, which its C-level handler writes at
once: a SIGTERM from torchrun or the agent snapshots the last completed iteration even
when the main thread will never run the loop's own handler. A rank whose own step raised
calls ``take_now`` on its way out. An exception out of ``updating()`` marks the state
inconsistent: no JIT snapshot until the next ``completed``. A JIT snapshot of an iteration
that ``saved`` already reported (a periodic save, the restored version) is skipped.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, Final

import msgspec

from ckpt.errors import InvalidArgument
from ckpt.format import ShardState, check_job_id, now_unix_s, read_meta, write_atomic
from ckpt.snapshot import SnapshotHandle, SnapshotWriter
from ckpt.tier import TierDir
from unicorn_core.logs import get_logger

REQUEST_FILE: Final = "jit-request.json"


class JitRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    requested_unix_s: float


def request_path(shm_root: Path, job_id: str) -> Path:
    return Path(shm_root) / check_job_id(job_id) / REQUEST_FILE


def request_jit(shm_root: Path, job_id: str, request_id: str) -> Path:
    """Agent side: order every rank of this node to snapshot now (atomic write)."""
    if not request_id:
        raise InvalidArgument("request_id must be non-empty")
    path = request_path(shm_root, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(
        path,
        msgspec.json.encode(JitRequest(request_id=request_id, requested_unix_s=now_unix_s())),
        durable=False,
    )
    return path


def jit_responses(shm: TierDir, request_id: str) -> dict[int, int]:
    """Agent side: rank -> iteration of the snapshots taken for ``request_id`` (copied or sealed)."""
    found: dict[int, int] = {}
    for iteration in shm.iterations():
        for meta_path in shm.metas(iteration):
            try:
                meta = read_meta(meta_path)
            except (OSError, msgspec.MsgspecError):
                continue
            if meta.extra.get("jit_request") == request_id and meta.state in (
                ShardState.COPIED,
                ShardState.SEALED,
            ):
                found[meta.rank] = max(found.get(meta.rank, -1), meta.iteration)
    return found


class JitCheckpointer:
    """The rank side of the contract above. Thread-safe."""

    def __init__(
        self,
        writer: SnapshotWriter,
        state_fn: Callable[[], Mapping[str, Any]],
        *,
        request_file: Path | None = None,
        poll_interval_s: float = 0.05,
        lock_timeout_s: float = 30.0,
    ) -> None:
        if poll_interval_s <= 0 or lock_timeout_s <= 0:
            raise InvalidArgument("poll_interval_s and lock_timeout_s must be > 0")
        self.writer = writer
        self.state_fn = state_fn
        self.request_file = request_file
        self.poll_interval_s = poll_interval_s
        self.lock_timeout_s = lock_timeout_s
        self.last_completed: int | None = None
        self.last_saved: int | None = None
        self.last_jit: SnapshotHandle | None = None
        self._dirty = False
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._forced: str | None = None
        self._handled: str | None = self._read_request_id()  # a request older than this rank is not for it
        self._thread: threading.Thread | None = None
        self._log = get_logger("ckpt.jit", job_id=writer.job_id, rank=writer.rank)

    # -- training-loop side -----------------------------------------------------------

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Hold while the state changes; a JIT snapshot waits for the block to end.

        An exception out of the block leaves the state half-updated: no JIT snapshot is
        taken until the next :meth:`completed`.
        """
        with self._lock:
            try:
                yield
            except BaseException:
                self._dirty = True
                raise

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Hold while the loop saves the state itself (it only reads it): a JIT snapshot
        waits for the block to end, and a save that fails (a collective save whose peer
        died) leaves the state consistent, so the JIT snapshot is still taken."""
        with self._lock:
            yield

    def completed(self, iteration: int) -> None:
        """The state now is the consistent state after ``iteration``."""
        self.last_completed = iteration
        self._dirty = False

    def saved(self, iteration: int) -> None:
        """A complete version of ``iteration`` exists already: a JIT request for it is skipped."""
        self.last_saved = iteration if self.last_saved is None else max(self.last_saved, iteration)

    def replaced(self, iteration: int) -> None:
        """The loop's own save of ``iteration`` replaced what a JIT snapshot had written for it
        (a deduplicated collective save over a complete JIT copy): the next request takes it
        again."""
        with self._lock:
            if self.last_saved is not None and self.last_saved >= iteration:
                self.last_saved = None

    def snapshot(self, iteration: int, *, extra: Mapping[str, Any] | None = None) -> SnapshotHandle:
        """A periodic snapshot, serialised with JIT snapshots."""
        with self._lock:
            handle = self.writer.snapshot(self.state_fn(), iteration, extra=extra)
        self.saved(iteration)
        return handle

    def take_now(self, request_id: str) -> bool:
        """Snapshot the last completed iteration from the calling thread (a rank whose own
        step raised, before it exits); returns whether a snapshot was taken."""
        return self._take(request_id)

    # -- triggers ---------------------------------------------------------------------

    def trigger(self, request_id: str = "local") -> None:
        """Ask for a JIT snapshot from this process (safe in a signal handler: sets an event)."""
        self._forced = request_id
        self._wake.set()

    def install_signal(self, signum: int = signal.SIGUSR1) -> None:
        """Make ``signum`` trigger a JIT snapshot. Call from the main thread, in ``main()``.

        The handler runs only when the main thread is in the interpreter; for a loop with
        its own handler, or one that may be blocked in C, use :meth:`watch_signals`."""

        def handler(_signum: int, _frame: FrameType | None) -> None:
            self.trigger(f"signal-{signum}")

        signal.signal(signum, handler)

    def watch_signals(self, *signums: int) -> None:
        """Trigger a snapshot on each of ``signums``, even while the main thread is blocked in C.

        Each signal must already have a Python handler (the loop's own, e.g. its SIGTERM
        stop flag): the interpreter writes the wakeup fd only for those. Call from the main
        thread, before :meth:`start`. Takes the process's wakeup fd (asyncio uses it too):
        raises InvalidArgument when another one is installed.
        """
        for signum in signums:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.SIG_IGN, None):
                raise InvalidArgument(f"signal {signum} has no Python handler; install the loop's first")
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        reader.settimeout(self.poll_interval_s * 4)
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            raise InvalidArgument(f"a wakeup fd ({previous}) is installed already")
        self._wakeup = (reader, writer)
        watched = frozenset(int(s) for s in signums)
        threading.Thread(
            target=self._read_wakeup, args=(reader, watched), name="ckpt-jit-signals", daemon=True
        ).start()

    def _read_wakeup(self, reader: socket.socket, watched: frozenset[int]) -> None:
        while not self._stop.is_set():
            try:
                data = reader.recv(64)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in watched:
                    self.trigger(f"signal-{signum}")

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ckpt-jit", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._wakeup is not None:
            with contextlib.suppress(ValueError):  # not the main thread: leave the fd to exit
                signal.set_wakeup_fd(-1)
            for sock in self._wakeup:
                sock.close()
            self._wakeup = None

    # -- the thread -------------------------------------------------------------------

    def _read_request_id(self) -> str | None:
        if self.request_file is None:
            return None
        try:
            return msgspec.json.decode(self.request_file.read_bytes(), type=JitRequest).request_id
        except (OSError, msgspec.MsgspecError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            request_id, self._forced = self._forced, None
            if request_id is None:
                current = self._read_request_id()
                if current is not None and current != self._handled:
                    request_id = self._handled = current
            if request_id is not None:
                self._take(request_id)

    def _take(self, request_id: str) -> bool:
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            self._log.error(
                "jit snapshot refused: state update did not finish",
                request_id=request_id,
                timeout_s=self.lock_timeout_s,
            )
            return False
        try:
            iteration = self.last_completed
            if iteration is None or self._dirty:
                why = "no iteration completed yet" if iteration is None else "an update failed midway"
                self._log.warning(f"jit snapshot skipped: {why}", request_id=request_id)
                return False
            if self.last_saved is not None and iteration <= self.last_saved:
                self._log.info(
                    "jit snapshot skipped: saved already", request_id=request_id, iteration=iteration
                )
                return False
            stall_s = self._write(iteration, request_id)
            self.last_saved = iteration
            self._log.info(
                "jit snapshot taken", request_id=request_id, iteration=iteration, stall_s=round(stall_s, 4)
            )
            return True
        except Exception as exc:  # the thread must survive to serve the next request
            self._log.error("jit snapshot failed", request_id=request_id, error=repr(exc))
            return False
        finally:
            self._lock.release()

    def _write(self, iteration: int, request_id: str) -> float:
        """Write the JIT snapshot of ``iteration``; returns the seconds it blocked. Called
        under the lock. A subclass may write another format (the trainer writes DCP)."""
        self.last_jit = self.writer.snapshot(self.state_fn(), iteration, extra={"jit_request": request_id})
        return self.last_jit.stall_s
