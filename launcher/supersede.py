"""One agent per job and node: a new agent ends the one before it on its node.

unicornd replaces a node's agent by launching a new one there. With one srun step per
node it could stop the old agent's step first; it cannot when the old agent is one task of
a step that spans the whole job (Slurm signals a step's tasks all together), nor after a
takeover (the new leader holds no step handles). So the agent does it itself, on the node:

- it records its pid and start time in its run folder (``agent.pid``; the folder is per
  installation, job and node, :func:`unicorn_core.paths.agent_run_dir`);
- a new agent for the same folder SIGTERMs the process recorded there (the agent's own
  graceful stop: its ranks get SIGTERM and the grace period, its events are flushed),
  waits up to ``wait_s``, then SIGKILLs it, before it connects to Redis or starts
  anything, so the two never overlap;
- the start time (field 22 of ``/proc/<pid>/stat``) tells a recycled pid from the agent.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from pathlib import Path
from typing import Final

PIDFILE: Final = "agent.pid"
LOCKFILE: Final = "agent.lock"
_POLL_S: Final = 0.05
_KILL_WAIT_S: Final = 10.0
"""How long a SIGKILLed agent may take to go (a process in uninterruptible sleep, e.g. on a
hung filesystem, dies only when it wakes): past it the new agent starts all the same."""


def start_time(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot; None when there is no such process
    or it has exited (a zombie waiting for its parent runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # field 3: the state
        return None
    return int(fields[19])  # field 22 overall


def recorded(run_dir: Path) -> tuple[int, int] | None:
    """(pid, start time) in ``run_dir``'s pidfile; None when absent or unreadable."""
    try:
        pid, started = (int(x) for x in (run_dir / PIDFILE).read_text().split())
    except (FileNotFoundError, ValueError):
        return None
    return pid, started


def _alive(pid: int, started: int) -> bool:
    return start_time(pid) == started


def claim(run_dir: Path, wait_s: float, *, pid: int | None = None) -> int | None:
    """Make ``pid`` (default: this process) the agent of ``run_dir``: end the agent recorded
    there if it still runs (SIGTERM, up to ``wait_s``, then SIGKILL), then record ``pid``.
    Returns the pid of the agent it ended (None: there was none)."""
    pid = os.getpid() if pid is None else pid
    run_dir.mkdir(parents=True, exist_ok=True)
    # One claim at a time: a third agent that starts while the second still waits for the
    # first must then end the second, not also outwait the first and run beside it.
    with (run_dir / LOCKFILE).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _claim_locked(run_dir, wait_s, pid)


def _claim_locked(run_dir: Path, wait_s: float, pid: int) -> int | None:
    ended = None
    old = recorded(run_dir)
    if old is not None and old[0] != pid and _alive(*old):
        ended = old[0]
        with contextlib.suppress(ProcessLookupError):
            os.kill(old[0], signal.SIGTERM)
            os.kill(old[0], signal.SIGCONT)  # a stopped agent (SIGSTOP, a debugger) stops gracefully too
        deadline = time.monotonic() + wait_s
        while _alive(*old) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if _alive(*old):
            with contextlib.suppress(ProcessLookupError):
                os.kill(old[0], signal.SIGKILL)
            deadline = time.monotonic() + _KILL_WAIT_S
            while _alive(*old) and time.monotonic() < deadline:  # SIGKILL cannot be refused
                time.sleep(_POLL_S)
    started = start_time(pid)
    tmp = run_dir / f".{PIDFILE}.{pid}"
    tmp.write_text(f"{pid} {started}\n")
    tmp.replace(run_dir / PIDFILE)
    return ended


def release(run_dir: Path, *, pid: int | None = None) -> None:
    """Remove ``run_dir``'s pidfile if it still names ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    mine = recorded(run_dir)
    if mine is not None and mine[0] == pid:
        with contextlib.suppress(FileNotFoundError):
            (run_dir / PIDFILE).unlink()
