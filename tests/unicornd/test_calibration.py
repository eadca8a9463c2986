"""The planner calibrated from what unicornd measured (issue 21, item 2).

Pure decisions on coord_world snapshots (iteration times, transitions, node failures, and the
plans that change with them); the snapshot's calibration through the store and through the
ingest path on a real Redis; ``unicornctl plan --explain`` against a snapshot in Redis.
"""

from __future__ import annotations

import json
from dataclasses import replace

import redis
import redis.asyncio as aioredis
from click.testing import CliRunner

from detect.classify import load_classifier
from detect.statuses import ErrorStatus
from plan.calibration import Running, model_key
from plan.hardware import gpu_spec
from plan.objective import FailureModel, TransitionModel
from plan.perf import estimate_layout
from tests.unicornd.coord_world import MODEL, apply, finding, of_kind, render, task, world
from unicorn_core.config import AgentConfig, Config, DetectConfig, PlanConfig
from unicorn_core.keys import RedisKeys
from unicorn_core.protocol import IterationPhase, IterationTiming
from unicornd.actions import Decision, Shrink
from unicornd.calibrate import IterationSample, PlannerInputs, planner_inputs
from unicornd.cli import cli
from unicornd.cli.explain import explanation, explanation_json, render_explanation
from unicornd.core import Core
from unicornd.decide import on_finding, on_progress, resolve
from unicornd.detector import Detector
from unicornd.inputs import AgentInputs
from unicornd.replan import PlanContext, plan_for, planned_tasks, replan_decision
from unicornd.state import Calibration, Policy, Snapshot, TaskState
from unicornd.store import Store, snapshot_from_json, snapshot_to_json

T0 = 1_700_000_000.0
GPU = gpu_spec("a100-80g")
CTX = PlanContext(GPU, FailureModel(24.0), lambda _gpn, _gen: render)
OTHER = replace(MODEL, layers=8)
"""b's model: calibration is per model, so a's measurements must not speak for b."""


def two_tasks() -> Snapshot:
    """n1..n4: task a (MODEL) on n1, n2 and task b (OTHER) on n3, n4, both running."""
    return world(4, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4"], model=OTHER)])


def predicted_s(snap: Snapshot, task_id: str) -> float:
    t = snap.tasks[task_id]
    assert t.layout is not None
    return estimate_layout(t.model, t.layout, GPU, snap.gpus_per_node).iteration_s


def report(
    snap: Snapshot, task_id: str, iterations: range, duration_s: float, span: int = 1, launch_id: str = ""
) -> Snapshot:
    for i in iterations:
        sample = IterationSample(duration_s, span, GPU.name)
        decision = on_progress(
            snap, task_id, i, T0 + i, reported_s=T0 + i, launch_id=launch_id, sample=sample
        )
        snap = apply(snap, decision)
    return snap


def inputs(snap: Snapshot, now_s: float) -> PlannerInputs:
    return planner_inputs(
        snap,
        planned_tasks(snap),
        gpu=GPU,
        assume=CTX.assume,
        prior=CTX.failure,
        plan=PlanConfig(),
        now_s=now_s,
    )


def gpus(snap: Snapshot, now_s: float, *, calibrated: bool = True) -> dict[str, int]:
    plan = plan_for(snap, CTX, now_s, calibrated=calibrated)
    assert plan is not None
    return plan.workers_by_task()


# --- iteration times ----------------------------------------------------------------------


def test_iterations_twice_as_slow_as_predicted_move_the_planners_throughput_and_its_plan() -> None:
    snap = two_tasks()
    assert gpus(snap, T0) == {"a": 2, "b": 2}
    slow = report(snap, "a", range(11, 211), 2 * predicted_s(snap, "a"))
    (entry,) = slow.calibration.layouts
    assert (entry.model, entry.layout, entry.iteration_s.count) == (
        model_key(MODEL),
        slow.tasks["a"].layout,
        200,
    )
    # the analytic model counts as 20 iterations against 200 measured at half its speed
    got = inputs(slow, T0)
    assert got.efficiency["a"].pooled == 120 / 220 and "b" not in got.efficiency
    assert gpus(slow, T0 + 300) == {"a": 1, "b": 3}
    assert gpus(slow, T0 + 300, calibrated=False) == {"a": 2, "b": 2}
    _, moved = replan_decision(slow, CTX, T0 + 300)
    assert [a.task_id for a in of_kind(moved.actions, Shrink)] == ["a"]
    # [plan] calibrate = false (the dev cluster): unicornd keeps the analytic plan
    analytic = replace(CTX, plan=PlanConfig(calibrate=False))
    plan = plan_for(slow, analytic, T0 + 300)
    assert plan is not None and plan.workers_by_task() == {"a": 2, "b": 2}
    assert not of_kind(replan_decision(slow, analytic, T0 + 300)[1].actions, Shrink)
    # a measurement that agrees with the model changes nothing
    agreed = report(snap, "a", range(11, 211), predicted_s(snap, "a"))
    assert gpus(agreed, T0 + 300) == {"a": 2, "b": 2}


def test_a_report_counts_once_for_the_iterations_it_covers_and_never_while_in_doubt() -> None:
    snap = two_tasks()
    first = report(snap, "a", range(20, 21), 0.5, span=10)
    (entry,) = first.calibration.layouts
    assert entry.iteration_s == Running(0.5, 10.0)  # iterations 11..20 at 0.5 s each
    # redelivered, or recomputed below the mark: nothing new
    assert report(first, "a", range(20, 21), 9.0).calibration == first.calibration
    assert report(first, "a", range(15, 16), 9.0).calibration == first.calibration
    # an open incident: the ranks being replaced may be sick, their times are not the layout's
    sick = apply(first, on_finding(first, finding("f", 1, "n1", ErrorStatus.OTHER_SOFTWARE_ERROR), T0))
    old_ranks = report(sick, "a", range(21, 30), 9.0, launch_id="plan-0/a/launch")
    assert old_ranks.incidents["a.1"].is_open and old_ranks.tasks["a"].last_iteration == 29
    assert old_ranks.calibration.layouts == first.calibration.layouts
    # the restarted ranks' first iteration closes it; their warm-up is not measured either
    rid = "a.1/restart_processes/1/restart_ranks/n1"
    restarted = report(old_ranks, "a", range(30, 33), 9.0, launch_id=rid)
    assert not restarted.incidents["a.1"].is_open and restarted.calibration.warm_after == {"a": 32}
    assert restarted.calibration.layouts == first.calibration.layouts
    # no timing (an evaluation or a save: the ingest path gives none) measures nothing either
    quiet = apply(first, on_progress(first, "a", 25, T0 + 25, reported_s=T0 + 25))
    assert quiet.calibration == first.calibration and quiet.tasks["a"].last_iteration == 25


def test_the_first_iterations_after_a_launch_are_warm_up() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"], state=TaskState.LAUNCHING, launched_s=T0)])
    started = report(snap, "a", range(11, 12), 5.0)  # the new ranks' first iteration
    assert started.tasks["a"].state is TaskState.RUNNING
    assert started.calibration.warm_after == {"a": 13} and not started.calibration.layouts
    warm = report(started, "a", range(12, 14), 5.0)
    assert not warm.calibration.layouts
    counted = report(warm, "a", range(14, 15), 0.25)
    assert [m.iteration_s for m in counted.calibration.layouts] == [Running(0.25, 1.0)]
    off = replace(PlanConfig(), iteration_warmup=0)
    unwarmed = apply(snap, on_progress(snap, "a", 11, T0 + 11, reported_s=T0 + 11, plan=off))
    assert unwarmed.calibration.warm_after == {"a": 11}


# --- transitions ------------------------------------------------------------------------------


def test_a_plan_launch_measures_the_transition_and_the_planner_uses_it() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"], state=TaskState.LAUNCHING, launched_s=T0)])
    after = apply(snap, on_progress(snap, "a", 11, T0 + 30, reported_s=T0 + 30))
    assert after.calibration.transitions == {"a": Running(30.0, 1.0)}
    prior = TransitionModel().transition_s(snap.tasks["a"].spec())
    got = inputs(after, T0 + 30)
    assert got.transition.transition_s(snap.tasks["a"].spec()) == (prior + 30.0) / 2
    # the first launch of a task that never ran is a start, not a transition
    fresh = world(
        4, [task("a", 1, ["n1", "n2"], state=TaskState.LAUNCHING, launched_s=T0, last_iteration=None)]
    )
    started = apply(fresh, on_progress(fresh, "a", 1, T0 + 30, reported_s=T0 + 30))
    assert started.calibration.transitions == {} and started.calibration.warm_after == {"a": 3}


def test_a_relaunch_after_a_drain_measures_the_transition() -> None:
    snap = two_tasks()
    dead = finding("f1", 1, "n2", ErrorStatus.LOST_CONNECTION)
    drained = apply(snap, resolve(snap, on_finding(snap, dead, T0), CTX, T0))
    assert drained.incidents["a.1"].stage.value == "transition"
    launched = drained.tasks["a"].launched_s
    assert launched == T0
    back = apply(drained, on_progress(drained, "a", 9, T0 + 42, reported_s=T0 + 42))
    assert not back.incidents["a.1"].is_open
    assert back.calibration.transitions == {"a": Running(42.0, 1.0)}


# --- node MTBF ---------------------------------------------------------------------------------


def test_the_mtbf_comes_from_the_node_failures_incidents_found() -> None:
    snap = two_tasks()
    assert inputs(snap, T0).failure.node_mtbf_h == 24.0
    dead = finding("f1", 1, "n2", ErrorStatus.LOST_CONNECTION)
    after = apply(snap, resolve(snap, on_finding(snap, dead, T0), CTX, T0))
    assert after.calibration.node_failures == 1 and after.calibration.since_s == T0
    # two more nodes found faulty later (a failed node check, say): counted as they are recorded
    later = T0 + 5 * 3600
    marked = [replace(after.node(n), failures_s=(later,)) for n in ("n3", "n4")]
    after = apply(after, resolve(after, Decision(nodes=tuple(marked)), CTX, later))
    assert after.calibration.node_failures == 3
    assert (
        apply(after, resolve(after, Decision(nodes=tuple(marked)), CTX, later)).calibration.node_failures == 3
    )
    # 4 nodes x 10 h, 3 failures, against 24 h counted as 2 failures: (2 x 24 + 40) / 5
    assert inputs(after, T0 + 10 * 3600).failure.node_mtbf_h == (2 * 24 + 40) / 5
    quiet = replace(snap, calibration=Calibration(since_s=T0))
    assert inputs(quiet, T0 + 12 * 3600).failure.node_mtbf_h == (48 + 48) / 2


# --- persistence ---------------------------------------------------------------------------


def measured_snapshot() -> Snapshot:
    snap = two_tasks()
    snap = report(snap, "a", range(11, 111), 2 * predicted_s(snap, "a"))
    cal = replace(snap.calibration, transitions={"b": Running(30.0, 2.0, 2)}, node_failures=1, since_s=T0)
    return replace(snap, calibration=cal)


def test_calibration_round_trips_through_the_store_and_old_snapshots_load_without_it() -> None:
    snap = measured_snapshot()
    assert snapshot_from_json(snapshot_to_json(snap), Policy()) == snap
    doc = json.loads(snapshot_to_json(snap))
    del doc["calibration"]
    assert snapshot_from_json(json.dumps(doc), Policy()).calibration == Calibration()


async def test_training_steps_reaching_unicornd_are_measured_and_survive_a_restart(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(Config().redis.key_prefix)
    core = Core(Store(client, keys, Policy()), CTX)
    detector = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    agents = AgentInputs(Config(), core, detector)
    try:
        await core.start(two_tasks())
        for i, phase in [
            (11, IterationPhase.TRAIN),
            (12, IterationPhase.CHECKPOINT),
            (13, IterationPhase.TRAIN),
        ]:
            msg = IterationTiming(
                job_id=1,
                node="n1",
                wall_time_s=T0 + i,
                rank=0,
                iteration=i,
                duration_s=0.5 if phase is IterationPhase.TRAIN else 30.0,
                samples=None,
                phase=phase,
            )
            await agents.on_message(msg, float(i), f"{int((T0 + i) * 1000)}-0", keys.events(1))
        (entry,) = core.snap.calibration.layouts
        assert entry.iteration_s == Running(0.5, 2.0, 2)  # the save's 30 s is not the layout's speed
        await core.flush()
        restarted = await Store(client, keys, Policy()).load(2)
        assert restarted.calibration == core.snap.calibration
    finally:
        await client.aclose()


# --- unicornctl plan --explain ---------------------------------------------------------------


def test_explain_shows_predicted_and_measured_side_by_side() -> None:
    snap = measured_snapshot()
    expl, calibrated, analytic = explanation(snap, CTX, T0 + 3600)
    doc = explanation_json(expl, calibrated, analytic)
    a, b = doc["tasks"]
    assert a["iteration_s"]["measured"] == round(2 * predicted_s(snap, "a"), 6)
    assert a["iteration_s"]["predicted"] == round(predicted_s(snap, "a"), 6)
    assert a["iteration_s"]["observations"] == 100
    assert a["tflops_per_gpu"]["measured"] < a["tflops_per_gpu"]["planned"] < a["tflops_per_gpu"]["predicted"]
    assert b["iteration_s"]["measured"] is None and b["iteration_s"]["observations"] == 0
    assert b["transition_s"]["measured"] == 30.0 and b["transition_s"]["observations"] == 2
    assert doc["node_mtbf_h"] == {"predicted": 24.0, "measured": 4.0, "observations": 1, "planned": 17.33}
    assert (a["planned_gpus"], a["analytic_gpus"]) == (2, 4)
    text = render_explanation(expl, calibrated, analytic)
    header = text.splitlines()[1].split()
    assert header[-4:] == ["PREDICTED", "MEASURED", "(N)", "PLANNED"]
    assert "iteration_s" in text and "transition_s" in text and "node_mtbf_h" in text
    assert "plan GPUs, calibrated (analytic only): a 2 (4), b 6 (4)" in text


def test_plan_explain_reads_unicornds_snapshot(redis_url: str) -> None:
    prefix = "explaintest"
    redis.Redis.from_url(redis_url).set(RedisKeys(prefix).state(), snapshot_to_json(measured_snapshot()))
    env = {"UNICORN_REDIS__URL": redis_url, "UNICORN_REDIS__KEY_PREFIX": prefix, "UNICORN_CONFIG": ""}
    text = CliRunner().invoke(cli, ["plan", "--explain"], env=env)
    assert text.exit_code == 0, text.output
    assert "PREDICTED" in text.stdout and "MEASURED" in text.stdout and "tflops_per_gpu" in text.stdout
    doc = CliRunner().invoke(cli, ["plan", "--explain", "--json"], env=env)
    assert doc.exit_code == 0, doc.output
    assert [t["task_id"] for t in json.loads(doc.stdout)["tasks"]] == ["a", "b"]
    mixed = CliRunner().invoke(cli, ["plan", "--explain", "--nodes", "2"], env=env)
    assert mixed.exit_code == 2 and "--explain plans the live cluster" in mixed.stderr
    none = CliRunner().invoke(cli, ["plan", "--explain"], env={**env, "UNICORN_REDIS__KEY_PREFIX": "nothing"})
    assert none.exit_code == 3
