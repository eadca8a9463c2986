"""A new agent ends the agent before it on its node (launcher/supersede.py), with real
processes standing in for the old agent."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from launcher import supersede

_WAIT = "print('up', flush=True)\ntime.sleep(60)\n"
GRACEFUL = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n" + _WAIT
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + _WAIT


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def old_agent(procs: list[subprocess.Popen[str]], code: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up\n"  # its handler is installed
    procs.append(p)
    return p


def claiming(run_dir: Path) -> bool:
    """Whether a claim holds ``run_dir``'s lock."""
    with (run_dir / supersede.LOCKFILE).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def test_a_new_agent_stops_the_old_one_gracefully_and_takes_its_place(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    old = old_agent(procs, GRACEFUL)
    assert supersede.claim(tmp_path, 5.0, pid=old.pid) is None  # the first agent: nothing to end
    t0 = time.monotonic()
    assert supersede.claim(tmp_path, 5.0) == old.pid
    assert old.wait(timeout=5) == 0 and time.monotonic() - t0 < 4.0  # its own SIGTERM exit, not a kill
    assert supersede.recorded(tmp_path) == (os.getpid(), supersede.start_time(os.getpid()))


def test_an_agent_that_ignores_sigterm_is_killed_after_the_wait(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    old = old_agent(procs, STUBBORN)
    supersede.claim(tmp_path, 5.0, pid=old.pid)
    t0 = time.monotonic()
    assert supersede.claim(tmp_path, 0.5) == old.pid
    assert old.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - t0 >= 0.5


def test_a_stopped_agent_is_resumed_to_stop_gracefully(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    old = old_agent(procs, GRACEFUL)
    supersede.claim(tmp_path, 5.0, pid=old.pid)
    os.kill(old.pid, signal.SIGSTOP)
    assert supersede.claim(tmp_path, 5.0) == old.pid
    assert old.wait(timeout=5) == 0


def test_a_recycled_or_dead_pid_is_left_alone(tmp_path: Path, procs: list[subprocess.Popen[str]]) -> None:
    bystander = old_agent(procs, GRACEFUL)
    started = supersede.start_time(bystander.pid)
    assert started is not None
    (tmp_path / supersede.PIDFILE).write_text(f"{bystander.pid} {started - 1}\n")  # same pid, another process
    assert supersede.claim(tmp_path, 0.5) is None and bystander.poll() is None
    (tmp_path / supersede.PIDFILE).write_text("not a pid\n")
    assert supersede.claim(tmp_path, 0.5) is None
    assert supersede.recorded(tmp_path) == (os.getpid(), supersede.start_time(os.getpid()))


def test_release_removes_only_its_own_record(tmp_path: Path, procs: list[subprocess.Popen[str]]) -> None:
    other = old_agent(procs, GRACEFUL)
    supersede.claim(tmp_path, 5.0, pid=other.pid)
    supersede.release(tmp_path)  # not ours: kept
    assert supersede.recorded(tmp_path) is not None
    supersede.release(tmp_path, pid=other.pid)
    assert supersede.recorded(tmp_path) is None
    assert [p.name for p in tmp_path.iterdir()] == [supersede.LOCKFILE]  # no temporary file left


def test_of_two_agents_started_at_once_the_later_ends_the_earlier(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    """Found in review: both waited for the first agent, both outlived it, both recorded
    themselves and ran side by side. Claims now take turns: the later ends the earlier."""
    first = old_agent(procs, STUBBORN)
    second = old_agent(procs, GRACEFUL)
    third = old_agent(procs, GRACEFUL)
    supersede.claim(tmp_path, 5.0, pid=first.pid)
    with ThreadPoolExecutor(2) as pool:
        ending_first = pool.submit(supersede.claim, tmp_path, 1.0, pid=second.pid)
        deadline = time.monotonic() + 10
        while not claiming(tmp_path):  # the second claim is waiting out the stubborn first agent
            assert time.monotonic() < deadline and not ending_first.done(), (
                "the second claim never held the lock"
            )
            time.sleep(0.01)
        ending_second = pool.submit(supersede.claim, tmp_path, 5.0, pid=third.pid)
        assert ending_first.result(timeout=30) == first.pid
        assert ending_second.result(timeout=30) == second.pid
    assert first.wait(timeout=5) == -signal.SIGKILL and second.wait(timeout=5) == 0
    assert third.poll() is None and supersede.recorded(tmp_path) == (
        third.pid,
        supersede.start_time(third.pid),
    )
