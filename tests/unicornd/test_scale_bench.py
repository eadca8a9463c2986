"""The scale bench's pure parts: the growth fit, the fault schedule, the scripted Slurm's
answers, the emulated agents' bookkeeping and the matching of faults to incidents
(``scripts/bench/scale.py``; the bench itself needs minutes and a real Redis)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest

from unicorn_core.errors import UnknownJob, UnknownNode
from unicorn_core.keys import RedisKeys
from unicorn_core.protocol import GpuHealthEvent, Heartbeat, IterationTiming, ProcessExit
from unicorn_core.slurm.backend import ResizeUnsupported
from unicorn_core.slurm.types import JobState, NodeState

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    path = REPO / "scripts" / "bench" / "scale.py"
    spec = importlib.util.spec_from_file_location("bench_scale", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)  # puts scripts/bench on sys.path for its siblings
    finally:
        sys.path[:] = saved
    return module


BENCH = _bench()
AGENTS = sys.modules["scale_agents"]
SLURM = sys.modules["scale_slurm"]


# --- statistics ---------------------------------------------------------------------------


def test_growth_exponent_recovers_the_power_of_a_power_law() -> None:
    xs = [64, 256, 1024, 4096]
    assert BENCH.growth_exponent(xs, [3 * x**1.5 for x in xs]) == pytest.approx(1.5)
    assert BENCH.growth_exponent(xs, [7.0] * 4) == pytest.approx(0.0)
    # missing or non-positive points are left out; fewer than two left: no fit
    assert BENCH.growth_exponent(xs, [None, 2 * 256, 0.0, 2 * 4096]) == pytest.approx(1.0)
    assert BENCH.growth_exponent(xs, [None, None, None, 5.0]) is None


def test_percentile_interpolates_and_is_none_for_nothing() -> None:
    assert BENCH.percentile([], 0.95) is None
    assert BENCH.percentile([5.0], 0.99) == 5.0
    assert BENCH.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert BENCH.percentile([0.0, 10.0], 0.95) == pytest.approx(9.5)


def test_the_single_node_lookup_rate_leaves_out_only_misses_beyond_one_step() -> None:
    """Issue 20 asks the lookup's hit rate of single-node failures: a miss whose state was
    two faults from the table's is left out; one not built yet, or with no table, counts."""
    dump = {
        "solves": {
            "hits": 8,
            "misses": 3,
            "missed": [
                [100.0, "beyond one step: 2 node(s) fewer"],
                [200.0, "one step, but the table was not built whole yet"],
                [300.0, "no table: the lookup has built none"],
            ],
        }
    }
    out = BENCH._lookup(dump, 50.0)
    assert out["lookup_hit_rate"] == pytest.approx(8 / 11, abs=1e-3)
    assert out["lookup_hit_rate_one_step"] == pytest.approx(8 / 10, abs=1e-3)
    assert (out["lookup_misses_one_step"], out["lookup_misses_beyond_one_step"]) == (2, 1)
    assert [m["t_s"] for m in out["lookup_misses"]] == [50.0, 150.0, 250.0]


def test_jobs_per_cluster_size() -> None:
    assert [BENCH.jobs_for(n, 200) for n in (64, 256, 1024, 4096)] == [4, 16, 64, 200]
    assert BENCH.jobs_for(8, 200) == 1


# --- the fault schedule --------------------------------------------------------------------

NODES = [f"n{i:04d}" for i in range(1, 65)]


def test_fault_schedule_is_deterministic_ordered_and_within_the_window() -> None:
    a = AGENTS.fault_schedule(7, NODES, 600.0, rate_per_min=6.0, bursts=2)
    assert a == AGENTS.fault_schedule(7, NODES, 600.0, rate_per_min=6.0, bursts=2)
    assert a != AGENTS.fault_schedule(8, NODES, 600.0, rate_per_min=6.0, bursts=2)
    times = [f.at_s for f in a]
    assert times == sorted(times) and all(0 <= t < 600 for t in times)
    # ~6 a minute for 10 minutes (Poisson): far from 0 and from 120
    singles = [f for f in a if f.kind != "rack"]
    assert 30 < len(singles) < 100
    assert {f.kind for f in singles} <= {"rank_crash", "gpu_ecc", "node_loss"}


def test_racks_are_consecutive_nodes_and_dead_nodes_never_fault_again() -> None:
    faults = AGENTS.fault_schedule(3, NODES, 300.0, rate_per_min=20.0, bursts=2, rack_size=16)
    racks = [f for f in faults if f.kind == "rack"]
    assert len(racks) == 2
    for r in racks:
        assert len(r.nodes) == 16 and r.nodes in AGENTS.racks(NODES, 16)
    dead: set[str] = set()
    for f in faults:
        assert not dead & set(f.nodes), f"{f} hits a node that died before"
        if f.kind in ("rack", "node_loss"):
            dead.update(f.nodes)
    died = AGENTS.deaths(faults)
    assert set(died) == dead
    silent = [f for f in faults if f.kind in ("rack", "node_loss")]
    assert all(died[n] == next(f.at_s for f in silent if n in f.nodes) for n in died)


def test_no_rate_and_no_bursts_inject_nothing() -> None:
    assert AGENTS.fault_schedule(0, NODES, 60.0, rate_per_min=0.0, bursts=0) == []
    with pytest.raises(ValueError, match="rate_per_min"):
        AGENTS.fault_schedule(0, NODES, 60.0, rate_per_min=-1.0, bursts=0)


# --- the scripted Slurm --------------------------------------------------------------------


class Clock:
    """Fake wall time; the backend's awaited latencies advance it instead of sleeping."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.t += s


def slurm(clock: Clock, events: list[Any] | None = None, **kw: Any) -> Any:
    async def sink(ev: Any) -> None:
        if events is not None:
            events.append(ev)

    return SLURM.ScriptedSlurm(
        ["n1", "n2", "n3", "n4"],
        {7: ("n1", "n2")},
        clock=clock,
        sleep=clock.sleep,
        on_event=sink,
        **kw,
    )


async def test_nodes_and_jobs_go_through_the_real_sinfo_and_squeue_parsers() -> None:
    clock = Clock()
    s = slurm(clock)
    nodes = {n.name: n for n in await s.list_nodes()}
    assert nodes["n1"].state is NodeState.ALLOCATED and nodes["n3"].state is NodeState.IDLE
    assert all(n.gpus == 8 and n.usable and n.partitions == ("gpu",) for n in nodes.values())
    (job,) = await s.list_jobs()
    assert (job.job_id, job.state, job.nodes, job.num_nodes) == (7, JobState.RUNNING, ("n1", "n2"), 2)
    assert clock.t > 1000.0  # a query costs slurmctld's latency
    with pytest.raises(UnknownNode):
        await s.drain("n9", "why")
    with pytest.raises(UnknownJob):
        await s.get_job(8)


async def test_drain_and_down_change_what_sinfo_shows() -> None:
    clock, events = Clock(), list[Any]()
    s = slurm(clock, events)
    await s.drain("n3", "unicorn: ecc_error t000.1")
    n3 = await s.get_node("n3")
    assert n3.drained and not n3.usable and n3.reason == "unicorn: ecc_error t000.1"
    await s.down("n2", "dead")
    assert (await s.get_node("n2")).state is NodeState.DOWN
    assert (await s.get_job(7)).nodes == ("n1",)  # --no-kill: the job loses the node
    await s.resume("n3")
    assert (await s.get_node("n3")).usable
    assert [e.op for e in events] == ["drain", "down", "resume"]


async def test_a_dead_node_is_marked_not_responding_after_the_slurmd_timeout() -> None:
    clock = Clock()
    s = slurm(clock, deaths={"n2": 1010.0})
    assert not s.not_responding("n2")
    clock.t = 1010.0 + s.timings.not_responding_s - 0.1
    assert (await s.get_node("n2")).responding
    clock.t = 1010.0 + s.timings.not_responding_s + 0.1
    n2 = await s.get_node("n2")
    assert not n2.responding and n2.state is NodeState.DOWN
    # the node check cannot run there: srun fails, with no verdict of the check
    out = await s.run_on_nodes(["n2"], ["unicorn-node-check"], timeout_s=120.0, job_id=7)
    assert out.exit_code != 0 and "unhealthy:" not in out.stderr
    ok = await s.run_on_nodes(["n3"], ["unicorn-node-check"], timeout_s=120.0)
    assert ok.exit_code == 0


async def test_requeue_runs_the_job_again_on_its_new_nodes_after_the_measured_delay() -> None:
    clock, events = Clock(), list[Any]()
    s = slurm(clock, events)
    start = clock.t
    await s.requeue(7, ["n3", "n4"])
    assert [e.op for e in events] == ["requeue"] and events[0].nodes == ("n3", "n4")
    clock.t = start + s.timings.requeue_running_s - 0.2
    assert (await s.get_job(7)).state is JobState.PENDING
    clock.t = start + s.timings.requeue_running_s + 0.1
    job = await s.get_job(7)
    assert (job.state, job.nodes, job.restarts) == (JobState.RUNNING, ("n3", "n4"), 1)


async def test_shrink_and_grow_use_free_usable_nodes_only() -> None:
    clock, events = Clock(), list[Any]()
    s = slurm(clock, events)
    await s.shrink(7, ["n1"])
    assert (await s.get_job(7)).nodes == ("n1",)
    await s.drain("n2", "bad")
    grown = await s.grow(7, 1, exclude=["n3"])
    assert grown.nodes_added == ("n4",)
    with pytest.raises(ResizeUnsupported):
        await s.grow(7, 1, exclude=["n3"])
    assert [e.op for e in events] == ["shrink", "drain", "grow"]


async def test_a_step_starts_a_real_process_and_names_its_launch() -> None:
    clock, events = Clock(), list[Any]()
    s = slurm(clock, events)
    argv = ["unicorn-agent", "--node", "n2", "--launch-id", "plan-3/t0/launch", "--", "torchrun"]
    step = await s.launch_step(7, ["n2"], argv, capture=False)
    assert await step.wait() == 0
    assert (events[-1].op, events[-1].nodes, events[-1].launch_id) == ("launch", ("n2",), "plan-3/t0/launch")
    assert SLURM.step_launch_id(["a", "--", "--launch-id", "x"]) == ""


# --- the emulated agents -------------------------------------------------------------------


def fleet(client: Any = None, jobs: list[Any] | None = None, **kw: Any) -> Any:
    """A fleet under prefix ``t`` (default: job 7 on n1, n2; no Redis client)."""
    return AGENTS.Fleet(
        client,
        RedisKeys("t"),
        jobs or [AGENTS.Job(7, "t000", ("n1", "n2"), 8, 100, 1.0, 512)],
        heartbeat_interval_s=1.0,
        heartbeat_ttl_s=5.0,
        heartbeat_timeout_s=1.5,
        events_stream="t:bench:slurm",
        **kw,
    )


def test_agents_beat_once_a_second_and_the_last_node_reports_iterations() -> None:
    f = fleet()
    now = f._heap[0][0]
    msgs = []
    for i in range(60):  # 3 s of 50 ms ticks
        msgs += f._tick_messages(now + 2.0 + i * 0.05, 1.0)
    beats = [m for _, m in msgs if isinstance(m, Heartbeat)]
    iterations = [m for _, m in msgs if isinstance(m, IterationTiming)]
    assert 5 <= len(beats) <= 7 and {b.node for b in beats} == {"n1", "n2"}
    assert len(iterations) >= 2 and {m.node for m in iterations} == {"n2"}
    assert all(m.rank == 15 for m in iterations)


def test_a_rank_crash_is_reported_and_stalls_the_job_a_node_loss_silences_its_agent() -> None:
    f = fleet()
    (crash,) = f.inject(AGENTS.Fault(0.0, "rank_crash", ("n1",)), 0)
    assert crash.job_id == 7
    ((_, msg),) = f._out
    assert isinstance(msg, ProcessExit) and msg.signal == 9 and msg.node == "n1"
    assert f._job_ready(f.jobs[7]) == math.inf
    (ecc,) = f.inject(AGENTS.Fault(0.0, "gpu_ecc", ("n2",)), 1)
    assert isinstance(f._out[-1][1], GpuHealthEvent) and ecc in [rec for rec, _ in f._fault_marks]
    f.agents[(7, "n2")].last_beat_wall = 500.0
    (loss,) = f.inject(AGENTS.Fault(0.0, "node_loss", ("n2",)), 2)
    assert loss.evidence_wall == pytest.approx(501.5)  # last beat + heartbeat timeout
    assert (7, "n2") not in f.agents and "n2" in f.dead_nodes
    (idle,) = f.inject(AGENTS.Fault(0.0, "rank_crash", ("n9",)), 3)
    assert idle.job_id is None


def test_agents_follow_slurm_steps_requeues_and_shrinks() -> None:
    f = fleet()
    ev = SLURM.SlurmEvent
    f.on_slurm(ev(1.0, "requeue", 7, ("n3", "n4")))
    assert f.live_agents() == 0 and f.jobs[7].nodes == ("n3", "n4")
    f.on_slurm(ev(2.0, "launch", 7, ("n3", "n4"), "plan-2/t000/launch"))
    assert f.live_agents() == 2 and f.agents[(7, "n4")].launch_id == "plan-2/t000/launch"
    f.on_slurm(ev(3.0, "shrink", 7, ("n3",)))
    assert f.live_agents() == 1 and f.jobs[7].nodes == ("n3",)


# --- faults to incidents ---------------------------------------------------------------------


def commit(t: float, inc: str, node: str, findings: list[str], actions: list[list[Any]], *, new: bool) -> Any:
    return {
        "t": t,
        "incidents": [
            {
                "id": inc,
                "task": inc.split(".", maxsplit=1)[0],
                "node": node,
                "rule": "r",
                "new": new,
                "findings": findings,
            }
        ],
        "actions": actions,
    }


def test_each_fault_is_matched_to_the_commit_that_took_in_its_finding_and_its_first_effect() -> None:
    ecc = AGENTS.InjectedFault(0, "gpu_ecc", ("n2",), 100.0, 7, evidence_wall=100.02, entry_id="100020-0")
    lost = AGENTS.InjectedFault(1, "node_loss", ("n3",), 100.5, 7, evidence_wall=101.5)
    idle = AGENTS.InjectedFault(2, "node_loss", ("n9",), 101.0, None)
    drain: list[list[Any]] = [
        ["t000.2/isolate/1/drain/n2", "drain_node", "n2", None],
        ["plan-2/t000/requeue", "requeue", None, 7],
    ]
    restart: list[list[Any]] = [["t000.2/restart_processes/1/restart_ranks/n1", "send_command", "n1", 7]]
    commits = [
        commit(99.0, "t000.1", "n2", ["99000-0:exit"], [], new=True),  # before the faults
        commit(100.1, "t000.2", "n2", ["100020-0:gpu"], drain, new=True),
        commit(101.6, "t000.2", "n2", ["heartbeat:7:n3:101.6"], restart, new=False),  # absorbed
        commit(105.0, "t001.1", "n5", ["heartbeat:8:n5:105.0"], [], new=True),  # no fault of ours
    ]
    commands = [{"t": 101.7, "id": "t000.2/restart_processes/1/restart_ranks/n1"}]
    calls = [
        {"t": 99.5, "op": "drain", "job": None, "nodes": ["n2"], "launch": ""},  # before the decision
        {"t": 100.2, "op": "requeue", "job": 7, "nodes": ["n4"], "launch": ""},
        {"t": 100.15, "op": "drain", "job": None, "nodes": ["n2"], "launch": ""},
    ]
    matches, unexplained = BENCH.match_faults([ecc, lost, idle], commits, commands, calls)
    by_id = {m.fault.fault_id: m for m in matches}
    assert (by_id[0].incident, by_id[0].decided_wall, by_id[0].acted_wall) == ("t000.2", 100.1, 100.15)
    assert (by_id[1].incident, by_id[1].decided_wall, by_id[1].acted_wall) == ("t000.2", 101.6, 101.7)
    assert by_id[2].incident is None
    assert sorted(i["id"] for i in unexplained) == ["t000.1", "t001.1"]
    assert (
        BENCH.first_effect(
            [["x", "launch_agents", None, 7]],
            0.0,
            [],
            [{"t": 3.0, "op": "launch", "job": 7, "nodes": ["n1"], "launch": "x"}],
        )
        == 3.0
    )


async def test_agents_write_and_read_what_real_agents_do_on_a_real_redis(redis_url: str) -> None:
    """Against a real Redis: heartbeats as the outbox writes them (a TTL key and an events
    entry), a fault's evidence time from its entry id, and a command read, answered on
    cmd-results and deleted, as the agent does."""
    import asyncio

    import redis.asyncio as aioredis

    from unicorn_core import protocol
    from unicorn_core.protocol import AgentAction, AgentCommand, CommandResult

    client = aioredis.Redis.from_url(redis_url)
    f = fleet()
    f.client = client
    try:
        now = max(t for t, _, _ in f._heap) + 0.01
        (crash,) = f.inject(AGENTS.Fault(0.0, "rank_crash", ("n1",)), 0)
        marks, queued = f._fault_marks, f._out
        f._fault_marks, f._out = [], []
        await f._write(f._tick_messages(now, 1.0) + queued, [], marks)
        keys = f.keys
        ttl = await client.pttl(keys.heartbeat(7, "n1"))
        assert 0 < ttl <= 5000
        beat = cast(bytes, await client.get(keys.heartbeat(7, "n2")))
        assert isinstance(protocol.decode(beat), Heartbeat)
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await client.xrange(keys.events(7)))
        decoded = [protocol.decode(fields[b"msg"]) for _, fields in entries]
        assert sum(isinstance(m, Heartbeat) for m in decoded) == 2
        exit_id = next(i for (i, _), m in zip(entries, decoded, strict=True) if isinstance(m, ProcessExit))
        assert crash.entry_id == exit_id.decode()  # unicornd's finding id starts with it
        assert crash.evidence_wall == int(exit_id.split(b"-")[0]) / 1000

        cmd = AgentCommand(
            job_id=7, node="n2", wall_time_s=1.0, command_id="t000.1/x", action=AgentAction.STOP, deadline_s=5
        )
        await client.xadd(keys.agent_commands(7, "n2"), {"msg": protocol.encode(cmd)})
        reader = asyncio.create_task(f.commands_loop())
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if f._out:
                    break
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        ((stream, answer),) = f._out
        assert stream == keys.command_results(7) and isinstance(answer, CommandResult)
        assert answer.command_id == "t000.1/x" and answer.ok
        assert await client.xlen(keys.agent_commands(7, "n2")) == 0
        assert f.commands[0]["action"] == "stop" and (7, "n2") not in f.agents
    finally:
        await client.aclose()


async def test_a_job_takes_the_step_time_of_the_layout_unicornd_committed(redis_url: str) -> None:
    """A launch after a replan: the job reads its task record as committed and iterates at
    the performance model's step time of its new layout (a job keeping its first layout's
    step time made unicornd's calibration reshuffle the cluster on false evidence)."""
    import time

    import redis.asyncio as aioredis

    from plan.perf import estimate_layout
    from tests.unicornd.redis_world import until
    from unicorn_core.config import load_config
    from unicornd.replan import PlanContext, replan_decision
    from unicornd.store import Store

    cfg = load_config(None, env={})
    ctx = PlanContext.from_config(cfg)
    now = time.time()
    cluster = BENCH.build_cluster(64, 4, cfg, ctx, now)
    failed = BENCH.failure_snapshot(cluster.snapshot)
    _plan, decision = replan_decision(failed, ctx, now)
    after = decision.applied_to(failed)
    moved = [
        t
        for t in after.tasks.values()
        if t.layout is not None and t.layout != cluster.snapshot.tasks[t.task_id].layout
    ]
    assert moved, "the drain changed no task's layout: nothing to follow"
    task = moved[0]
    job_id = cast(int, task.job_id)
    old_s = cluster.iter_s[job_id]
    new_s = estimate_layout(task.model, cast(Any, task.layout), ctx.gpu, 8, ctx.assume).iteration_s
    assert new_s != old_s

    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys("t")
    try:
        await Store(client, keys, cfg.recovery).commit(after)
        jobs = [AGENTS.Job(job_id, task.task_id, task.nodes, 8, 100, old_s, 512)]
        f = fleet(client, jobs, step_time=BENCH.step_time_of(ctx, 8))
        f.on_slurm(SLURM.SlurmEvent(1.0, "launch", job_id, task.nodes, "plan-2/x/launch"))
        await until(lambda: not f._layout_reads, 20)  # the layout read ended
        assert f.jobs[job_id].iter_s == new_s and f.step_time_changes == 1
    finally:
        await client.aclose()
