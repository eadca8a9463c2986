"""``unicornctl incidents`` and ``unicornctl tasks``: rendering, and the commands against a
real redis-server (started here on a free port), including Redis down and no state."""

from __future__ import annotations

import json

import redis
from click.testing import CliRunner

from detect.statuses import ErrorStatus
from tests.conftest import free_port
from tests.unicornd.coord_world import apply, finding, plan, render, task, world
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import reset_logging
from unicornd.cli import (
    EXIT_NO_STATE,
    EXIT_STATE_UNREADABLE,
    cli,
    incidents_json,
    render_incidents,
    render_tasks,
    task_json,
)
from unicornd.decide import on_finding, on_progress
from unicornd.replan import plan_transition
from unicornd.state import LadderStage, Snapshot, TaskState
from unicornd.store import snapshot_to_json

E = ErrorStatus
L = LadderStage
T0 = 1_700_000_000.0
PLANNED_S, RESUMED_S = 3.0, 40.0


def scenario() -> Snapshot:
    """a.1: ECC error on n2, drained, replanned at +3 s, resumed at +40 s; b.1: a hang, open."""
    snap = world(8, [task("a", 1, ["n1", "n2"], weight=2.0), task("b", 2, ["n3", "n4"])])
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0))
    snap = apply(snap, plan_transition(snap, plan({"a": 2, "b": 4}), render, T0 + PLANNED_S))
    snap = apply(snap, on_progress(snap, "a", 11, T0 + RESUMED_S))
    return apply(snap, on_finding(snap, finding("f2", 2, "n3", E.TASK_HANG), T0 + 50))


# --- pure rendering ----------------------------------------------------------------------


def test_incidents_json_has_the_timeline_with_durations() -> None:
    snap = scenario()
    now = T0 + 60
    docs = incidents_json(snap, include_closed=True, now_s=now)
    assert [d["incident_id"] for d in docs] == ["a.1", "b.1"]
    a1 = docs[0]
    assert a1["milestones_s"] == {
        "classified": 0.0,
        "drained": 0.0,
        "replanned": PLANNED_S,
        "resumed": RESUMED_S,
        "closed": RESUMED_S,
    }
    assert [e["stage"] for e in a1["timeline"]] == [s.stage.value for s in snap.incidents["a.1"].timeline]
    transition = next(e for e in a1["timeline"] if e["stage"] == "transition")
    assert transition["duration_s"] == RESUMED_S - PLANNED_S
    assert a1["duration_s"] == RESUMED_S and not a1["open"]
    b1 = docs[1]
    assert b1["open"] and b1["timeline"][-1]["ongoing"]
    assert b1["duration_s"] == now - snap.incidents["b.1"].opened_s
    assert json.loads(json.dumps(docs)) == docs
    assert [d["incident_id"] for d in incidents_json(snap, include_closed=False, now_s=now)] == ["b.1"]


def test_render_incidents_shows_milestones_and_hints_at_closed_ones() -> None:
    snap = scenario()
    text = render_incidents(snap, include_closed=True, now_s=T0 + 60)
    assert f"replanned +{PLANNED_S:.1f} s" in text and f"resumed +{RESUMED_S:.1f} s" in text
    assert "a.1  closed  ecc_error" in text and "b.1  open  task_hang" in text
    only_closed = Snapshot(snap.tasks, snap.nodes, snap.gpus_per_node, {"a.1": snap.incidents["a.1"]})
    assert render_incidents(only_closed, include_closed=False, now_s=T0 + 60).startswith(
        "no open incidents; 1 closed"
    )


def test_tasks_render() -> None:
    snap = scenario()
    docs = {t: task_json(snap.tasks[t], snap) for t in snap.tasks}
    assert docs["a"]["state"] == TaskState.RUNNING.value and docs["a"]["open_incident"] is None
    assert docs["b"]["open_incident"] == {
        "incident_id": "b.1",
        "stage": snap.incidents["b.1"].stage.value,
        "status": E.TASK_HANG.value,
    }
    lines = render_tasks(snap).splitlines()
    assert lines[0].split()[:3] == ["TASK", "JOB", "STATE"]
    assert len(lines) == 1 + len(snap.tasks)
    assert "b.1 (" in lines[2]
    assert render_tasks(Snapshot(tasks={}, nodes={}, gpus_per_node=1)) == "no tasks"


# --- the commands against a real Redis ---------------------------------------------------------


PREFIX = "clitest"


def run(url: str, *args: str) -> tuple[int, str, str]:
    env = {"UNICORN_REDIS__URL": url, "UNICORN_REDIS__KEY_PREFIX": PREFIX, "UNICORN_CONFIG": ""}
    result = CliRunner().invoke(cli, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_commands_read_the_snapshot_from_redis(redis_url: str) -> None:
    snap = scenario()
    redis.Redis.from_url(redis_url).set(RedisKeys(PREFIX).state(), snapshot_to_json(snap))
    code, out, _ = run(redis_url, "incidents", "--json", "--all")
    assert code == 0
    assert [d["incident_id"] for d in json.loads(out)] == ["a.1", "b.1"]
    code, out, _ = run(redis_url, "incidents")
    assert code == 0 and "b.1  open" in out and "a.1" not in out
    code, out, _ = run(redis_url, "tasks", "--json")
    assert code == 0 and [t["task_id"] for t in json.loads(out)] == sorted(snap.tasks)
    code, out, _ = run(redis_url, "tasks")
    assert code == 0 and out.splitlines()[0].startswith("TASK")


def test_no_state_in_redis_is_a_clear_error(redis_url: str) -> None:
    for command in ("incidents", "tasks"):
        code, _, err = run(redis_url, command)
        assert code == EXIT_NO_STATE
        assert "no unicornd state" in err and PREFIX in err


def test_unreadable_state_is_a_clear_error(redis_url: str) -> None:
    redis.Redis.from_url(redis_url).set(RedisKeys(PREFIX).state(), b"not json")
    code, _, err = run(redis_url, "tasks")
    assert code == EXIT_STATE_UNREADABLE and "cannot read unicornd's state" in err


def test_redis_unreachable_is_a_clear_error() -> None:
    try:
        code, _, err = run(f"redis://127.0.0.1:{free_port()}/0", "incidents", "--json")
    finally:
        reset_logging()
    assert code == EXIT_STATE_UNREADABLE
    assert "cannot read unicornd's state" in err and "Connection" in err
