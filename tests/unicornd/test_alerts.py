"""Alerts derived from snapshot pairs (driven by the real decision functions) and their delivery
to a real command and a real local HTTP server."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from detect.statuses import ErrorStatus, Severity
from tests.conftest import Receiver, http_receiver
from tests.unicornd.coord_world import apply, finding, plan, render, task, world
from tests.unicornd.redis_world import until
from unicorn_core.config import AlertsConfig, Config, load_config
from unicorn_core.errors import CommandFailed, CommandNotFound, CommandTimeout, ConfigError
from unicornd.alerts import (
    Alert,
    AlertKind,
    AlertSink,
    OperatorReason,
    WebhookError,
    alerts_for,
    incident_milestones,
    stage_spans,
)
from unicornd.decide import on_finding, on_operator_confirm_drain, on_progress, on_tick
from unicornd.replan import plan_transition
from unicornd.state import Incident, LadderStage, Policy, Snapshot, StageEntry, TaskState

E = ErrorStatus
L = LadderStage
T0 = 1_700_000_000.0
SETTLE = Policy().settle_s + 1


def two_tasks(policy: Policy | None = None, nodes: int = 8) -> Snapshot:
    return world(nodes, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4"])], policy)


def step(snap: Snapshot, new: Snapshot, now: float) -> tuple[Snapshot, list[Alert]]:
    return new, alerts_for(snap, new, now)


def kinds(alerts: list[Alert]) -> list[tuple[str, AlertKind]]:
    return [(a.incident.incident_id, a.kind) for a in alerts]


# --- alerts_for ------------------------------------------------------------------------


def test_no_change_no_alert() -> None:
    snap = two_tasks()
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0))
    assert alerts_for(snap, snap, T0 + 1) == []


def test_ladder_climb_gives_opened_then_one_escalation_per_rung() -> None:
    snap, now = two_tasks(), T0
    snap, out = step(
        snap, apply(snap, on_finding(snap, finding("f1", 1, "n2", E.CONNECTION_REFUSED_RESET), now)), now
    )
    assert kinds(out) == [("a.1", AlertKind.OPENED)]
    assert out[0].incident.stage is L.RETRY_IN_PLACE and out[0].job_id == 1 and out[0].task_name == "a"
    now += SETTLE
    snap, out = step(
        snap, apply(snap, on_finding(snap, finding("f2", 1, "n2", E.OTHER_SOFTWARE_ERROR), now)), now
    )
    assert kinds(out) == [("a.1", AlertKind.ESCALATED)]
    assert (out[0].from_stage, out[0].to_stage, out[0].event_s) == (
        L.RETRY_IN_PLACE,
        L.RESTART_PROCESSES,
        now,
    )
    now += SETTLE
    snap, out = step(snap, apply(snap, on_finding(snap, finding("f3", 1, "n2", E.ECC_ERROR), now)), now)
    assert snap.incidents["a.1"].stage is L.REPLAN, "isolate then replan in one decision"
    assert kinds(out) == [("a.1", AlertKind.ESCALATED)], "replan is part of the isolate rung"
    assert (out[0].from_stage, out[0].to_stage) == (L.RESTART_PROCESSES, L.ISOLATE)
    assert len({a.alert_id for a in out}) == len(out)


def test_full_recovery_closes_with_milestone_durations() -> None:
    snap, now = two_tasks(), T0
    snap, out = step(snap, apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), now)), now)
    assert kinds(out) == [("a.1", AlertKind.OPENED)], "the first rung is the response, not an escalation"
    t_plan, t_resume = now + 3, now + 40
    snap, out = step(snap, apply(snap, plan_transition(snap, plan({"a": 2, "b": 4}), render, t_plan)), t_plan)
    assert out == [], "a plan being applied is no alert"
    snap, out = step(snap, apply(snap, on_progress(snap, "a", 11, t_resume)), t_resume)
    assert kinds(out) == [("a.1", AlertKind.CLOSED)]
    closed = out[0]
    assert closed.durations_s == {
        "classified": 0.0,
        "drained": 0.0,
        "replanned": t_plan - now,
        "resumed": t_resume - now,
        "closed": t_resume - now,
    }
    assert f"after {t_resume - now:.1f} s" in closed.summary
    doc = closed.to_json()
    assert json.loads(json.dumps(doc)) == doc, "plain JSON types"
    assert Incident.from_dict(doc["incident"]) == snap.incidents["a.1"]


def test_drain_limit_asks_the_operator_and_another_pending_node_asks_again() -> None:
    snap, now = two_tasks(nodes=4), T0  # 4 nodes: one drain per window
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), now))
    snap, out = step(
        snap, apply(snap, on_finding(snap, finding("f2", 2, "n4", E.ECC_ERROR), now + 1)), now + 1
    )
    assert kinds(out) == [("b.1", AlertKind.OPENED), ("b.1", AlertKind.NEEDS_OPERATOR)]
    needs = out[1]
    assert needs.operator_reason is OperatorReason.DRAIN_LIMIT
    assert needs.incident.pending_drain == "n4" and "drain limit" in needs.summary
    # decide never moves a waiting drain to another node today; if it does, ask again.
    moved = replace(snap.incidents["b.1"], pending_drain="n3", last_action_s=now + 2)
    snap, out = step(snap, snap.apply(incidents=[moved]), now + 2)
    assert [(a.kind, a.operator_reason) for a in out] == [
        (AlertKind.NEEDS_OPERATOR, OperatorReason.DRAIN_LIMIT)
    ]
    assert out[0].incident.pending_drain == "n3" and out[0].alert_id.endswith("/drain/n3")


def test_operator_confirmation_is_no_escalation() -> None:
    snap = two_tasks(nodes=4)
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0))
    snap = apply(snap, on_finding(snap, finding("f2", 2, "n4", E.ECC_ERROR), T0 + 1))
    snap, out = step(snap, apply(snap, on_operator_confirm_drain(snap, "b.1", T0 + 2)), T0 + 2)
    assert snap.incidents["b.1"].stage is L.REPLAN
    assert out == []


def test_breaker_stop_needs_the_operator() -> None:
    snap, now = two_tasks(Policy(no_progress_limit=1)), T0
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.OTHER_SOFTWARE_ERROR), now))
    now += SETTLE
    snap, out = step(snap, apply(snap, on_finding(snap, finding("f2", 1, "n2", E.ECC_ERROR), now)), now)
    assert snap.tasks["a"].state is TaskState.STOPPED
    assert [(a.kind, a.operator_reason) for a in out] == [(AlertKind.NEEDS_OPERATOR, OperatorReason.BREAKER)]
    assert "no-progress breaker" in out[0].summary


def test_stuck_incident_needs_the_operator() -> None:
    snap = two_tasks(Policy(max_process_restarts=0))
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0))
    snap = apply(snap, plan_transition(snap, plan({"a": 2, "b": 4}), render, T0))
    now = T0 + Policy().transition_timeout_s
    snap, out = step(snap, apply(snap, on_tick(snap, now)), now)
    assert [(a.kind, a.operator_reason) for a in out] == [(AlertKind.NEEDS_OPERATOR, OperatorReason.STUCK)]


def test_idle_node_incident_opens_and_closes_in_one_decision() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"])])
    f = finding("f9", None, "n4", E.ECC_ERROR, severity=Severity.SEV1)
    new = apply(snap, on_finding(snap, f, T0))
    out = alerts_for(snap, new, T0)
    (inc_id,) = new.incidents
    assert kinds(out) == [(inc_id, AlertKind.OPENED), (inc_id, AlertKind.CLOSED)]
    assert out[1].task_name is None and out[1].durations_s is not None


def test_alerts_are_deterministic() -> None:
    snap = two_tasks()
    new = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0))
    assert alerts_for(snap, new, T0) == alerts_for(snap, new, T0)


def test_milestones_and_spans_of_an_open_incident() -> None:
    t = (T0, T0 + 2, T0 + 5)
    inc = Incident(
        incident_id="a.1", task_id="a", node="n2", rank=0, status=E.ECC_ERROR, severity=Severity.SEV1,
        rule="r", evidence="e", opened_s=t[0], stage=L.REPLAN,
        timeline=(StageEntry(L.DETECTED, t[0]), StageEntry(L.ISOLATE, t[1]), StageEntry(L.REPLAN, t[2])),
    )  # fmt: skip
    m = incident_milestones(inc)
    assert m.since_detected() == {"classified": t[1] - t[0], "drained": t[2] - t[0]}
    now = t[2] + 7
    spans = stage_spans(inc, now)
    assert [(s.stage, s.duration_s, s.ongoing) for s in spans] == [
        (L.DETECTED, t[1] - t[0], False),
        (L.ISOLATE, t[2] - t[1], False),
        (L.REPLAN, now - t[2], True),
    ]


# --- config ------------------------------------------------------------------------------


def test_alerts_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="queue_max"):
        load_config(env={"UNICORN_ALERTS__QUEUE_MAX": "0"})
    with pytest.raises(ConfigError, match="webhook_url") as err:
        load_config(env={"UNICORN_ALERTS__WEBHOOK_URL": "ftp://x/secret"})
    assert "secret" not in str(err.value), "webhook paths carry secrets"
    cfg = load_config(env={"UNICORN_ALERTS__COMMAND": "/bin/notify,--to,ops"})
    assert cfg.alerts.command == ("/bin/notify", "--to", "ops")
    assert Config().alerts == AlertsConfig()


# --- delivery ------------------------------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with http_receiver() as rec:
        yield rec


def _alerts(n: int) -> list[Alert]:
    snap = world(4 + n, [task(f"t{i}", i + 1, [f"n{i + 1}"]) for i in range(n)])
    new = snap
    for i in range(n):
        new = apply(
            new, on_finding(new, finding(f"f{i}", i + 1, f"n{i + 1}", E.OTHER_SOFTWARE_ERROR), T0 + i)
        )
    out = alerts_for(snap, new, T0 + n)
    assert len(out) == n
    return out


def _capture_command(tmp_path: Path) -> tuple[str, ...]:
    """A real command that appends its stdin (one alert) as a line to a file."""
    script = "import sys; open(sys.argv[1], 'a').write(sys.stdin.read() + '\\n')"
    return (sys.executable, "-c", script, str(tmp_path / "alerts.jsonl"))


async def test_command_and_webhook_both_receive_the_alert(receiver: Receiver, tmp_path: Path) -> None:
    cfg = AlertsConfig(
        command=_capture_command(tmp_path),
        webhook_url=f"http://127.0.0.1:{receiver.port}/hook/tok",
        timeout_s=10,
    )
    sink = AlertSink(cfg)
    (alert,) = _alerts(1)
    sink.submit([alert])
    assert sink.pending == 1
    results = await sink.flush()
    assert [r.ok for r in results] == [True] and sink.delivered == 1 and sink.pending == 0
    assert receiver.bodies == [alert.to_json()] and receiver.paths == ["/hook/tok"]
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [alert.to_json()]


async def test_webhook_errors_are_typed_and_redacted(receiver: Receiver) -> None:
    receiver.status = 500
    sink = AlertSink(AlertsConfig(webhook_url=f"http://127.0.0.1:{receiver.port}/secret-token"))
    (alert,) = _alerts(1)
    result = await sink.deliver(alert)
    (err,) = result.errors
    assert isinstance(err, WebhookError) and err.exit_code == 500 and err.temporary
    assert "secret-token" not in str(err) and sink.failed == 1


async def test_webhook_timeout(receiver: Receiver) -> None:
    receiver.delay_s = 30
    timeout_s = 0.3
    sink = AlertSink(AlertsConfig(webhook_url=f"http://127.0.0.1:{receiver.port}/", timeout_s=timeout_s))
    (alert,) = _alerts(1)
    (err,) = (await sink.deliver(alert)).errors
    assert isinstance(err, WebhookError) and err.exit_code is None
    assert f"{timeout_s:g} s" in str(err)


async def test_webhook_refused() -> None:
    receiver_port = _closed_port()
    sink = AlertSink(AlertsConfig(webhook_url=f"http://127.0.0.1:{receiver_port}/"))
    (alert,) = _alerts(1)
    (err,) = (await sink.deliver(alert)).errors
    assert isinstance(err, WebhookError) and "refused" in str(err).lower()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("command", "error"),
    [
        (("false",), CommandFailed),
        (("sleep", "30"), CommandTimeout),
        (("/nonexistent/notify",), CommandNotFound),
        (("{not_executable}",), CommandFailed),  # PermissionError, still typed
    ],
)
async def test_command_errors_are_returned_not_raised(
    command: tuple[str, ...], error: type[Exception], tmp_path: Path
) -> None:
    plain = tmp_path / "notify"
    plain.write_text("#!/bin/sh\n")
    command = tuple(c.format(not_executable=plain) for c in command)
    sink = AlertSink(AlertsConfig(command=command, timeout_s=3.0))
    (alert,) = _alerts(1)
    result = await sink.deliver(alert)
    assert not result.ok and isinstance(result.errors[0], error), result.errors


async def test_queue_is_bounded_and_drops_the_oldest(tmp_path: Path) -> None:
    queue_max = 3
    sink = AlertSink(AlertsConfig(command=_capture_command(tmp_path), queue_max=queue_max))
    alerts = _alerts(queue_max + 2)
    sink.submit(alerts)
    assert sink.pending == queue_max and sink.dropped == len(alerts) - queue_max
    await sink.flush()
    got = [json.loads(line)["alert_id"] for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert got == [a.alert_id for a in alerts[-queue_max:]]


async def test_run_delivers_in_the_background_until_cancelled(receiver: Receiver) -> None:
    import asyncio

    sink = AlertSink(AlertsConfig(webhook_url=f"http://127.0.0.1:{receiver.port}/"))
    runner = asyncio.create_task(sink.run())
    alerts = _alerts(2)
    sink.submit(alerts)
    try:
        await until(lambda: sink.delivered >= len(alerts) or runner.done(), 30)
        assert not runner.done(), sink.delivered
    finally:
        runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert [b["alert_id"] for b in receiver.bodies] == [a.alert_id for a in alerts]


def test_disabled_sink_queues_nothing() -> None:
    sink = AlertSink(AlertsConfig())
    sink.submit(_alerts(1))
    assert not sink.enabled and sink.pending == 0 and sink.dropped == 0
