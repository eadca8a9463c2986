"""The goodput ledger (issue 21): a scripted history booked by cause, derived by hand here;
bad stored ledgers and bad ``--since`` values; the metrics and the Grafana dashboard."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import redis
import redis.asyncio as aioredis
from click.testing import CliRunner
from prometheus_client import generate_latest

from detect.statuses import ErrorStatus, Severity
from plan.hardware import gpu_spec
from plan.perf import LayoutEstimate, PerfAssumptions, best_layout
from tests.unicornd.coord_world import GPN, MODEL, render, task, world
from unicorn_core.errors import ProtocolError
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import reset_logging
from unicornd.cli import cli
from unicornd.cli.goodput import parse_since
from unicornd.goodput import (
    RANGES_KEEP,
    Cause,
    Ledger,
    Phase,
    add_range,
    advance,
    decode,
    encode,
    new_ledger,
)
from unicornd.ledgerstore import save_ledger
from unicornd.metrics import SnapshotMetrics
from unicornd.state import Incident, LadderStage, NodeHealth, NodeRecord, Snapshot, StageEntry, TaskState
from unicornd.store import KINDS

L = LadderStage
T0 = 1_700_000_000.0
GPU = gpu_spec("a100-80g")
ASSUME = PerfAssumptions()
WEIGHT = 2.0
WF = WEIGHT * MODEL.model_flop_per_iteration() / 1e12
"""Weighted TFLOP of one iteration."""


def _best(nodes: int) -> LayoutEstimate:
    est = best_layout(MODEL, nodes * GPN, GPU, GPN)
    assert isinstance(est, LayoutEstimate), est
    return est


BEST2, BEST1 = _best(2), _best(1)
REL = 1e-6


def _estimates() -> tuple[float, float]:
    return BEST2.iteration_s, BEST1.iteration_s


def running(
    nodes: tuple[str, ...],
    layout_nodes: int,
    iteration: int,
    at: float,
    *,
    state: TaskState = TaskState.RUNNING,
    launched_s: float | None = None,
) -> Snapshot:
    best = BEST2 if layout_nodes == 2 else BEST1
    t = task(
        "a",
        1,
        list(nodes),
        state=state,
        weight=WEIGHT,
        layout=best.layout,
        last_iteration=iteration,
        last_iteration_s=T0 + at,
        launched_s=launched_s,
    )
    return world(2, [t])


def book(ledger: Ledger, snap: Snapshot, at: float) -> Ledger:
    return advance(ledger, snap, T0 + at, GPU, ASSUME)


def incident(*stages: tuple[LadderStage, float]) -> Incident:
    inc = Incident(
        "a.1",
        "a",
        "n2",
        None,
        ErrorStatus.LOST_CONNECTION,
        Severity.SEV1,
        "r",
        "e",
        T0 + stages[0][1],
        timeline=(StageEntry(L.DETECTED, T0 + stages[0][1]),),
    )
    for stage, at in stages[1:]:
        inc = inc.moved(stage, T0 + at)
    return inc


def test_a_node_loss_is_booked_by_cause_and_the_causes_add_up_to_the_gap() -> None:
    """Runs on 2 nodes at 1 s an iteration (its first stretch calibrates it); n2 dies after
    iteration 10 (t=10); detected at 15, drained at 17 and relaunched on n1; the new ranks'
    first iteration (8: 3 lost) at 27; then at the calibrated 1-node speed to iteration 14."""
    a2, a1 = _estimates()
    tau1 = a1 / a2  # 1-node iteration time at the calibration (measured 1 s on 2 nodes)
    p2, p1 = WF / 1.0, WF / tau1  # weighted TFLOP/s in force on 2 nodes, on 1
    end = 27 + 6 * tau1
    both = ("n1", "n2")
    ledger = new_ledger(T0)
    for sec in range(11):
        ledger = book(ledger, running(both, 2, sec, sec), sec)
    ledger = book(ledger, running(both, 2, 10, 10), 12)  # no iteration since 10: not attributed yet
    assert ledger.tasks["a"].booked_s == T0 + 10

    detected = incident((L.DETECTED, 15), (L.ISOLATE, 15))
    snap = running(both, 2, 10, 10, state=TaskState.RECOVERING)
    snap = snap.apply(nodes=[NodeRecord("n2", NodeHealth.DRAINING)], incidents=[detected])
    ledger = book(ledger, snap, 15)

    drained = incident((L.DETECTED, 15), (L.ISOLATE, 15), (L.REPLAN, 17), (L.TRANSITION, 17))
    snap = running(("n1",), 1, 10, 10, state=TaskState.RECOVERING, launched_s=T0 + 17)
    snap = snap.apply(nodes=[NodeRecord("n2", NodeHealth.DRAINED)], incidents=[drained])
    ledger = book(ledger, snap, 17)
    ledger = book(ledger, snap, 20)

    resumed = replace(drained.moved(L.RESUMED, T0 + 27).moved(L.CLOSED, T0 + 27))
    after = running(("n1",), 1, 10, 10, launched_s=T0 + 17)
    after = after.apply(nodes=[NodeRecord("n2", NodeHealth.DRAINED)], incidents=[resumed])
    ledger = book(ledger, after, 27)  # iterations 8, 9, 10 again: the mark stays at 10
    for k, it in enumerate(range(11, 15), start=3):
        at = 27 + k * tau1
        snap = replace(
            after, tasks={"a": replace(after.tasks["a"], last_iteration=it, last_iteration_s=T0 + at)}
        )
        ledger = book(ledger, snap, at)

    t = ledger.totals
    # Work (weighted TFLOP), by hand; the WAF accounts start at t=1 (calibrated).
    ideal = p2 * (end - 1)
    achieved = 13 * WF  # iterations 2..14 once each
    expected = {
        Cause.DETECTION: 5 * p2,  # 10 -> 15 on 2 nodes
        Cause.DECISION_DRAIN: 2 * p2,  # 15 -> 17
        Cause.TRANSITION: 10 * p1,  # 17 -> 27 on the new layout
        Cause.RECOMPUTATION: 2 * tau1 * p1,  # 27 -> passing iteration 10 again
        Cause.SUB_HEALTHY: (p2 - p1) * (end - 17),  # one node out from the drain on
        Cause.IDLE: 0.0,
    }
    assert t.ideal_wtflop == pytest.approx(ideal, rel=REL)
    assert t.achieved_wtflop == pytest.approx(achieved, rel=REL)
    for cause, value in expected.items():
        assert t.lost_wtflop[cause] == pytest.approx(value, rel=REL, abs=1e-6 * ideal), cause
    gap = t.ideal_wtflop - t.achieved_wtflop
    assert abs(sum(t.lost_wtflop.values()) - gap) <= 0.02 * gap
    # GPU-seconds, by hand, from t=0.
    g = GPN
    expected_gpu = {
        Cause.DETECTION: 2 * g * 5,
        Cause.DECISION_DRAIN: 2 * g * 2,
        Cause.TRANSITION: g * 10,
        Cause.RECOMPUTATION: g * 2 * tau1,
        Cause.SUB_HEALTHY: g * (end - 17),  # n2's GPUs, out
        Cause.IDLE: 0.0,
    }
    assert t.gpu_s == pytest.approx(2 * g * end, rel=REL)
    assert t.productive_gpu_s == pytest.approx(2 * g * 10 + g * 4 * tau1, rel=REL)
    for cause, value in expected_gpu.items():
        assert t.lost_gpu_s[cause] == pytest.approx(value, rel=REL, abs=1e-9), cause
    assert ledger.achieved_wtflops() == pytest.approx(p1, rel=REL)
    assert ledger.ideal_wtflops() == pytest.approx(p2, rel=REL)
    # The only task holds all the work; the cluster adds the GPUs no task holds (n2, out).
    mine = ledger.tasks["a"].totals
    assert (mine.ideal_wtflop, mine.achieved_wtflop, mine.lost_wtflop) == (
        t.ideal_wtflop,
        t.achieved_wtflop,
        t.lost_wtflop,
    )
    assert mine.lost_gpu_s[Cause.SUB_HEALTHY] == pytest.approx(0.0, abs=1e-6)
    # The measured running stretches: 2..10 at 1 s, then 12..14 at tau1 (the stretch of 11,
    # which passed the mark after the recomputation of 8..10, is booked at the calibration).
    assert ledger.tasks["a"].running_iterations == 12
    assert ledger.tasks["a"].running_s == pytest.approx(9 + 3 * tau1, rel=REL)
    assert ledger.tasks["a"].running_ranges == [(2, 10), (12, 14)]


def test_a_new_layout_starts_a_new_calibration() -> None:
    """Found by CI (stop 44): after a shrink the task's calibration, carried over from the old
    layout and moved 0.3 of the way per faster stretch, lagged the new layout's measured rate,
    and W* read below the achieved rate. On 2 nodes at 1 s an iteration, then relaunched on n1
    (no incident) where it runs twice as fast as the 2-node calibration predicts: its first
    running stretch there sets the calibration, and W* is again at least the achieved rate."""
    a2, a1 = _estimates()
    ledger = new_ledger(T0)
    for sec in range(6):
        ledger = book(ledger, running(("n1", "n2"), 2, sec, sec), sec)
    assert ledger.tasks["a"].efficiency == pytest.approx(a2 / 1.0, rel=REL)
    tau = 0.5 * a1 / a2  # twice the calibrated 1-node speed
    ledger = book(ledger, running(("n1",), 1, 5, 5, launched_s=T0 + 6), 6)
    for k, it in enumerate(range(6, 10), start=1):
        at = 6 + k * tau
        ledger = book(ledger, running(("n1",), 1, it, at, launched_s=T0 + 6), at)
    book_ = ledger.tasks["a"]
    assert book_.phase is Phase.RUNNING
    assert book_.efficiency == pytest.approx(a1 / tau, rel=REL)  # not 0.3 of the way from a2
    assert book_.calibrated_analytic_s == pytest.approx(a1, rel=REL)
    assert ledger.achieved_wtflops() == pytest.approx(WF / tau, rel=REL)
    assert ledger.ideal_wtflops() >= ledger.achieved_wtflops()
    # A later stretch on the same layout moves it as before (a slower one by 0.03 of the way).
    at = 6 + 4 * tau + 2 * tau
    ledger = book(ledger, running(("n1",), 1, 10, at, launched_s=T0 + 6), at)
    e = a1 / tau
    assert ledger.tasks["a"].efficiency == pytest.approx(e + 0.03 * (a1 / (2 * tau) - e), rel=REL)


def test_idle_gpus_and_a_slow_stretch_are_their_own_causes() -> None:
    """On n1 of two healthy nodes at 1 s an iteration, then iteration 6 takes 2 s."""
    a2, a1 = _estimates()
    ideal_rate = WF * a1 / a2  # the best 2-node layout at the 1-node calibration
    ledger = new_ledger(T0)
    for sec in range(6):
        ledger = book(ledger, running(("n1",), 1, sec, sec), sec)
    ledger = book(ledger, running(("n1",), 1, 6, 7), 7)
    tot = ledger.totals
    assert tot.ideal_wtflop == pytest.approx(ideal_rate * 6, rel=REL)
    assert tot.achieved_wtflop == pytest.approx(5 * WF, rel=REL)
    assert tot.lost_wtflop[Cause.IDLE] == pytest.approx((ideal_rate - WF) * 6, rel=REL)
    assert tot.lost_wtflop[Cause.SUB_HEALTHY] == pytest.approx(2 * WF - WF, rel=REL)
    assert tot.lost_gpu_s[Cause.IDLE] == pytest.approx(GPN * 7, rel=REL)
    assert tot.lost_gpu_s[Cause.SUB_HEALTHY] == pytest.approx(GPN * 1, rel=REL)
    assert tot.productive_gpu_s == pytest.approx(GPN * 6, rel=REL)
    assert abs(tot.unattributed_wtflop) <= 1e-9 * tot.ideal_wtflop


def test_the_ledger_round_trips_and_a_malformed_one_is_refused() -> None:
    ledger = book(new_ledger(T0), running(("n1",), 1, 0, 0), 0)
    ledger = book(ledger, running(("n1",), 1, 3, 3), 3)
    assert decode(encode(ledger)) == ledger
    for raw, kind in [
        (b"not json", "malformed"),
        (b'{"t_s": 1.0}', "invalid"),
        (encode(ledger).replace(b'"t_s"', b'"t_s_x"', 1), "invalid"),
        (json.dumps({**json.loads(encode(ledger)), "v": 99}).encode(), "invalid"),
        (json.dumps({**json.loads(encode(ledger)), "gpus_out": -1}).encode(), "invalid"),
    ]:
        with pytest.raises(ProtocolError) as e:
            decode(raw)
        assert e.value.kind == kind


@pytest.mark.parametrize("text", ["7", "week", "-1d", "0h", "7dd", ""])
def test_since_refuses_what_is_no_duration(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_since(text)


def test_since_reads_units() -> None:
    assert (parse_since("90m"), parse_since("7d"), parse_since("1.5h")) == (5400.0, 7 * 86400.0, 5400.0)


def test_goodput_cli_bad_since_exits_2_and_bad_ledger_exits_1_changing_nothing(redis_url: str) -> None:
    reset_logging()
    env = {"UNICORN_REDIS__URL": redis_url, "UNICORN_REDIS__PASSWORD_FILE": ""}
    runner = CliRunner()
    result = runner.invoke(cli, ["goodput", "--since", "soon"], env=env)
    assert result.exit_code == 2 and "not a duration" in result.output
    result = runner.invoke(cli, ["goodput"], env=env)
    assert result.exit_code == 3, result.output
    key = RedisKeys("unicorn").goodput()
    admin = redis.Redis.from_url(redis_url)
    admin.set(key, b'{"t_s": "yesterday"}')
    result = runner.invoke(cli, ["goodput", "--json"], env=env)
    assert result.exit_code == 1 and "goodput ledger" in result.output
    assert admin.get(key) == b'{"t_s": "yesterday"}'
    ledger = book(new_ledger(T0), running(("n1",), 1, 0, 0), 0)
    ledger = book(ledger, running(("n1",), 1, 4, 4), 4)
    admin.set(key, encode(ledger))
    result = runner.invoke(cli, ["goodput", "--json", "--since", "7d"], env=env)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert set(doc) >= {"ideal", "achieved", "lost", "tasks"} and set(doc["lost"]) == {c.value for c in Cause}
    assert doc["achieved"] == pytest.approx(ledger.totals.achieved_wtflop)
    a = ledger.tasks["a"]
    shown = doc["tasks"]["a"]
    assert a.iteration_wtflop > 0 and shown["iteration_wtflop"] == pytest.approx(a.iteration_wtflop)
    assert doc["tasks"]["a"]["gpus"] == a.gpus
    rate = a.achieved_wtflops if a.phase is Phase.RUNNING else 0.0
    assert doc["tasks"]["a"]["achieved_waf_tflops"] == pytest.approx(rate)
    result = runner.invoke(cli, ["goodput"], env=env)
    assert result.exit_code == 0 and "task a" in result.output


def test_metrics_export_the_ledger_and_the_dashboard_uses_only_them() -> None:
    metrics = SnapshotMetrics(gpu=GPU)
    snap = running(("n1",), 1, 0, 0)
    metrics.update(snap)
    ledger = book(book(new_ledger(T0), snap, 0), running(("n1",), 1, 3, 3), 3)
    ledger = book(ledger, running(("n1",), 1, 5, 5), 5)
    metrics.update_ledger(ledger)
    text = generate_latest(metrics.registry).decode()
    for c in Cause:
        value = ledger.totals.lost_gpu_s[c]
        assert f'unicorn_goodput_lost_gpu_seconds_total{{cause="{c.value}"}} {float(value)!r}' in text
    assert f"unicorn_goodput_achieved_waf_tflops {ledger.achieved_wtflops()!r}" in text
    exported = set(re.findall(r"^(unicorn_goodput_\w+?)(?:\{| )", text, re.M))
    dashboard = json.loads((Path(__file__).parents[2] / "etc" / "grafana-goodput.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    used = {m for e in exprs for m in re.findall(r"\bunicorn_\w+", e)}
    assert used and used <= exported, used - exported
    assert msgspec.json.decode(msgspec.json.encode(dashboard))["title"]


async def test_a_ledger_save_is_fenced_by_the_token_and_the_lease_holder(redis_url: str) -> None:
    """As a commit (unicornd/store.py): the fence must carry the saver's token AND the lease
    must name the saver; after a failover that lost an INCR of the fence, two leaders can
    hold the same token, and only the lease tells them apart."""
    keys = RedisKeys("fencetest")
    client = aioredis.Redis.from_url(redis_url)
    admin = redis.Redis.from_url(redis_url)
    ledger = book(new_ledger(T0), running(("n1",), 1, 0, 0), 0)
    try:
        admin.set(keys.fence(), 7)
        admin.set(keys.leader(), "7:a")
        assert await save_ledger(client, keys, ledger, token=7, holder="7:a")
        assert decode(admin.get(keys.goodput()) or b"") == ledger
        later = book(ledger, running(("n1",), 1, 3, 3), 3)
        # The same token, another holder (the twin leader of a lost INCR): refused.
        assert not await save_ledger(client, keys, later, token=7, holder="7:b")
        # An older token (a deposed leader): refused.
        admin.set(keys.fence(), 8)
        admin.set(keys.leader(), "8:b")
        assert not await save_ledger(client, keys, later, token=7, holder="7:a")
        assert decode(admin.get(keys.goodput()) or b"") == ledger  # unchanged by either
        assert await save_ledger(client, keys, later, token=8, holder="8:b")
        assert decode(admin.get(keys.goodput()) or b"") == later
        assert await save_ledger(client, keys, ledger)  # no election (token 0): written
    finally:
        await client.aclose()


def test_a_node_another_users_job_holds_is_neither_ideal_nor_idle() -> None:
    """As the idle test above, but n2 runs job 99, no task's ([slurm] scope: not ours): its
    GPUs are someone else's work, so the ideal is the 1-node one and nothing is idle."""
    ledger = new_ledger(T0)

    def shared(iteration: int, at: float) -> Snapshot:
        snap = running(("n1",), 1, iteration, at)
        return snap.apply(nodes=[replace(snap.nodes["n2"], jobs=(99,))])

    for sec in range(6):
        ledger = book(ledger, shared(sec, sec), sec)
    tot = ledger.totals
    assert ledger.gpus_total == GPN and ledger.gpus_idle == 0 and ledger.gpus_out == 0
    assert tot.ideal_wtflop == pytest.approx(WF * 4, rel=REL)  # calibrated at t=1, at 1 s an iteration
    assert tot.lost_wtflop[Cause.IDLE] == pytest.approx(0.0, abs=1e-9 * WF)
    assert tot.lost_gpu_s[Cause.IDLE] == 0.0 and tot.gpu_s == pytest.approx(GPN * 5, rel=REL)


async def test_accounting_never_stops_a_commit(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger that cannot be saved, or cannot even advance, costs the ledger, never the commit."""
    from plan.objective import FailureModel
    from unicorn_core.errors import RedisCallError
    from unicornd import core as core_mod
    from unicornd.actions import Decision
    from unicornd.core import Core
    from unicornd.replan import PlanContext
    from unicornd.state import Policy
    from unicornd.store import Store

    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys("accounttest")
    core = Core(Store(client, keys, Policy()), PlanContext(GPU, FailureModel(24.0), lambda _g, _n: render))
    core.ledger = new_ledger(T0)
    core.clock = lambda: T0 + 1

    async def unreachable(*_a: object, **_k: object) -> bool:
        raise RedisCallError(("EVAL",), None, message="down")

    monkeypatch.setattr(core_mod, "save_ledger", unreachable)
    try:
        await core.start(running(("n1",), 1, 0, 0))
        assert core.committed is not None and core.ledger is not None and core.ledger.t_s == T0 + 1
        assert not await client.exists(keys.goodput())

        def broken(*_a: object, **_k: object) -> Ledger:
            raise ZeroDivisionError("a bug in the accounting")

        monkeypatch.setattr(core_mod.goodput, "advance", broken)
        later = running(("n1",), 1, 3, 3, launched_s=T0 + 2)  # not progress alone: committed now
        await core.decide(T0 + 2, lambda _s: Decision(tasks=(later.tasks["a"],)))
        assert core.ledger is None and core.committed is not None
        assert core.committed.tasks["a"].last_iteration == 3
        assert await client.get(keys.state_meta()) is not None
    finally:
        await client.aclose()


def test_running_ranges_merge_when_adjacent_and_stay_bounded() -> None:
    ranges = add_range([], 2, 10)
    assert add_range(ranges, 11, 14) == [(2, 14)]
    assert add_range(ranges, 12, 14) == [(2, 10), (12, 14)]
    many: list[tuple[int, int]] = []
    for k in range(3 * RANGES_KEEP):
        many = add_range(many, 2 * k, 2 * k)
    assert len(many) == RANGES_KEEP and many[-1] == (6 * RANGES_KEEP - 2, 6 * RANGES_KEEP - 2)


async def test_a_quiet_cluster_still_saves_its_ledger_on_the_tick(redis_url: str) -> None:
    """No commit after the last one (a task finished, nothing else happens): the ticker's
    flush still advances and saves the ledger once a save is due, so ``unicornctl goodput``
    never reads a ledger older than the save interval."""
    from plan.objective import FailureModel
    from unicornd.core import Core
    from unicornd.ledgerstore import SAVE_EVERY_S, read_ledger
    from unicornd.replan import PlanContext
    from unicornd.state import Policy
    from unicornd.store import Store

    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys("quiettest")
    core = Core(Store(client, keys, Policy()), PlanContext(GPU, FailureModel(24.0), lambda _g, _n: render))
    core.ledger = new_ledger(T0)
    now = [T0 + 1]
    core.clock = lambda: now[0]
    try:
        await core.start(running(("n1",), 1, 0, 0))
        saved = await read_ledger(client, keys)
        assert saved is not None and saved.t_s == T0 + 1
        now[0] = T0 + 1 + SAVE_EVERY_S / 2
        await core.flush()  # not due yet: nothing saved
        saved = await read_ledger(client, keys)
        assert saved is not None and saved.t_s == T0 + 1
        now[0] = T0 + 1 + SAVE_EVERY_S
        await core.flush()
        saved = await read_ledger(client, keys)
        assert saved is not None and saved.t_s == T0 + 1 + SAVE_EVERY_S
        assert saved.totals.gpu_s == pytest.approx(saved.gpus_total * SAVE_EVERY_S, rel=REL)  # booked to now
    finally:
        await client.delete(keys.goodput(), keys.state_meta(), *(keys.state_records(k) for k in KINDS))
        await client.aclose()


def test_an_idle_node_slurm_holds_down_is_out_not_idle() -> None:
    """As the idle test, but idle n2 is NOT_RESPONDING in Slurm (``slurm_down``): no plan
    may use it, so its GPUs are out of service, not capacity unicorn left idle."""
    ledger = new_ledger(T0)

    def down(iteration: int, at: float) -> Snapshot:
        snap = running(("n1",), 1, iteration, at)
        return snap.apply(nodes=[replace(snap.nodes["n2"], slurm_down=True)])

    for sec in range(6):
        ledger = book(ledger, down(sec, sec), sec)
    assert ledger.gpus_idle == 0 and ledger.gpus_out == GPN
    assert ledger.totals.lost_gpu_s[Cause.IDLE] == 0.0
