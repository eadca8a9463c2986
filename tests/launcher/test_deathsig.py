"""The training command ends with the agent that started it (launcher.deathsig)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher import deathsig
from launcher.supervisor import Supervisor
from unicorn_core.errors import CommandNotFound


def _state(pid: int) -> str:
    """The process's state letter, or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)


def test_the_wrapped_command_runs_with_its_arguments_and_exit_status() -> None:
    code = "import sys; print(sys.argv[1:]); sys.exit(3)"
    out = _run(deathsig.argv_for(os.getpid(), [sys.executable, "-c", code, "a b"]))
    assert (out.returncode, out.stdout) == (3, "['a b']\n")


def test_a_command_that_cannot_run_and_bad_usage_are_clear_errors() -> None:
    out = _run(deathsig.argv_for(os.getpid(), ["/nonexistent/train"]))
    assert out.returncode == 127 and "cannot run /nonexistent/train" in out.stderr
    usage = _run([sys.executable, "-m", "launcher.deathsig", "x", "echo"])
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_a_parent_gone_before_the_signal_was_armed_means_no_run() -> None:
    """A pid above Linux's pid_max limit is never this test's parent: the command must not
    start (as if signalled)."""
    out = _run(deathsig.argv_for(4_194_305, ["echo", "ran"]))
    assert out.returncode == deathsig.EXIT_PARENT_GONE and out.stdout == ""


def test_a_sigkilled_agent_takes_its_training_command_with_it(tmp_path: Path) -> None:
    """The agent's Supervisor starts the command in a session of its own; SIGKILL the agent
    (nothing of it runs) and the command still ends, by SIGTERM from the kernel."""
    agent = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from launcher.supervisor import Supervisor

        async def main():
            sup = Supervisor(["sleep", "120"], env={{"PATH": "/usr/bin:/bin"}},
                             log_path=Path({str(tmp_path / "train.log")!r}),
                             on_line=lambda line: None, on_exit=lambda info: None)
            await sup.start()
            print("PID", sup.proc.pid, flush=True)
            await asyncio.sleep(120)

        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True)
    training = 0
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        training = int(next(line for line in lines if line.startswith("PID ")).split()[1])
        deadline = time.monotonic() + 10
        while Path(f"/proc/{training}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.02)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _state(training) not in ("gone", "Z"):
            assert time.monotonic() < deadline, f"pid {training} outlived its agent ({_state(training)})"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if training and _state(training) not in ("gone", "Z"):
            os.kill(training, signal.SIGKILL)  # the test failed: leave nothing behind


async def test_the_supervisor_still_refuses_a_command_it_cannot_run(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n")
    cases = [(["no-such-trainer-xyz"], "executable not found"), ([str(script)], "not executable")]
    for argv, why in cases:
        sup = Supervisor(
            argv, env={"PATH": "/usr/bin:/bin"}, log_path=tmp_path / "log", on_line=lambda _l: None,
            on_exit=lambda _i: None,
        )  # fmt: skip
        with pytest.raises(CommandNotFound, match=why):
            await sup.start()
        assert sup.proc is None


def test_the_command_gets_the_environment_and_signals_it_would_have_had() -> None:
    """Python's start-up in the wrapper ignores SIGPIPE and SIGXFSZ and, under the C locale,
    sets LC_CTYPE (PEP 538); none of that reaches the command."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "MARK": "kept"}
    probe = "env; grep '^SigIgn:' /proc/self/status"
    out = subprocess.run(
        deathsig.argv_for(os.getpid(), ["sh", "-c", probe]),
        env=env, check=False, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "MARK=kept" in out.stdout and "LC_CTYPE" not in out.stdout and "LC_ALL" not in out.stdout
    ignored = int(out.stdout.split("SigIgn:")[1].split()[0], 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), f"{sig.name} is ignored in the command"
