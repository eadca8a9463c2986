"""``unicorn-train`` on the checkpoint engine's tiers, under real torchrun (gloo, CPU).

Memory saves reshard on restore (DP4 -> DP2 and TP2·DP1, same losses as the run that
never stopped); a rank SIGKILLed right after its snapshot has it persisted by the agent
and restored from memory; a lost node's ranks restore from the peer's copy, and a
corrupt peer copy falls back to the next tier with its reason.

Agents are :class:`launcher.ckptagent.CkptAgent` on an event loop in a thread of the
test process (no Redis needed: the checkpoint half of the agent has no Redis).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.tier import Tier, TierDir
from launcher.ckptagent import CkptAgent, CkptPlan
from tests.launcher.test_ckptagent import two_node_plans
from tests.launcher.test_trainer_torchrun import COMMON, assert_losses_match
from tests.launcher.torchrun import run

DP = ("--micro-batch=1", "--global-batch=12")


class AgentThread:
    """A ``CkptAgent`` running (``run``: scan every 50 ms) on its own loop in a thread."""

    def __init__(self, plan: CkptPlan) -> None:
        self.agent = CkptAgent(plan, scan_interval_s=0.05)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self.agent.run(), self.loop)
        asyncio.run_coroutine_threadsafe(self.agent.ready.wait(), self.loop).result(30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        time.sleep(0.1)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def agents() -> Iterator[Callable[[CkptPlan], AgentThread]]:
    started: list[AgentThread] = []

    def start(plan: CkptPlan) -> AgentThread:
        started.append(AgentThread(plan))
        return started[-1]

    yield start
    for agent in started:
        agent.stop()


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def snapshot_args(plan: CkptPlan) -> list[str]:
    """The options a rank gets from its agent's environment (``CkptPlan.rank_env``)."""
    env = plan.rank_env()
    flags = {
        "UNICORN_CKPT_SNAP_DIR": "--snapshot-dir",
        "UNICORN_CKPT_BACKUP_DIR": "--snapshot-backup-dir",
        "UNICORN_CKPT_LOCAL_DIR": "--snapshot-local-dir",
        "UNICORN_CKPT_REMOTE_DIR": "--snapshot-remote-dir",
        "UNICORN_CKPT_JOB": "--snapshot-job",
        "UNICORN_CKPT_EVERY": "--snapshot-every",
        "UNICORN_CKPT_PEERS": "--snapshot-peers",
        "UNICORN_CKPT_SLOTS": "--snapshot-slots",
    }
    return [f"{flags[k]}={v}" for k, v in env.items()]


@pytest.fixture(scope="module")
def dp4_in_memory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[int, float]]]:
    """DP4 trains 6 iterations with memory snapshots at 3 and 6 (no agent: restore seals)."""
    root = Path("/dev/shm") / f"unicorn-test-dp4-{tmp_path_factory.mktemp('x').name}"
    launch = run(4, *COMMON, *DP, f"--snapshot-dir={root}", "--snapshot-every=3")
    assert launch.returncode == 0, launch.output[-3000:]
    assert sorted(launch.losses) == [1, 2, 3, 4, 5, 6]
    yield root, launch.losses
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("layout", [("--dp=2",), ("--tp=2",)], ids=["dp2", "tp2"])
def test_memory_save_at_dp4_restores_at_another_layout(
    dp4_in_memory: tuple[Path, dict[int, float]], shm_root: Path, layout: tuple[str, ...]
) -> None:
    saved, reference = dp4_in_memory
    shutil.copytree(saved, shm_root, dirs_exist_ok=True)
    resumed = run(2, *COMMON, *DP, *layout, f"--snapshot-dir={shm_root}", "--ckpt-step=3")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "restored iteration 3 from the memory tiers: shards [0, 1, 2, 3] from shm" in resumed.output
    assert "resumed_from=3" in resumed.output
    assert sorted(resumed.losses) == [4, 5, 6]
    assert_losses_match(resumed.losses, reference)


def test_rank_killed_after_snapshot_agent_persists_and_restart_restores_from_memory(
    shm_root: Path, agents: Callable[[CkptPlan], AgentThread]
) -> None:
    plan, _ = two_node_plans(shm_root)
    plan = CkptPlan(**{**plan.__dict__, "ring": (plan.me,), "remote_root": None})  # one node, no remote
    agents(plan)
    args = (*COMMON[:-2], "--iterations=4", "--pp=2", *snapshot_args(plan))
    crashed = run(
        2, *args, "--fail-at-iteration=3", "--fail-rank=1", "--fail-mode=kill", "--dist-timeout-s=20"
    )
    assert crashed.returncode != 0
    assert "snapshot of iteration 2 in memory" in crashed.output and sorted(crashed.losses) == [1, 2]
    assert plan.local_root is not None
    local = TierDir(plan.local_root, plan.job, Tier.LOCAL)
    wait_for("the agent to persist iteration 2", lambda: local.latest_complete() == 2)
    restarted = run(2, *args)
    assert restarted.returncode == 0, restarted.output[-3000:]
    assert "restored iteration 2 from the memory tiers: shards [0, 1] from shm" in restarted.output
    assert sorted(restarted.losses) == [3, 4]


def test_lost_node_restores_from_the_peer_copy_and_skips_a_corrupt_one(
    shm_root: Path, agents: Callable[[CkptPlan], AgentThread]
) -> None:
    a, b = two_node_plans(shm_root)
    agents(b)
    agents(a)
    args = (*COMMON[:-2], "--iterations=4", "--pp=2", *snapshot_args(a))
    first = run(2, *args, "--exit-at-iteration=2")
    assert first.returncode == 0, first.output[-3000:]
    backup = TierDir(b.backup_root, b.job, Tier.PEER)
    assert a.remote_root is not None
    remote = TierDir(a.remote_root, a.job, Tier.REMOTE)
    wait_for(
        "b's copy and the remote one",
        lambda: backup.done_ranks(2) == {0, 1} and remote.latest_complete() == 2,
    )
    # Node a is replaced: its memory and disk are gone. Node b's copy of shard 1 is corrupt.
    for gone in (a.snap_root, a.backup_root, a.local_root):
        assert gone is not None
        shutil.rmtree(gone, ignore_errors=True)
    assert not a.snap_root.exists()
    bin_path = backup.shard(2, 1).bin
    data = bytearray(bin_path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bin_path.write_bytes(bytes(data))
    resumed = run(2, *args)
    assert resumed.returncode == 0, resumed.output[-3000:]
    restored = next(line for line in resumed.output.splitlines() if "restored iteration 2" in line)
    assert f"shards [0] from peer b (127.0.0.1:{b.me.port})" in restored
    assert "shards [1] from remote" in restored
    assert "checksum" in resumed.output  # the reason the peer's copy was refused is logged
    assert sorted(resumed.losses) == [3, 4]


def test_rank_exception_snapshots_the_last_completed_iteration_on_every_rank(shm_root: Path) -> None:
    """PP2, no periodic snapshot: rank 1 raises at iteration 3 and snapshots iteration 2 on
    its way out; rank 0, blocked in C in the pipeline's receive (its Python SIGTERM handler
    cannot run), snapshots 2 from the wakeup fd when torchrun sends SIGTERM. The restart
    resumes from 2, with the losses of a run that never failed."""
    args = (*COMMON[:-2], "--iterations=5", "--pp=2", "--snapshot-every=100", "--dist-timeout-s=20")
    reference = run(2, *args, f"--snapshot-dir={shm_root}-reference")
    shutil.rmtree(f"{shm_root}-reference", ignore_errors=True)
    assert reference.returncode == 0, reference.output[-3000:]
    crashed = run(
        2, *args, f"--snapshot-dir={shm_root}", "--fail-at-iteration=3", "--fail-rank=1", "--fail-mode=raise"
    )
    assert crashed.returncode != 0 and sorted(crashed.losses) == [1, 2]
    assert "snapshot of iteration" not in crashed.output, "no periodic snapshot: only the JIT ones"
    restarted = run(2, *args, f"--snapshot-dir={shm_root}")
    assert restarted.returncode == 0, restarted.output[-3000:]
    assert "restored iteration 2 from the memory tiers: shards [0, 1] from shm" in restarted.output
    assert sorted(restarted.losses) == [3, 4, 5]
    assert_losses_match(restarted.losses, reference.losses)


@pytest.mark.parametrize(("data_parallel", "lost"), [("ddp", 1), ("ddp", 0), ("fsdp", 1)])
def test_lost_replica_restores_from_the_survivors_just_in_time_copy(
    shm_root: Path, data_parallel: str, lost: int
) -> None:
    """DP2, no periodic snapshot: rank ``lost`` is SIGKILLed as iteration 3 starts, so only
    the survivor's just-in-time snapshot of iteration 2 exists (the lost rank's shard
    nowhere). Under DDP the survivor holds everything the lost rank held: the restart at
    DP1 resumes from 2, the lost shard (rank 0's too) read from its replica, with the
    losses of a run that never failed. Under FSDP the ranks hold different halves:
    iteration 2 is incomplete and nothing is restored."""
    args = (
        *COMMON[:-2], *DP, "--iterations=5", "--dp=2", f"--data-parallel={data_parallel}",
        "--snapshot-every=100", "--dist-timeout-s=20",
    )  # fmt: skip
    crashed = run(
        2,
        *args,
        f"--snapshot-dir={shm_root}",
        "--fail-at-iteration=3",
        f"--fail-rank={lost}",
        "--fail-mode=kill",
    )
    assert crashed.returncode != 0, crashed.output[-3000:]
    kept = 1 - lost
    saved = sorted(p.relative_to(shm_root).parts[1:] for p in shm_root.rglob("shard-*.json"))
    assert saved == [("it-000000000002", f"shard-{kept:05d}.json")], saved  # the survivor's only
    single = tuple(a for a in args if a != "--dp=2")
    restarted = run(1, *single, f"--snapshot-dir={shm_root}")
    assert restarted.returncode == 0, restarted.output[-3000:]
    if data_parallel == "fsdp":
        assert "no complete version" in restarted.output and sorted(restarted.losses) == [1, 2, 3, 4, 5]
        return
    parts = {kept: f"shards [{kept}] from shm", lost: f"shards [{lost}] from replica rank {kept}"}
    sources = "; ".join(parts[rank] for rank in sorted(parts))  # listed by rank
    assert f"restored iteration 2 from the memory tiers: {sources}" in restarted.output, restarted.output[
        -3000:
    ]
    assert sorted(restarted.losses) == [3, 4, 5]
    reference = run(1, *single, f"--snapshot-dir={shm_root}-reference")
    shutil.rmtree(f"{shm_root}-reference", ignore_errors=True)
    assert reference.returncode == 0, reference.output[-3000:]
    assert_losses_match(restarted.losses, reference.losses)
