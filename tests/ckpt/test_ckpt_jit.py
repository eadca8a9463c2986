"""Just-in-time checkpoint: on the agent's order, the last consistent state is snapshot at once."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt.errors import InvalidArgument
from ckpt.jit import JitCheckpointer, jit_responses, request_jit, request_path
from ckpt.shard import OpenShard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Tier, TierDir


class Loop:
    """A fake training loop whose update writes two tensors that must always agree."""

    def __init__(self) -> None:
        self.a = torch.zeros(1000)
        self.b = torch.zeros(1000)

    def state(self) -> dict[str, torch.Tensor]:
        return {"a": self.a, "b": self.b}


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_agent_request_snapshots_the_last_completed_iteration_after_the_update(shm_root: Path) -> None:
    loop = Loop()
    writer = SnapshotWriter(shm_root, "job", 0, 1)
    jit = JitCheckpointer(
        writer, loop.state, request_file=request_path(shm_root, "job"), poll_interval_s=0.01
    )
    jit.start()
    try:
        for iteration in range(1, 4):
            with jit.updating():
                loop.a += 1
                loop.b += 1
            jit.completed(iteration)
        with jit.updating():  # iteration 4 is mid-update when the order arrives
            loop.a += 1
            request_jit(shm_root, "job", "fail-17")
            time.sleep(0.1)
            assert jit.last_jit is None  # the JIT thread waits for the update to finish
            loop.b += 1
        jit.completed(4)
        _wait_for(lambda: jit.last_jit is not None)
    finally:
        jit.stop()
    shm = TierDir(shm_root, "job", Tier.SHM)
    assert jit_responses(shm, "fail-17") == {0: 4}
    assert jit.last_jit is not None
    jit.last_jit.seal()
    with OpenShard(shm.shard(4, 0)) as shard:
        assert torch.equal(shard.value("a"), torch.full((1000,), 4.0))
        assert torch.equal(shard.value("b"), torch.full((1000,), 4.0))


def test_signal_triggers_a_snapshot_and_a_stale_request_does_not(shm_root: Path) -> None:
    request_jit(shm_root, "job", "old-order")  # written before this rank started: not for it
    loop = Loop()
    jit = JitCheckpointer(
        SnapshotWriter(shm_root, "job", 0, 1),
        loop.state,
        request_file=request_path(shm_root, "job"),
        poll_interval_s=0.01,
    )
    jit.completed(9)
    previous = signal.getsignal(signal.SIGUSR1)
    jit.install_signal(signal.SIGUSR1)
    jit.start()
    try:
        time.sleep(0.05)
        assert jit.last_jit is None
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: jit.last_jit is not None)
    finally:
        jit.stop()
        signal.signal(signal.SIGUSR1, previous)
    assert jit.last_jit is not None and jit.last_jit.iteration == 9
    assert jit.last_jit.meta.extra == {"jit_request": f"signal-{int(signal.SIGUSR1)}"}


def test_a_failed_update_blocks_jit_until_the_next_completed_and_saved_iterations_are_skipped(
    shm_root: Path,
) -> None:
    loop = Loop()
    jit = JitCheckpointer(SnapshotWriter(shm_root, "job", 0, 1), loop.state, lock_timeout_s=1.0)
    assert not jit.take_now("before-any"), "nothing completed yet"
    jit.completed(1)
    jit.saved(1)  # e.g. the restored version
    assert not jit.take_now("restored")
    try:
        with jit.updating():
            loop.a += 1  # half an update, then the step raises
            raise RuntimeError("optimizer step failed")
    except RuntimeError:
        pass
    assert not jit.take_now("half-updated") and jit.last_jit is None
    with jit.updating():
        loop.b += 1
    jit.completed(2)
    assert jit.take_now("exception") and jit.last_jit is not None and jit.last_jit.iteration == 2
    assert not jit.take_now("again"), "iteration 2 is saved already"


def test_a_failed_save_of_the_loop_leaves_the_state_consistent_for_jit(shm_root: Path) -> None:
    """The loop's own save only reads the state: one that fails (its collective's peer died)
    does not block the JIT snapshot of the iteration it was saving, unlike a failed update."""
    loop = Loop()
    jit = JitCheckpointer(SnapshotWriter(shm_root, "job", 0, 1), loop.state, lock_timeout_s=1.0)
    with jit.updating():
        loop.a += 1
        loop.b += 1
    jit.completed(1)
    with pytest.raises(RuntimeError), jit.saving():
        raise RuntimeError("Connection reset by peer")  # DCP's planning collective
    assert jit.take_now("exception") and jit.last_jit is not None and jit.last_jit.iteration == 1


def test_watched_signal_snapshots_from_the_wakeup_fd(shm_root: Path) -> None:
    """The trigger comes from the interpreter's wakeup fd, not from the Python handler, which
    stays the loop's own (and would not run while the main thread waits in C)."""
    loop = Loop()
    jit = JitCheckpointer(SnapshotWriter(shm_root, "job", 0, 1), loop.state, poll_interval_s=0.01)
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        with pytest.raises(InvalidArgument, match="no Python handler"):
            jit.watch_signals(signal.SIGUSR2)
        seen: list[int] = []
        signal.signal(signal.SIGUSR2, lambda signum, _frame: seen.append(signum))
        jit.watch_signals(signal.SIGUSR2)
        with pytest.raises(InvalidArgument, match="wakeup fd"):
            JitCheckpointer(SnapshotWriter(shm_root, "job2", 0, 1), loop.state).watch_signals(signal.SIGUSR2)
        jit.completed(5)
        jit.start()
        os.kill(os.getpid(), signal.SIGUSR2)
        _wait_for(lambda: jit.last_jit is not None)
        assert seen == [signal.SIGUSR2], "the loop's own handler still runs"
    finally:
        jit.stop()
        signal.signal(signal.SIGUSR2, previous)
    assert signal.set_wakeup_fd(-1) == -1, "stop() released the wakeup fd"
    assert jit.last_jit is not None and jit.last_jit.iteration == 5
    assert jit.last_jit.meta.extra == {"jit_request": f"signal-{int(signal.SIGUSR2)}"}
