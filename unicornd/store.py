"""unicornd's state in Redis: the snapshot and the actions it still owes.

One JSON document (``keys.state()``) holds every task, node and incident record and the
plan generation; ``keys.actions_pending()`` lists the actions decided but not yet
executed. :meth:`Store.commit` writes both in one MULTI/EXEC, so after a crash the
snapshot and its owed actions always match. The executor marks an action done and pops
it in one transaction too (:meth:`Store.finish`), so an action is executed at most once
unless unicornd dies *during* it, in which case it is retried (actions are idempotent:
draining a drained node, sending a command with the same id, ...).

Closed incidents older than :data:`KEEP_CLOSED_S` are dropped from the snapshot (they
stay in the incidents stream).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final, cast

import redis.asyncio as aioredis

from unicorn_core import redis_io
from unicorn_core.errors import ProtocolError
from unicorn_core.keys import RedisKeys
from unicornd.actions import Action, Decision, action_from_dict, action_to_dict
from unicornd.state import Incident, NodeRecord, Policy, Snapshot, TaskRecord

KEEP_CLOSED_S: Final = 24 * 3600.0
SNAPSHOT_VERSION: Final = 1


def snapshot_to_json(snap: Snapshot) -> str:
    return json.dumps(
        {
            "v": SNAPSHOT_VERSION,
            "gpus_per_node": snap.gpus_per_node,
            "plan_generation": snap.plan_generation,
            "tasks": [t.to_dict() for t in snap.tasks.values()],
            "nodes": [n.to_dict() for n in snap.nodes.values()],
            "incidents": [i.to_dict() for i in snap.incidents.values()],
        },
        separators=(",", ":"),
    )


def snapshot_from_json(text: str | bytes, policy: Policy) -> Snapshot:
    """Raises ProtocolError when the document is not a snapshot this version wrote."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ProtocolError("malformed", f"state: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != SNAPSHOT_VERSION:
        raise ProtocolError("unknown_version", f"state: expected v={SNAPSHOT_VERSION}")
    tasks = [TaskRecord.from_dict(t) for t in doc.get("tasks", [])]
    nodes = [NodeRecord.from_dict(n) for n in doc.get("nodes", [])]
    incidents = [Incident.from_dict(i) for i in doc.get("incidents", [])]
    return Snapshot(
        tasks={t.task_id: t for t in tasks},
        nodes={n.name: n for n in nodes},
        gpus_per_node=int(doc["gpus_per_node"]),
        incidents={i.incident_id: i for i in incidents},
        plan_generation=int(doc.get("plan_generation", 0)),
        policy=policy,
    )


async def read_snapshot(
    client: aioredis.Redis, keys: RedisKeys, policy: Policy | None = None
) -> Snapshot | None:
    """The snapshot unicornd last committed under ``keys``; None when there is none (a reader's
    view: ``unicornctl``, the sbatch wrapper). Raises RedisCallError, or ProtocolError when
    the document is not a snapshot this version wrote."""
    raw = await redis_io.call(("GET", keys.state()), client.get(keys.state()))
    return None if raw is None else snapshot_from_json(raw, Policy())


def prune(snap: Snapshot, now_s: float) -> Snapshot:
    """Drop incidents closed more than :data:`KEEP_CLOSED_S` ago."""
    keep = {
        k: i
        for k, i in snap.incidents.items()
        if i.is_open or not i.timeline or now_s - i.timeline[-1].t_s < KEEP_CLOSED_S
    }
    if len(keep) == len(snap.incidents):
        return snap
    return Snapshot(snap.tasks, snap.nodes, snap.gpus_per_node, keep, snap.plan_generation, snap.policy)


class Store:
    """Reads and writes unicornd's state (see the module docstring)."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, policy: Policy) -> None:
        self.client = client
        self.keys = keys
        self.policy = policy

    async def load(self, gpus_per_node: int) -> Snapshot:
        """The persisted snapshot, or an empty one for a fresh installation."""
        raw = await redis_io.call(("GET", self.keys.state()), self.client.get(self.keys.state()))
        if raw is None:
            return Snapshot(tasks={}, nodes={}, gpus_per_node=gpus_per_node, policy=self.policy)
        return snapshot_from_json(cast(bytes, raw), self.policy)

    async def commit(self, snap: Snapshot, actions: Sequence[Action] = ()) -> None:
        """Persist ``snap`` and append ``actions`` to the owed list, atomically."""
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.state(), snapshot_to_json(snap))
        if actions:
            pipe.rpush(self.keys.actions_pending(), *(json.dumps(action_to_dict(a)) for a in actions))
        await redis_io.call(("MULTI", "SET", "RPUSH", self.keys.state()), pipe.execute())

    async def apply(self, snap: Snapshot, decision: Decision) -> Snapshot:
        """Persist ``decision`` on top of ``snap``; returns the new snapshot."""
        new = decision.applied_to(snap)
        await self.commit(new, decision.actions)
        return new

    async def next_action(self) -> tuple[Action | None, bool]:
        """(the first owed action, whether it already ran). (None, False) when none is owed."""
        raw = await redis_io.call(
            ("LINDEX", self.keys.actions_pending()), self.client.lindex(self.keys.actions_pending(), 0)
        )
        if raw is None:
            return None, False
        try:
            action = action_from_dict(json.loads(cast(bytes, raw)))
        except (ValueError, ProtocolError):
            await self._pop()
            raise
        done = await redis_io.call(
            ("SISMEMBER", self.keys.actions_done()),
            self.client.sismember(self.keys.actions_done(), action.action_id),
        )
        return action, bool(done)

    async def finish(self, action: Action) -> None:
        """Record ``action`` as executed and pop it, atomically."""
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(self.keys.actions_done(), action.action_id)
        pipe.lpop(self.keys.actions_pending())
        await redis_io.call(("MULTI", "SADD", "LPOP", self.keys.actions_done()), pipe.execute())

    async def _pop(self) -> None:
        await redis_io.call(
            ("LPOP", self.keys.actions_pending()), self.client.lpop(self.keys.actions_pending())
        )

    async def pending(self) -> list[dict[str, Any]]:
        raw = await redis_io.call(
            ("LRANGE", self.keys.actions_pending()), self.client.lrange(self.keys.actions_pending(), 0, -1)
        )
        return [json.loads(x) for x in cast(list[bytes], raw)]
