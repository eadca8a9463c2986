"""Run a command that ends with its parent: ``python -m launcher.deathsig PPID -- ARGV...``.

The agent starts torchrun in a session of its own, so that stopping it signals the
training's process groups and never the agent. A SIGKILLed agent (the OOM killer, a test,
a step killed where Slurm tracks processes by group rather than cgroup) then left torchrun
and its ranks running on the node's GPUs with nobody to stop them; a later agent on the
node trained beside them. ``PR_SET_PDEATHSIG`` makes the kernel send SIGTERM to this
process when its parent dies, and it survives the ``execve`` into the command: torchrun
stops its workers on SIGTERM (a SIGKILLed torchrun would orphan them in turn).

This is a program, not a ``preexec_fn``: code between ``fork`` and ``exec`` in a process
with threads (the agent has them) may deadlock on a lock another thread held. The command
gets the environment and signal dispositions it would have had without this wrapper.

Limits: the signal fires when the *thread* that forked this process ends, so the agent
starts it from its event loop's (main) thread. It reaches the command itself only; a
command that does not stop its children on SIGTERM (a shell script running torchrun in
the foreground, without ``exec``) leaves them running as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Final

PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>
EXIT_PARENT_GONE: Final = 128 + signal.SIGTERM
"""Exit status when the parent died before the signal was armed (as if it had arrived)."""


def argv_for(parent_pid: int, argv: list[str]) -> list[str]:
    """``argv`` run through this module with ``parent_pid`` as the parent it dies with."""
    return [sys.executable, "-I", "-m", "launcher.deathsig", str(parent_pid), "--", *argv]


def arm(parent_pid: int) -> bool:
    """Ask for SIGTERM when the parent dies; False if the parent is gone already.

    Where ``prctl`` is missing or fails (not Linux) the command still runs, without it."""
    try:
        failed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0
        why = os.strerror(ctypes.get_errno()) if failed else ""
    except AttributeError:
        failed, why = True, "no prctl in this C library"
    if failed:
        print(f"deathsig: prctl(PR_SET_PDEATHSIG) failed: {why}", file=sys.stderr)
    # The parent may have died before prctl: then this process was reparented already.
    return os.getppid() == parent_pid


def initial_environment() -> dict[str, str]:
    """The environment this process was started with. Python's start-up may have changed
    its own (PEP 538 sets ``LC_CTYPE`` under the C locale); the command gets the original."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {os.fsdecode(k): os.fsdecode(v) for k, v in pairs}


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        print("usage: python -m launcher.deathsig PARENT_PID -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    if not arm(int(args[0])):
        return EXIT_PARENT_GONE
    command = args[2:]
    # Python ignores these at start-up and execve keeps ignored signals ignored; the command
    # gets the defaults, as subprocess's restore_signals gave it before this wrapper.
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvpe(command[0], command, initial_environment())  # noqa: S606 (the caller's argv, no shell)
    except OSError as e:  # execvpe returns only by raising
        print(f"deathsig: cannot run {command[0]}: {e}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
