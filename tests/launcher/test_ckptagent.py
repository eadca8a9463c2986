"""The agent's half of the checkpoint engine (launcher/ckptagent.py), without torchrun.

Two agents ("a" and "b", a ring on 127.0.0.1) in the test's event loop; a rank is a
``SnapshotWriter`` in the test process that leaves its shards ``copied``, as the trainer does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.shard import OpenShard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Tier, TierDir
from launcher.ckptagent import (
    ENV_PEERS,
    ENV_RING,
    ENV_SNAP_DIR,
    TRANSITIONS,
    CkptAgent,
    CkptPlan,
    PeerEndpoint,
    ShardStage,
    ShardWork,
    peer_port,
)
from tests.ckpt.conftest import assert_same, training_state
from tests.conftest import free_port
from unicorn_core.config import CkptConfig
from unicorn_core.errors import InvalidArgument


def two_node_plans(root: Path) -> tuple[CkptPlan, CkptPlan]:
    ring = (PeerEndpoint("a", "127.0.0.1", free_port()), PeerEndpoint("b", "127.0.0.1", free_port()))

    def plan(node: str) -> CkptPlan:
        return CkptPlan(
            job="7",
            node=node,
            snap_root=root / node / "snap",
            backup_root=root / node / "peer",
            local_root=root / node / "disk",
            remote_root=root / "nfs",
            ring=ring,
            factor=1,
            rate_bytes_s=float(1 << 30),
            keep_versions=2,
            every=2,
            bind_host="127.0.0.1",
        )

    return plan("a"), plan("b")


def test_plan_from_config_follows_the_slurm_node_list() -> None:
    cfg = CkptConfig(shm_dir="/dev/shm/x", remote_dir="/nfs/ck", peer_factor=2, peer_host="10.0.0.1")
    plan = CkptPlan.from_config(cfg, job_id=42, node="n2", env={"SLURM_JOB_NODELIST": "n[1-4]"})
    assert plan is not None
    assert [p.node for p in plan.ring] == ["n1", "n2", "n3", "n4"]
    assert plan.me.port == peer_port(cfg.peer_port_base, 42, 1)
    assert len({p.port for p in plan.ring}) == 4  # one job's agents on one host never collide
    assert [p.node for p in plan.successors] == ["n3", "n4"]
    assert [p.node for p in plan.others] == ["n3", "n4", "n1"]
    env = plan.rank_env()
    assert env[ENV_SNAP_DIR] == "/dev/shm/x/snap"
    assert env[ENV_PEERS].split(",")[0] == f"n3=10.0.0.1:{peer_port(cfg.peer_port_base, 42, 2)}"
    alone = CkptPlan.from_config(cfg, job_id=42, node="other", env={"SLURM_JOB_NODELIST": "n[1-4]"})
    assert alone is not None and alone.ring == (alone.me,) and alone.successors == ()
    assert CkptPlan.from_config(CkptConfig(shm_dir=""), job_id=1, node="n1", env={}) is None
    with pytest.raises(InvalidArgument, match="must name node"):
        dataclasses.replace(plan, node="zz")


def test_the_ring_is_the_tasks_nodes_then_the_jobs() -> None:
    """unicornd names the task's nodes; without it the job's list. A step srun starts from
    outside the allocation (as unicornd starts agents) has only its own node in
    SLURM_JOB_NODELIST, and the job's in SLURM_NODELIST (measured on Slurm 22.05)."""
    cfg = CkptConfig(shm_dir="/x/{node}/shm", local_dir="/disk/{node}")
    step = {"SLURM_JOB_NODELIST": "n3", "SLURM_NODELIST": "n[1-4]"}

    def ring(env: dict[str, str]) -> list[str]:
        plan = CkptPlan.from_config(cfg, job_id=7, node="n3", env=env)
        assert plan is not None
        return [p.node for p in plan.ring]

    assert ring(step) == ["n1", "n2", "n3", "n4"]
    assert ring({**step, ENV_RING: "n4,n3,n1"}) == ["n4", "n3", "n1"]
    assert ring({"SLURM_JOB_NODELIST": "n[2-3]"}) == ["n2", "n3"]
    plan = CkptPlan.from_config(cfg, job_id=7, node="n3", env=step)
    assert plan is not None and str(plan.snap_root) == "/x/n3/shm/snap" and str(plan.local_root) == "/disk/n3"


def test_shard_stage_transitions_walk_every_pair() -> None:
    for old in ShardStage:
        for new in ShardStage:
            work = ShardWork(1, 0)
            work.stage = old
            if new in TRANSITIONS[old]:
                work.move(new)
                assert work.stage is new
            else:
                with pytest.raises(InvalidArgument, match="not allowed"):
                    work.move(new)


async def test_agent_seals_persists_and_replicates_what_ranks_left_copied(shm_root: Path) -> None:
    plan_a, plan_b = two_node_plans(shm_root)
    a, b = CkptAgent(plan_a), CkptAgent(plan_b)
    await b.start()
    await a.start()
    try:
        states = {rank: training_state(rank) for rank in (0, 1)}
        for rank, state in states.items():
            writer = SnapshotWriter(plan_a.snap_root, "7", rank, 2)
            writer.snapshot(state, 4)  # left "copied", like a rank that died right after
            writer.close()
        done = await a.scan_once()
        assert sorted((w.rank, w.stage) for w in done) == [
            (0, ShardStage.REPLICATED),
            (1, ShardStage.REPLICATED),
        ]
        assert done[0].history == [
            ShardStage.FOUND,
            ShardStage.SEALED,
            ShardStage.PERSISTED,
            ShardStage.REPLICATED,
        ]
        for root, tier in ((plan_a.local_root, Tier.LOCAL), (plan_a.remote_root, Tier.REMOTE)):
            assert root is not None
            assert TierDir(root, "7", tier).latest_complete() == 4  # both ranks: published
        backup = TierDir(plan_b.backup_root, "7", Tier.PEER)
        assert backup.done_ranks(4) == {0, 1}
        for rank, state in states.items():
            with OpenShard(backup.shard(4, rank)) as copy:
                assert_same(copy.state_dict(), state)
        assert await a.scan_once() == []  # sealing rewrote the metadata: not a new shard
        assert a.counters.replicated == 2 and a.counters.failed == 0
        # An agent restarted mid-job does not write what the tiers already hold.
        again = CkptAgent(plan_a)
        await again.start()
        redo = await again.scan_once()
        await again.close()
        assert [w.stage for w in redo] == [ShardStage.REPLICATED] * 2
    finally:
        await a.close()
        await b.close()


async def test_unreachable_peer_fails_replication_but_persists(shm_root: Path) -> None:
    plan_a, _ = two_node_plans(shm_root)  # b never starts
    a = CkptAgent(plan_a)
    await a.start()
    try:
        writer = SnapshotWriter(plan_a.snap_root, "7", 0, 1)
        writer.snapshot(training_state(0), 2)
        writer.close()
        (work,) = await a.scan_once()
        assert work.stage is ShardStage.FAILED and "unreachable" in work.detail
        assert ShardStage.PERSISTED in work.history
        assert plan_a.local_root is not None
        assert TierDir(plan_a.local_root, "7", Tier.LOCAL).latest_complete() == 2
    finally:
        await a.close()


def test_node_agent_gives_its_ranks_the_tiers(tmp_path: Path) -> None:
    """``unicorn-agent`` builds the plan from ``[ckpt]`` and Slurm's node list (no Redis needed)."""
    from launcher.agent import Agent
    from unicorn_core.config import Config

    cfg = Config(ckpt=CkptConfig(shm_dir=str(tmp_path / "shm"), peer_host="127.0.0.1"))
    agent = Agent(cfg, job_id=9, node="n2", run_dir=tmp_path, argv=[], env={"SLURM_JOB_NODELIST": "n[1-2]"})
    assert agent.ckpt is not None
    env = agent.ckpt.rank_env()
    assert env[ENV_SNAP_DIR] == str(tmp_path / "shm" / "snap")
    assert env[ENV_PEERS] == f"n1=127.0.0.1:{peer_port(cfg.ckpt.peer_port_base, 9, 0)}"
    off = Agent(Config(ckpt=CkptConfig(shm_dir="")), job_id=9, node="n2", run_dir=tmp_path, argv=[], env={})
    assert off.ckpt is None


def test_checkpoint_child_does_not_outlive_a_killed_node_agent(tmp_path: Path) -> None:
    """kill -9 of the node agent orphans its checkpoint child; the child must exit by itself."""
    ckpt = CkptConfig(shm_dir=str(tmp_path), local_dir="", peer_host="127.0.0.1")
    cfg = json.dumps(dataclasses.asdict(ckpt))
    child = [
        sys.executable,
        "-m",
        "launcher.ckptagent",
        "--ckpt-config",
        cfg,
        "--job-id",
        "1",
        "--node",
        "n1",
    ]
    code = (
        "import os, subprocess, time\n"
        f"p = subprocess.Popen({child!r} + ['--parent-pid', str(os.getpid())])\n"
        "print(p.pid, flush=True)\ntime.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    alive = True
    while alive and time.monotonic() < deadline:
        try:
            alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            alive = False
        time.sleep(0.1)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the checkpoint child outlived its node agent"


def test_an_orphan_whose_work_ignores_its_cancellation_still_exits() -> None:
    """A lost cancellation (redis-py's, session 30's stuck node agent) must not keep an
    orphaned checkpoint process alive: re-cancelled within a bound, then the process ends
    (asyncio.run would cancel once more and wait for the task without bound)."""
    code = (
        "import asyncio\n"
        "import launcher.ckptagent as c\n"
        "c._END_S = 1.0\n"
        "class Stubborn:\n"
        "    async def run(self):\n"
        "        while True:\n"
        "            try:\n"
        "                await asyncio.sleep(10)\n"
        "            except asyncio.CancelledError:\n"
        "                pass\n"
        "import os\n"
        "parent, calls = os.getppid(), []\n"
        "os.getppid = lambda: parent if len(calls.append(0) or calls) < 2 else 1  # orphaned once running\n"
        "asyncio.run(c._run_while_parent_lives(Stubborn(), parent))\n"
        "print('returned')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ckpt_agent_did_not_end" in done.stdout + done.stderr and "returned" not in done.stdout


def test_the_checkpoint_process_imports_no_torch() -> None:
    """The agent's checkpoint process seals, persists and copies bytes: its engine imports
    no torch (~1 s of CPU at every agent start, taken from the training ranks: the
    agent-overhead loop of ``detection.py`` ran 25 % slower on 2 cores, session 26)."""
    code = "import sys\nimport launcher.ckptagent as c\nc._import_engine()\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False"]
