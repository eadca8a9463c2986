"""A daemon that runs for months keeps a day of ended tasks and closed incidents, not all of
them: the ticker's decision drops the rest (:meth:`Snapshot.expired`), and the commit
deletes them from Redis. Before, closed incidents were dropped only when unicornd started,
and ended tasks never: every decision and every goodput commit walked all of them."""

from __future__ import annotations

from dataclasses import replace

import redis.asyncio as aioredis

from detect.statuses import ErrorStatus, Severity
from tests.unicornd.coord_world import task, world
from tests.unicornd.redis_world import run
from unicorn_core.keys import RedisKeys
from unicornd import decide
from unicornd.state import (
    KEEP_CLOSED_S,
    KEEP_ENDED_S,
    Incident,
    LadderStage,
    Policy,
    Snapshot,
    StageEntry,
    TaskState,
)
from unicornd.store import Store, prune, read_snapshot

KEYS = RedisKeys("retentiontest")
T0 = 1_000_000.0
DAY = KEEP_ENDED_S


def incident(iid: str, task_id: str | None, node: str, *, closed_s: float | None) -> Incident:
    stage = LadderStage.CLOSED if closed_s is not None else LadderStage.RESTART_PROCESSES
    when = closed_s if closed_s is not None else T0
    return Incident(
        incident_id=iid, task_id=task_id, node=node, rank=0, status=ErrorStatus.LOST_CONNECTION,
        severity=Severity.SEV1, rule="heartbeat_timeout", evidence="silent", opened_s=T0 - 10,
        stage=stage, timeline=(StageEntry(stage, when),),
    )  # fmt: skip


def cluster() -> Snapshot:
    """Tasks ended at T0 in every way, one still running; incidents closed at T0."""
    ended: dict[str, object] = {"state": TaskState.FINISHED, "ended_s": T0}
    tasks = [
        task("done", 1, [], **ended),
        task("failed", 2, [], **{**ended, "state": TaskState.FAILED}),
        task("stopped", 3, [], state=TaskState.STOPPED, ended_s=T0),  # scancel, time limit
        task("old", 4, [], state=TaskState.FINISHED),  # written before ended_s existed
        task("open", 5, [], **{**ended, "state": TaskState.STOPPED}),  # stopped, waits for the operator
        task("live", 6, ["n1", "n2"]),
    ]
    return world(4, tasks).apply(
        incidents=[
            incident("done.1", "done", "n1", closed_s=T0),
            incident("open.1", "open", "n3", closed_s=None),
            incident("live.1", "live", "n1", closed_s=T0),
            incident("node.n4.x", None, "n4", closed_s=T0),
        ]
    )


def test_nothing_is_dropped_before_its_day_is_over() -> None:
    snap = cluster()
    assert snap.expired(T0 + min(KEEP_ENDED_S, KEEP_CLOSED_S) - 1) == ((), ())
    assert decide.on_tick(snap, T0 + min(KEEP_ENDED_S, KEEP_CLOSED_S) - 1).empty


def test_ended_tasks_go_with_their_incidents_and_closed_incidents_after_a_day() -> None:
    snap = cluster()
    tasks, incidents = snap.expired(T0 + DAY)
    assert tasks == ("done", "failed", "stopped")
    assert sorted(incidents) == ["done.1", "live.1", "node.n4.x"]
    after = decide.on_tick(snap, T0 + DAY).applied_to(snap)
    assert set(after.tasks) == {"old", "open", "live"}
    assert set(after.incidents) == {"open.1"}
    assert after.tasks["live"] is snap.tasks["live"] and after.nodes is snap.nodes
    assert prune(snap, T0 + DAY) == after  # the load's rule is the ticker's


def test_a_finished_or_stopped_task_records_when_it_ended() -> None:
    snap = world(4, [task("a", 7, ["n1", "n2"]), task("b", 8, ["n3", "n4"])])
    after = decide.on_task_finished(snap, "a", T0, ok=True).applied_to(snap)
    after = decide.on_task_stop(after, "b", T0 + 1, why="scancel").applied_to(after)
    assert after.tasks["a"].state is TaskState.FINISHED and after.tasks["a"].ended_s == T0
    assert after.tasks["b"].state is TaskState.STOPPED and after.tasks["b"].ended_s == T0 + 1
    later = decide.on_tick(after, T0 + 1 + DAY).applied_to(after)
    assert not later.tasks


def test_a_drop_is_committed_at_once_and_wins_over_an_earlier_upsert() -> None:
    """A decision that only drops records is no lazy progress commit (its note is logged and
    the followers see it), and a drop after an upsert of the same record in one decision
    leaves it dropped."""
    from unicornd.actions import Decision
    from unicornd.core import _progress_only

    snap = cluster()
    drop = decide.on_tick(snap, T0 + DAY)
    assert drop.drop_tasks and not _progress_only(snap, drop)
    upsert = Decision(tasks=(replace(snap.tasks["done"], weight=2.0),))
    assert "done" not in upsert.then(drop).applied_to(snap).tasks
    assert "done" in drop.then(upsert).applied_to(snap).tasks  # put back after the drop


def test_a_dropped_record_is_deleted_from_redis(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        store = Store(client, KEYS, Policy())
        snap = cluster()
        await store.commit(snap)
        decision = decide.on_tick(snap, T0 + DAY)
        after = decision.applied_to(snap)
        await store.commit(after)
        assert await client.hlen(KEYS.state_records("tasks")) == 3
        assert await client.hlen(KEYS.state_records("incidents")) == 1
        loaded = await read_snapshot(client, KEYS, Policy())
        assert loaded is not None and set(loaded.tasks) == set(after.tasks)
        assert set(loaded.incidents) == {"open.1"}
        # A record put back after the drop (a new task with a dropped one's id) is written again.
        again = after.apply(tasks=[replace(snap.tasks["done"], state=TaskState.PENDING, ended_s=None)])
        await store.commit(again)
        assert await client.hlen(KEYS.state_records("tasks")) == 4

    run(redis_url, body)
