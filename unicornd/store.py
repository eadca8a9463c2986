"""unicornd's state in Redis: the snapshot and the actions it still owes.

One JSON document (``keys.state()``) holds every task, node and incident record and the
plan generation; ``keys.actions_pending()`` lists the actions decided but not yet
executed. :meth:`Store.commit` writes both in one atomic script, so after a crash the
snapshot and its owed actions always match. An action's outcome is committed in the same
transaction that marks it done and removes it (``finished``), together with the decision
on that outcome, so an action is executed at most once unless unicornd dies *during* it,
in which case it is retried (actions are idempotent: draining a drained node, sending a
command with the same id, ...) and its outcome decided then.

Closed incidents older than :data:`KEEP_CLOSED_S` are dropped from the snapshot (they
stay in the incidents stream).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, cast

import redis.asyncio as aioredis

from unicorn_core import redis_io
from unicorn_core.config import RedisConfig
from unicorn_core.errors import ProtocolError, RedisCallError, UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import get_logger
from unicornd.actions import Action, action_from_dict, action_to_dict
from unicornd.state import Calibration, Incident, NodeRecord, Policy, Snapshot, TaskRecord

log = get_logger(__name__)

KEEP_CLOSED_S: Final = 24 * 3600.0
SNAPSHOT_VERSION: Final = 2
"""2: node records no longer name their task (a task's ``nodes`` is the one record of it),
tasks carry ``finished_nodes`` and ``requeue``. Version 1 documents are read and upgraded.
``calibration`` (the planner's measured inputs) is optional: a document without it (written
before it existed) reads as no measurement yet."""


def snapshot_to_json(snap: Snapshot) -> str:
    return json.dumps(
        {
            "v": SNAPSHOT_VERSION,
            "gpus_per_node": snap.gpus_per_node,
            "plan_generation": snap.plan_generation,
            "tasks": [t.to_dict() for t in snap.tasks.values()],
            "nodes": [n.to_dict() for n in snap.nodes.values()],
            "incidents": [i.to_dict() for i in snap.incidents.values()],
            "calibration": snap.calibration.to_dict(),
        },
        separators=(",", ":"),
    )


def _upgrade(doc: dict[str, Any]) -> dict[str, Any]:
    """A version-1 document as version 2: node records drop ``task_id``."""
    nodes = [
        {k: v for k, v in n.items() if k != "task_id"} if isinstance(n, dict) else n
        for n in doc.get("nodes", [])
    ]
    return {**doc, "v": 2, "nodes": nodes}


def snapshot_from_json(text: str | bytes, policy: Policy) -> Snapshot:
    """Raises ProtocolError when the document is not a snapshot this version wrote."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ProtocolError("malformed", f"state: {e}") from e
    if isinstance(doc, dict) and doc.get("v") == 1:
        doc = _upgrade(doc)
    if not isinstance(doc, dict) or doc.get("v") != SNAPSHOT_VERSION:
        raise ProtocolError("unknown_version", f"state: expected v={SNAPSHOT_VERSION}")
    tasks = [TaskRecord.from_dict(t) for t in doc.get("tasks", [])]
    nodes = [NodeRecord.from_dict(n) for n in doc.get("nodes", [])]
    incidents = [Incident.from_dict(i) for i in doc.get("incidents", [])]
    calibration = Calibration.from_dict(doc["calibration"]) if "calibration" in doc else Calibration()
    return Snapshot(
        tasks={t.task_id: t for t in tasks},
        nodes={n.name: n for n in nodes},
        gpus_per_node=int(doc["gpus_per_node"]),
        incidents={i.incident_id: i for i in incidents},
        plan_generation=int(doc.get("plan_generation", 0)),
        policy=policy,
        calibration=calibration,
    )


async def read_snapshot(client: aioredis.Redis, keys: RedisKeys, policy: Policy) -> Snapshot | None:
    """The snapshot unicornd last committed under ``keys``, with ``policy`` (pass the configured
    ``[recovery]`` section, so previews decide as unicornd does); None when there is none (a
    reader's view: ``unicornctl``, the sbatch wrapper). Raises RedisCallError, or
    ProtocolError when the document is not a snapshot this version wrote."""
    raw = await redis_io.call(("GET", keys.state()), client.get(keys.state()))
    return None if raw is None else snapshot_from_json(raw, policy)


def prune(snap: Snapshot, now_s: float) -> Snapshot:
    """Drop incidents closed more than :data:`KEEP_CLOSED_S` ago."""
    keep = {
        k: i
        for k, i in snap.incidents.items()
        if i.is_open or not i.timeline or now_s - i.timeline[-1].t_s < KEEP_CLOSED_S
    }
    if len(keep) == len(snap.incidents):
        return snap
    return replace(snap, incidents=keep)


@dataclass(frozen=True)
class Owed:
    """One owed action as stored (``raw``: its exact list entry, removed by value)."""

    raw: str
    action: Action


_COMMIT: Final = """
local token = tonumber(ARGV[1])
if token > 0 then
  if tonumber(redis.call('GET', KEYS[4]) or '0') ~= token then
    return redis.error_reply('FENCED token ' .. ARGV[1] .. ', fence ' .. tostring(redis.call('GET', KEYS[4])))
  end
  local held = redis.call('GET', KEYS[5])
  if held and held ~= ARGV[2] then
    return redis.error_reply('FENCED lease held by ' .. held .. ', not ' .. ARGV[2])
  end
  redis.call('HINCRBY', KEYS[6], ARGV[1], 1)
end
redis.call('SET', KEYS[1], ARGV[3])
local i = 4
local n = tonumber(ARGV[i])
for j = 1, n do redis.call('LREM', KEYS[2], 1, ARGV[i + j]) end
i = i + n + 1
n = tonumber(ARGV[i])
for j = 1, n do redis.call('RPUSH', KEYS[2], ARGV[i + j]) end
i = i + n + 1
if ARGV[i] ~= '' then
  redis.call('SADD', KEYS[3], ARGV[i + 1])
  redis.call('LREM', KEYS[2], 1, ARGV[i])
end
return 1
"""
"""One commit, atomically. KEYS: state, owed list, done set, fence, lease, commits per
token (counted for each accepted commit made under a token). ARGV: token
(0: no election), the lease holder ``token:id``, snapshot, the voided entries (count
first), the new entries (count first), the finished entry and its id ("" ""). Refused,
changing nothing, when a token is given and the fence has moved past it (another unicornd
took the lease), or when the lease names another holder: after a Sentinel failover that
lost an unreplicated INCR of the fence, a second leader can be handed the same token, and
only the lease's holder tells the two apart."""


@dataclass(frozen=True)
class CommitCost:
    """What one accepted commit cost: the snapshot document's size, the time to serialise
    it, and the whole commit (serialisation, the script and its Redis round trip, the
    replication wait) in seconds."""

    snapshot_bytes: int
    serialise_s: float
    total_s: float


class Fenced(UnicornError):
    """A commit was refused: the fence has moved past this unicornd's token."""


class Store:
    """Reads and writes unicornd's state (see the module docstring).

    ``token``: this unicornd's fencing token (:mod:`unicornd.leader`); 0 when no election
    guards the commits (tests, tools)."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        policy: Policy,
        *,
        token: int = 0,
        holder: str = "",
        replication: RedisConfig | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.policy = policy
        self.token = token
        self.holder = holder
        """The lease value ``token:id`` this unicornd holds (set with ``token``)."""
        self.replication = replication or RedisConfig()
        self.commits = 0
        self.on_commit: Callable[[CommitCost], None] | None = None
        """Called after each accepted commit with its :class:`CommitCost` (for measurements:
        ``scripts/bench/scale.py``); must not raise or block."""
        self.unreplicated = 0
        """Commits the primary acknowledged but ``wait_replicas`` replicas did not within
        ``wait_timeout_ms`` (a failover in that window would lose them: see ARCHITECTURE)."""

    async def load(self, gpus_per_node: int) -> Snapshot:
        """The persisted snapshot, or an empty one for a fresh installation."""
        raw = await redis_io.call(("GET", self.keys.state()), self.client.get(self.keys.state()))
        if raw is None:
            return Snapshot(tasks={}, nodes={}, gpus_per_node=gpus_per_node, policy=self.policy)
        return snapshot_from_json(cast(bytes, raw), self.policy)

    async def commit(
        self,
        snap: Snapshot,
        actions: Sequence[Action] = (),
        *,
        cancels: Sequence[str] = (),
        finished: Owed | None = None,
    ) -> list[Action]:
        """Persist ``snap``, void the owed actions whose id starts with one of ``cancels``,
        append ``actions`` to the owed list and, with ``finished``, record that action as
        done and remove it: all in one Lua script (atomic, as MULTI/EXEC), which refuses
        with :class:`Fenced`, changing nothing, when another unicornd took the lease.
        Returns the voided actions.

        Only the leading unicornd writes these keys, one commit at a time, so reading the owed list
        before the transaction (for the cancellations) is safe.
        """
        voided: list[Owed] = []
        if cancels:
            voided = [
                o
                for o in await self.owed()
                if o.action.action_id.startswith(tuple(cancels))
                and (finished is None or o.raw != finished.raw)
            ]
        k = self.keys
        started = time.perf_counter()
        document = snapshot_to_json(snap)
        serialised = time.perf_counter()
        args: list[str | int] = [
            self.token,
            self.holder,
            document,
            len(voided),
            *(o.raw for o in voided),
        ]
        args += [len(actions), *(json.dumps(action_to_dict(a)) for a in actions)]
        args += [finished.raw, finished.action.action_id] if finished is not None else ["", ""]
        try:
            _, replicated = await redis_io.eval_replicated(
                self.client,
                self.replication,
                ("EVAL", "commit", k.state()),
                _COMMIT,
                6,
                k.state(),
                k.actions_pending(),
                k.actions_done(),
                k.fence(),
                k.leader(),
                k.commits(),
                *args,
            )
        except RedisCallError as e:
            if "FENCED" in str(e):
                raise Fenced(f"commit refused: {e}; another unicornd leads") from e
            raise
        self.commits += 1
        if self.on_commit is not None:
            # json.dumps escapes every non-ASCII character: its length is the byte count.
            self.on_commit(CommitCost(len(document), serialised - started, time.perf_counter() - started))
        if not replicated:
            self.unreplicated += 1
            log.warning(
                "commit_not_replicated",
                replicas=self.replication.wait_replicas,
                timeout_ms=self.replication.wait_timeout_ms,
                unreplicated=self.unreplicated,
            )
        return [o.action for o in voided]

    async def owed(self) -> list[Owed]:
        """Every owed action in commit order. An entry that no longer decodes (written by
        another version) is removed and logged: it can never run."""
        raw = await redis_io.call(
            ("LRANGE", self.keys.actions_pending()), self.client.lrange(self.keys.actions_pending(), 0, -1)
        )
        out: list[Owed] = []
        for item in cast(list[bytes], raw):
            try:
                out.append(Owed(item.decode(), action_from_dict(json.loads(item))))
            except (ValueError, ProtocolError) as e:
                log.error("owed_action_unreadable", entry=item[:200].decode(errors="replace"), error=str(e))
                await redis_io.call(
                    ("LREM", self.keys.actions_pending()),
                    self.client.lrem(self.keys.actions_pending(), 1, item),  # type: ignore[arg-type]  # bytes: the exact entry
                )
        return out

    async def done(self, action_id: str) -> bool:
        """The action already ran (it was owed when unicornd died after finishing it)."""
        return bool(
            await redis_io.call(
                ("SISMEMBER", self.keys.actions_done()),
                self.client.sismember(self.keys.actions_done(), action_id),
            )
        )
