"""In-process hook: how a training process tells its node agent what happens inside it.

A training script calls :func:`get_hook` once and then :meth:`Hook.iteration` after each
step; :meth:`Hook.install` makes uncaught exceptions reach the agent before the process
dies. Outside an agent (``UNICORN_HOOK_SOCKET`` unset) every call is a cheap no-op, so
the same script runs with or without unicorn.

Transport: one Unix *datagram* per message to the agent's socket, encoded with
:mod:`unicorn_core.protocol` (the same messages the agent forwards to Redis). Datagrams
keep message boundaries without framing and never block the training loop: an
iteration report that finds the agent's queue full is dropped and counted
(:attr:`Hook.dropped`). Exceptions are sent blocking with a short timeout because they
are the last thing a dying rank says.

The agent exports, for every process it starts:

- ``UNICORN_HOOK_SOCKET``: path of the agent's datagram socket;
- ``UNICORN_JOB_ID`` and ``UNICORN_NODE``: the envelope of every message.

The rank comes from ``RANK`` (set by torchrun), else 0.

This module imports no ML framework; it is safe in any Python training process.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Final

from unicorn_core import protocol
from unicorn_core.errors import ProtocolError
from unicorn_core.protocol import ExceptionReport, IterationPhase, IterationTiming, SlowStep

ENV_SOCKET: Final = "UNICORN_HOOK_SOCKET"
ENV_JOB_ID: Final = "UNICORN_JOB_ID"
ENV_NODE: Final = "UNICORN_NODE"

MAX_DATAGRAM: Final = 64 * 1024
"""Largest datagram the hook sends; tracebacks are truncated (tail kept) to fit."""

_EXCEPTION_SEND_TIMEOUT_S: Final = 0.5


class Hook:
    """Reporter bound to one agent socket (or disabled when ``socket_path`` is None)."""

    def __init__(self, socket_path: str | None, job_id: int, node: str, rank: int) -> None:
        self.socket_path = socket_path
        self.job_id = job_id
        self.node = node
        self.rank = rank
        self.sent = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._last_iteration: int | None = None
        self._sock: socket.socket | None = None
        if socket_path is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def iteration(
        self,
        iteration: int,
        duration_s: float,
        *,
        samples: int | None = None,
        phase: IterationPhase | str = IterationPhase.TRAIN,
        loss: float | None = None,
        final: bool = False,
        microbatches: int | None = None,
        recomputed_microbatches: int | None = None,
        compute_s: float | None = None,
        stage: int | None = None,
    ) -> None:
        """Report that this rank finished ``iteration`` in ``duration_s`` seconds. Never blocks.

        ``final``: the run's last iteration (its ranks end next: their silence is no hang).
        ``microbatches``: micro-batches per iteration over all replicas;
        ``recomputed_microbatches``: of those, how many this iteration computed again after
        a replica was lost mid-iteration (see :class:`IterationTiming`). ``compute_s``: the
        rank's own compute time, waits on peers excluded; ``stage``: its pipeline stage
        (stragglers are found from both, :mod:`detect.stragglers`)."""
        if self._sock is None:
            return
        if phase == IterationPhase.TRAIN:
            self._last_iteration = iteration
        msg = IterationTiming(
            job_id=self.job_id,
            node=self.node,
            wall_time_s=time.time(),
            rank=self.rank,
            iteration=iteration,
            duration_s=max(0.0, duration_s),
            samples=samples,
            phase=IterationPhase(phase),
            loss=loss,
            final=final,
            microbatches=microbatches,
            recomputed_microbatches=recomputed_microbatches,
            compute_s=None if compute_s is None else max(0.0, compute_s),
            stage=stage,
        )
        self._send(protocol.encode(msg), blocking=False)

    def slow_step(self, phase: IterationPhase | str = IterationPhase.CHECKPOINT) -> None:
        """Announce, *before* it starts, that this rank's next report comes after a slow
        step (a checkpoint save, an evaluation), so hang detection allows that phase's
        time instead of the training deadline. Never blocks."""
        if self._sock is None:
            return
        iteration = 0 if self._last_iteration is None else self._last_iteration + 1
        msg = SlowStep(
            job_id=self.job_id,
            node=self.node,
            wall_time_s=time.time(),
            rank=self.rank,
            iteration=iteration,
            phase=IterationPhase(phase),
        )
        self._send(protocol.encode(msg), blocking=False)

    def exception(self, exc: BaseException) -> None:
        """Report ``exc`` (with its traceback) to the agent; waits at most 0.5 s."""
        if self._sock is None:
            return
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        budget = MAX_DATAGRAM - 4096
        msg = ExceptionReport(
            job_id=self.job_id,
            node=self.node,
            wall_time_s=time.time(),
            rank=self.rank,
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc)[:2048],
            traceback=tb[-budget:],
        )
        try:
            data = protocol.encode(msg)
        except ProtocolError:
            self.dropped += 1
            return
        self._send(data, blocking=True)

    def install(self) -> None:
        """Chain :func:`sys.excepthook` and :func:`threading.excepthook` to :meth:`exception`."""
        if self._sock is None:
            return
        previous = sys.excepthook
        previous_thread = threading.excepthook

        def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            if not isinstance(exc, KeyboardInterrupt | SystemExit):
                self.exception(exc)
            previous(exc_type, exc, tb)

        def thread_hook(args: threading.ExceptHookArgs) -> None:
            if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
                self.exception(args.exc_value)
            previous_thread(args)

        sys.excepthook = hook
        threading.excepthook = thread_hook

    def _send(self, data: bytes, *, blocking: bool) -> None:
        assert self._sock is not None and self.socket_path is not None
        if len(data) > MAX_DATAGRAM:
            self.dropped += 1
            return
        with self._lock:
            try:
                if blocking:
                    self._sock.settimeout(_EXCEPTION_SEND_TIMEOUT_S)
                    self._sock.sendto(data, self.socket_path)
                else:
                    self._sock.sendto(data, socket.MSG_DONTWAIT, self.socket_path)
            except OSError:  # agent gone, queue full, or timed out: training goes on
                self.dropped += 1
                return
            self.sent += 1

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


_HOOK: Hook | None = None


def get_hook() -> Hook:
    """The process-wide hook configured from the environment (see module docstring)."""
    global _HOOK  # noqa: PLW0603 - one hook per process, created lazily
    if _HOOK is None:
        path = os.environ.get(ENV_SOCKET) or None
        try:
            job_id = int(os.environ.get(ENV_JOB_ID, "0"))
            rank = int(os.environ.get("RANK", "0"))
        except ValueError:
            path, job_id, rank = None, 0, 0
        node = os.environ.get(ENV_NODE) or socket.gethostname() or "localhost"
        _HOOK = Hook(path, job_id, node, rank)
    return _HOOK
