"""unicornd's state in Redis as records in hashes: a commit writes only what a decision
changed, the state read back equals the snapshot committed (its records in the same order),
and the version-2 document is read and replaced."""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from detect.statuses import ErrorStatus, Severity
from tests.unicornd.coord_world import task, world
from tests.unicornd.redis_world import run, stored
from unicorn_core.errors import ProtocolError
from unicorn_core.keys import RedisKeys
from unicornd.state import Incident, NodeHealth, NodeRecord, PlanBasis, Policy, Snapshot
from unicornd.store import (
    KINDS,
    CommitCost,
    Store,
    read_snapshot,
    snapshot_from_json,
    snapshot_to_json,
    state_delta,
)

KEYS = RedisKeys("deltatest")


def incident(iid: str, node: str) -> Incident:
    return Incident(
        incident_id=iid, task_id="a", node=node, rank=0, status=ErrorStatus.LOST_CONNECTION,
        severity=Severity.SEV1, rule="heartbeat_timeout", evidence="silent", opened_s=100.0,
    )  # fmt: skip


def big() -> Snapshot:
    return world(64, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3"])])


def test_a_commit_writes_only_the_records_a_decision_changed() -> None:
    snap = big()
    first, written = state_delta(None, snap)
    assert first.meta is not None and all(first.reset.values())
    assert len(first.sets["nodes"]) == 64 and len(first.sets["tasks"]) == 2
    after = snap.apply(nodes=[replace(snap.nodes["n5"], health=NodeHealth.DRAINED)])
    delta, _ = state_delta(written, after)
    assert delta.meta is None and not any(delta.reset.values())
    assert list(delta.sets["nodes"]) == ["n5"] and not delta.sets["tasks"] and not delta.sets["incidents"]
    assert delta.size < first.size / 30
    equal_but_new = snap.apply(nodes=[NodeRecord("n7")])  # an equal record, another object
    assert state_delta(written, equal_but_new)[0].size == 0


def test_reordered_records_rewrite_their_hash() -> None:
    snap = big()
    _, written = state_delta(None, snap)
    reordered = replace(snap, tasks={"b": snap.tasks["b"], "a": snap.tasks["a"]})
    delta, _ = state_delta(written, reordered)
    assert delta.reset == {"tasks": True, "nodes": False, "incidents": False}
    assert list(delta.sets["tasks"]) == ["b", "a"]


def test_the_state_read_back_is_the_state_committed_in_its_order(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        costs: list[CommitCost] = []
        store = Store(client, KEYS, Policy())
        store.on_commit = costs.append
        snap = big().apply(incidents=[incident("a.1", "n1"), incident("a.2", "n2"), incident("a.3", "n1")])
        await store.commit(snap)
        assert await stored(client, KEYS) == snapshot_to_json(snap)
        # Drop an incident in the middle, change a node, add a task and an incident.
        gone = replace(snap, incidents={k: v for k, v in snap.incidents.items() if k != "a.2"})
        moved = gone.apply(
            tasks=[task("c", 3, ["n9"])],
            nodes=[replace(snap.nodes["n4"], held=True)],
            incidents=[incident("a.4", "n9")],
            plan_generation=5,
        )
        await store.commit(moved)
        assert await stored(client, KEYS) == snapshot_to_json(moved)
        assert costs[1].state_bytes < costs[0].state_bytes / 5  # 4 records and the meta of 69
        assert await client.hlen(KEYS.state_records("incidents")) == 3
        # A new leader loads it, then commits a new record: it goes after the others.
        again = Store(client, KEYS, Policy())
        loaded = await again.load(8)
        assert snapshot_to_json(loaded) == snapshot_to_json(moved)
        later = loaded.apply(incidents=[incident("a.5", "n9")])
        await again.commit(later)
        assert await stored(client, KEYS) == snapshot_to_json(later)
        assert list((await read_snapshot(client, KEYS, Policy()) or later).incidents) == [
            "a.1", "a.3", "a.4", "a.5"
        ]  # fmt: skip

    run(redis_url, body)


def test_the_version_2_document_is_read_then_replaced(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        snap = big()
        await client.set(KEYS.state(), snapshot_to_json(snap))
        assert await stored(client, KEYS) == snapshot_to_json(snap)
        store = Store(client, KEYS, Policy())
        loaded = await store.load(8)
        assert loaded == snap
        await store.commit(loaded.apply(plan_generation=2))
        assert not await client.exists(KEYS.state())
        assert await stored(client, KEYS) == snapshot_to_json(snap.apply(plan_generation=2))

    run(redis_url, body)


def test_after_a_failed_commit_the_next_writes_everything(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        store = Store(client, KEYS, Policy())
        snap = big()
        await store.commit(snap)
        await client.delete(*(KEYS.state_records(k) for k in KINDS))  # what a lost write would leave
        await client.set(KEYS.state_records("tasks"), b"not a hash")  # the script fails: WRONGTYPE
        with pytest.raises(Exception, match="WRONGTYPE"):
            await store.commit(snap.apply(tasks=[replace(snap.tasks["a"], last_iteration=11)]))
        await client.delete(KEYS.state_records("tasks"))
        await store.commit(snap.apply(plan_generation=4))
        assert await stored(client, KEYS) == snapshot_to_json(snap.apply(plan_generation=4))

    run(redis_url, body)


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b"[]",
        b'{"r": {"name": "n1"}}',
        b'{"o": 0, "r": {"name": "n2"}}',
        b'{"o": 0, "r": {"x": 1}}',
    ],
)
def test_a_record_that_does_not_decode_is_refused(redis_url: str, value: bytes) -> None:
    async def body(client: aioredis.Redis) -> None:
        await Store(client, KEYS, Policy()).commit(big())
        await client.hset(KEYS.state_records("nodes"), "n1", value)
        with pytest.raises(ProtocolError):
            await read_snapshot(client, KEYS, Policy())

    run(redis_url, body)


def test_the_plan_basis_round_trips_and_a_new_one_rewrites_only_the_meta(redis_url: str) -> None:
    async def body(client: aioredis.Redis) -> None:
        costs: list[CommitCost] = []
        store = Store(client, KEYS, Policy())
        store.on_commit = costs.append
        snap = big()
        based = snap.apply(plan_basis=PlanBasis(replace(snap.calibration, node_failures=3), 123.0))
        await store.commit(snap)
        await store.commit(based)
        back = await read_snapshot(client, KEYS, Policy())
        assert back is not None and back.plan_basis == based.plan_basis
        assert costs[1].state_bytes < 400, "only the meta document"
        assert snapshot_from_json(snapshot_to_json(based), Policy()).plan_basis == based.plan_basis

    run(redis_url, body)
