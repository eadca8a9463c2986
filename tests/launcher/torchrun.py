"""Run ``unicorn-train`` under a real torchrun (``--standalone``: own free port) from tests.

Each launch runs in its own session; on timeout (or an interrupted test) the whole group
is killed by its process-group id, the pid of the torchrun we started, before that pid
is reaped; never by name. On a normal exit torchrun has already stopped its workers.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")


@dataclass(frozen=True)
class Launch:
    returncode: int
    output: str

    @property
    def losses(self) -> dict[int, float]:
        """Iteration -> lm loss from the Megatron-format log lines."""
        return {int(m[1]): float(m[2]) for m in LOSS_LINE.finditer(self.output)}


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", "-m", "launcher.train", *args]


def start(nproc: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start torchrun; ``env`` adds variables (e.g. the agent's hook socket, which is otherwise unset)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("UNICORN_")}
    env = {**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        torchrun_cmd(nproc, *args),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout_s: float = 120) -> Launch:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException:
        # Not reaped yet, so the group id (our torchrun's pid) cannot have been reused.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout_s} s:\n{out[-4000:]}") from None
    return Launch(proc.returncode, out)


def run(nproc: int, *args: str, timeout_s: float = 120, env: dict[str, str] | None = None) -> Launch:
    return finish(start(nproc, *args, env=env), timeout_s)
