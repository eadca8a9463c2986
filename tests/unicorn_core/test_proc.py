"""The external-call choke point, against real processes."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tests.conftest import pid_alive
from unicorn_core import proc
from unicorn_core.errors import CommandFailed, CommandNotFound, CommandTimeout


async def test_output_and_exit_code() -> None:
    out = await proc.run(["sh", "-c", "echo out; echo err >&2"], timeout_s=5)
    assert (out.exit_code, out.stdout, out.stderr) == (0, "out\n", "err\n")


async def test_failure_carries_command_code_and_output() -> None:
    with pytest.raises(CommandFailed) as ei:
        await proc.run(["sh", "-c", "echo partial; echo broken >&2; exit 3"], timeout_s=5)
    e = ei.value
    assert (e.command, e.exit_code, e.stdout, e.stderr) == (
        ("sh", "-c", "echo partial; echo broken >&2; exit 3"),
        3,
        "partial\n",
        "broken\n",
    )
    assert "broken" in str(e) and "exited with 3" in str(e)


async def test_no_check_returns_nonzero() -> None:
    out = await proc.run(["sh", "-c", "exit 4"], timeout_s=5, check=False)
    assert out.exit_code == 4


async def test_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pidfile}; echo started; wait"
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout) as ei:
        await proc.run(["sh", "-c", script], timeout_s=3)  # time to write both, even loaded
    assert time.monotonic() - t0 < 15  # not the grandchild's 60 s (it holds the pipes)
    assert ei.value.exit_code is None and ei.value.timeout_s == 3
    assert ei.value.stdout == "started\n" and ei.value.temporary
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if not pid_alive(grandchild):
            break
        await asyncio.sleep(0.02)
    else:
        os.kill(grandchild, 9)
        pytest.fail("grandchild survived the timeout")


async def test_stdin_input() -> None:
    out = await proc.run(["cat"], timeout_s=5, input_text="hello")
    assert out.stdout == "hello"


async def test_missing_executable() -> None:
    with pytest.raises(CommandNotFound):
        await proc.run(["/nonexistent/tool"], timeout_s=5)


async def test_bad_timeout_rejected() -> None:
    with pytest.raises(ValueError):
        await proc.run(["true"], timeout_s=0)
