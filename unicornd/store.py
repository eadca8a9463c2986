"""unicornd's state in Redis: the snapshot and the actions it still owes.

The snapshot lives in four keys: ``keys.state_meta()`` (version, GPUs per node, plan
generation, calibration) and one hash per kind of record (``keys.state_records``: tasks,
nodes, incidents; key -> JSON). ``keys.actions_pending()`` lists the actions decided but
not yet executed. :meth:`Store.commit` writes the records a decision changed (its
:class:`StateDelta`, not the whole snapshot: a commit costs what the decision touched, not
the cluster's size) and the owed actions in one atomic script, so after a crash the
snapshot and its owed actions always match. An action's outcome is committed in the same
transaction that marks it done and removes it (``finished``), together with the decision
on that outcome, so an action is executed at most once unless unicornd dies *during* it,
in which case it is retried (actions are idempotent: draining a drained node, sending a
command with the same id, ...) and its outcome decided then.

Each stored record carries its position (``{"o": n, "r": record}``), so a snapshot read
back iterates its records in the order the writer's did (decisions that walk the records
decide the same after a restart). The version-2 form, one JSON document in
``keys.state()`` (:func:`snapshot_to_json`), is still read; the first commit replaces it.

Closed incidents older than :data:`~unicornd.state.KEEP_CLOSED_S`, and tasks ended longer ago than
:data:`~unicornd.state.KEEP_ENDED_S`, are dropped from the snapshot (:func:`prune` at load,
the ticker's decision while running: :func:`unicornd.decide.ladder.on_tick`); they stay in
the incidents stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import msgspec
import redis.asyncio as aioredis

from unicorn_core import redis_io
from unicorn_core.config import RedisConfig
from unicorn_core.errors import ProtocolError, RedisCallError, UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import get_logger
from unicornd.actions import Action, action_from_dict, action_to_dict
from unicornd.state import Calibration, Incident, NodeRecord, PlanBasis, Policy, Snapshot, TaskRecord

log = get_logger(__name__)

SNAPSHOT_VERSION: Final = 2
"""2: node records no longer name their task (a task's ``nodes`` is the one record of it),
tasks carry ``finished_nodes`` and ``requeue``. Version 1 documents are read and upgraded.
``calibration`` (the planner's measured inputs) is optional: a document without it (written
before it existed) reads as no measurement yet."""


STATE_VERSION: Final = 3
"""3: the snapshot's records in hashes (:meth:`RedisKeys.state_records`), its scalars in
:meth:`RedisKeys.state_meta`."""
KINDS: Final = ("tasks", "nodes", "incidents")


def snapshot_to_json(snap: Snapshot) -> str:
    """The version-2 document: every record in one JSON object (what ``keys.state()``
    held before version 3; tools and tests still write it, :func:`read_snapshot` reads it)."""
    return msgspec.json.encode(
        {
            "v": SNAPSHOT_VERSION,
            "gpus_per_node": snap.gpus_per_node,
            "plan_generation": snap.plan_generation,
            "tasks": list(snap.tasks.values()),
            "nodes": list(snap.nodes.values()),
            "incidents": list(snap.incidents.values()),
            "calibration": snap.calibration,
            "plan_basis": snap.plan_basis,
        }
    ).decode()


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
    return _snapshot_of(doc, tasks, nodes, incidents, policy)


def _snapshot_of(
    doc: Mapping[str, Any],
    tasks: Sequence[TaskRecord],
    nodes: Sequence[NodeRecord],
    incidents: Sequence[Incident],
    policy: Policy,
) -> Snapshot:
    """The snapshot of these records and ``doc``'s scalars (either form's: a document
    without ``calibration``, written before it existed, reads as nothing measured)."""
    basis = doc.get("plan_basis")
    return Snapshot(
        tasks={t.task_id: t for t in tasks},
        nodes={n.name: n for n in nodes},
        gpus_per_node=int(doc["gpus_per_node"]),
        incidents={i.incident_id: i for i in incidents},
        plan_generation=int(doc.get("plan_generation", 0)),
        policy=policy,
        calibration=Calibration.from_dict(doc.get("calibration", {})),
        plan_basis=PlanBasis.from_dict(basis) if basis is not None else None,
    )


def _meta_json(snap: Snapshot) -> bytes:
    return msgspec.json.encode(
        {
            "v": STATE_VERSION,
            "gpus_per_node": snap.gpus_per_node,
            "plan_generation": snap.plan_generation,
            "calibration": snap.calibration,
            "plan_basis": snap.plan_basis,
        }
    )


def _records(snap: Snapshot, kind: str) -> Mapping[str, object]:
    return cast(Mapping[str, object], getattr(snap, kind))


@dataclass(frozen=True)
class StateDelta:
    """What one commit writes: per kind, whether the hash is written afresh (``reset``),
    the records to set (key -> stored JSON) and the keys to delete; and the meta document
    (None: unchanged)."""

    meta: bytes | None
    reset: dict[str, bool]
    sets: dict[str, dict[str, bytes]]
    deletes: dict[str, list[str]]

    @property
    def size(self) -> int:
        """Bytes of state written (meta and records, keys included)."""
        meta = len(self.meta) if self.meta is not None else 0
        sets = sum(len(k) + len(v) for kind in KINDS for k, v in self.sets[kind].items())
        return meta + sets + sum(len(k) for kind in KINDS for k in self.deletes[kind])


@dataclass
class Written:
    """The state as last committed: the snapshot and each record's stored position."""

    snapshot: Snapshot
    positions: dict[str, dict[str, int]] = field(default_factory=dict)
    next_position: dict[str, int] = field(default_factory=dict)


def _kept_order(before: Mapping[str, object], after: Mapping[str, object]) -> bool:
    """The records in both appear in the same order in both (new ones only appended)."""
    return [k for k in after if k in before] == [k for k in before if k in after]


def state_delta(written: Written | None, after: Snapshot) -> tuple[StateDelta, Written]:
    """What to write so the stored state becomes ``after`` (all of it when nothing is
    known to be written), and the new :class:`Written`. Records are frozen and a decision
    replaces only those it changes, so an unchanged record is the same object: the scan is
    an identity test per record, and only changed records are encoded."""
    meta_changed = (
        written is None
        or written.snapshot.gpus_per_node != after.gpus_per_node
        or written.snapshot.plan_generation != after.plan_generation
        or (
            written.snapshot.calibration is not after.calibration
            and written.snapshot.calibration != after.calibration
        )
        or (
            written.snapshot.plan_basis is not after.plan_basis
            and written.snapshot.plan_basis != after.plan_basis
        )
    )
    new = Written(after)
    reset: dict[str, bool] = {}
    sets: dict[str, dict[str, bytes]] = {}
    deletes: dict[str, list[str]] = {}
    for kind in KINDS:
        now = _records(after, kind)
        if written is not None and _records(written.snapshot, kind) is now:
            # The same mapping: nothing in it changed.
            reset[kind], sets[kind], deletes[kind] = False, {}, []
            new.positions[kind] = written.positions[kind]
            new.next_position[kind] = written.next_position[kind]
            continue
        old = _records(written.snapshot, kind) if written is not None else {}
        # What is written of this kind, when its order holds (else the hash is written afresh).
        kept = written if written is not None and _kept_order(old, now) else None
        positions = dict(kept.positions[kind]) if kept is not None else {}
        nxt = kept.next_position[kind] if kept is not None else 0
        gone = [key for key in old if key not in now] if kept is not None else []
        for key in gone:
            del positions[key]
        changed: dict[str, bytes] = {}
        for key, record in now.items():
            before = old.get(key) if kept is not None else None
            if before is not None and (before is record or before == record):
                continue
            pos = positions.get(key)
            if pos is None:
                pos = positions[key] = nxt
                nxt += 1
            changed[key] = b'{"o":%d,"r":%s}' % (pos, msgspec.json.encode(record))
        reset[kind], sets[kind], deletes[kind] = kept is None, changed, gone
        new.positions[kind], new.next_position[kind] = positions, nxt
    return StateDelta(_meta_json(after) if meta_changed else None, reset, sets, deletes), new


def _stored(kind: str, raw: Mapping[bytes, bytes]) -> list[tuple[int, object]]:
    """A hash's records with their stored positions, in order. Raises ProtocolError."""
    cls: type[TaskRecord | NodeRecord | Incident] = {
        "tasks": TaskRecord,
        "nodes": NodeRecord,
        "incidents": Incident,
    }[kind]
    out: list[tuple[int, object]] = []
    for key, value in raw.items():
        try:
            doc = msgspec.json.decode(value)
        except msgspec.DecodeError as e:
            raise ProtocolError("malformed", f"state {kind} {key!r}: {e}") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("o"), int) or "r" not in doc:
            raise ProtocolError("invalid", f'state {kind} {key!r}: expected {{"o": n, "r": record}}')
        record = cls.from_dict(doc["r"])
        name = (
            record.task_id
            if isinstance(record, TaskRecord)
            else record.name
            if isinstance(record, NodeRecord)
            else record.incident_id
        )
        if name.encode() != key:
            raise ProtocolError("invalid", f"state {kind} {key!r} holds {name!r}")
        out.append((doc["o"], record))
    out.sort(key=lambda p: p[0])
    return out


def snapshot_from_state(
    meta: bytes, hashes: Mapping[str, Mapping[bytes, bytes]], policy: Policy
) -> tuple[Snapshot, Written]:
    """The version-3 state read back, and what it says is written (positions kept, so the
    next commit writes only what changes). Raises ProtocolError."""
    try:
        doc = msgspec.json.decode(meta)
    except msgspec.DecodeError as e:
        raise ProtocolError("malformed", f"state meta: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != STATE_VERSION:
        raise ProtocolError("unknown_version", f"state meta: expected v={STATE_VERSION}")
    stored = {kind: _stored(kind, hashes[kind]) for kind in KINDS}
    tasks = [cast(TaskRecord, r) for _, r in stored["tasks"]]
    nodes = [cast(NodeRecord, r) for _, r in stored["nodes"]]
    incidents = [cast(Incident, r) for _, r in stored["incidents"]]
    try:
        snap = _snapshot_of(doc, tasks, nodes, incidents, policy)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError("invalid", f"state meta: {e}") from e
    written = Written(snap)
    for kind in KINDS:
        names = list(_records(snap, kind))
        written.positions[kind] = {name: pos for name, (pos, _) in zip(names, stored[kind], strict=True)}
        written.next_position[kind] = max((pos for pos, _ in stored[kind]), default=-1) + 1
    return snap, written


def state_reads(keys: RedisKeys) -> list[tuple[str, str]]:
    """The reads of a snapshot, to run in one MULTI/EXEC: (command, key) in the order
    :func:`decode_state` takes their replies."""
    return [
        ("GET", keys.state_meta()),
        *(("HGETALL", keys.state_records(kind)) for kind in KINDS),
        ("GET", keys.state()),
    ]


def decode_state(replies: Sequence[object], policy: Policy) -> tuple[Snapshot, Written | None] | None:
    """The snapshot from the replies of :func:`state_reads`, with what is written when it
    is in the version-3 form (None for the version-2 document); None when there is none.
    Raises ProtocolError."""
    meta, *hashes, legacy = replies
    if meta is not None:
        records = dict(zip(KINDS, cast(list[dict[bytes, bytes]], hashes), strict=True))
        return snapshot_from_state(cast(bytes, meta), records, policy)
    if legacy is not None:
        return snapshot_from_json(cast(bytes, legacy), policy), None
    return None


async def read_state(
    client: aioredis.Redis, keys: RedisKeys, policy: Policy
) -> tuple[Snapshot, Written | None] | None:
    """:func:`decode_state` of the committed state, read in one transaction (a consistent
    view). Raises RedisCallError, or ProtocolError when it does not decode."""
    pipe = client.pipeline(transaction=True)
    for command, key in state_reads(keys):
        pipe.execute_command(command, key)
    replies = await redis_io.call(("MULTI", keys.state_meta(), "HGETALL"), pipe.execute())
    return decode_state(replies, policy)


async def read_snapshot(client: aioredis.Redis, keys: RedisKeys, policy: Policy) -> Snapshot | None:
    """The snapshot unicornd last committed under ``keys``, with ``policy`` (pass the configured
    ``[recovery]`` section, so previews decide as unicornd does); None when there is none (a
    reader's view: ``unicornctl``, the sbatch wrapper). Raises RedisCallError, or
    ProtocolError when the state is not one this version wrote."""
    found = await read_state(client, keys, policy)
    return None if found is None else found[0]


def prune(snap: Snapshot, now_s: float) -> Snapshot:
    """Drop what :meth:`Snapshot.expired` says has had its time (closed incidents, ended tasks)."""
    tasks, incidents = snap.expired(now_s)
    if not tasks and not incidents:
        return snap
    return snap.apply(drop_tasks=tasks, drop_incidents=incidents)


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
redis.call('DEL', KEYS[1])
if ARGV[3] ~= '' then redis.call('SET', KEYS[7], ARGV[3]) end
local i = 4
for h = 8, 10 do
  if ARGV[i] == '1' then redis.call('DEL', KEYS[h]) end
  local n = tonumber(ARGV[i + 1])
  i = i + 2
  for j = 1, n do
    redis.call('HSET', KEYS[h], ARGV[i], ARGV[i + 1])
    i = i + 2
  end
  n = tonumber(ARGV[i])
  i = i + 1
  for j = 1, n do
    redis.call('HDEL', KEYS[h], ARGV[i])
    i = i + 1
  end
end
local n = tonumber(ARGV[i])
for j = 1, n do redis.call('LREM', KEYS[2], 1, ARGV[i + j]) end
i = i + n + 1
n = tonumber(ARGV[i])
for j = 1, n do redis.call('RPUSH', KEYS[2], ARGV[i + j]) end
i = i + n + 1
if ARGV[i] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[i + 2], ARGV[i + 1])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[i + 3])
  redis.call('LREM', KEYS[2], 1, ARGV[i])
end
return 1
"""
"""One commit, atomically. KEYS: the version-2 document (deleted: the hashes replace it),
owed list, done ids (sorted by when), fence, lease, commits per token (counted for each accepted commit
made under a token), state meta, the tasks, nodes and incidents hashes. ARGV: token (0: no
election), the lease holder ``token:id``, the meta document ("": unchanged), per hash
(reset "1"/"0", the sets as a count then key-value pairs, the deletions as a count then
keys), the voided entries (count first), the new entries (count first), the finished
entry, its id, the time it is recorded done at and the time before which done ids are
dropped ("" "" "" ""). Refused, changing nothing, when a token is given and the fence
has moved past it (another unicornd took the lease), or when the lease names another
holder: after a Sentinel failover that lost an unreplicated INCR of the fence, a second
leader can be handed the same token, and only the lease's holder tells the two apart."""


_MOVE_DONE: Final = """
local ids = redis.call('SPOP', KEYS[1], 1000)
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[2], 'NX', ARGV[1], id) end
return #ids
"""
"""KEYS: the untimed done set, the timed one; ARGV: now. Moves up to 1,000 ids."""

KEEP_DONE_S: Final = 7 * 86400.0
"""How long an executed action's id is kept. An id is derived from its cause (incident and
ladder step, plan generation, node and join count), so it recurs only while that cause is
decided on again: an owed action re-read after a restart, within minutes. A week is far
beyond that, and bounds the set (before: every id ever run, for ever)."""


@dataclass(frozen=True)
class CommitCost:
    """What one accepted commit cost: the state bytes it wrote (its delta), the time to
    find and serialise them, and the whole commit (serialisation, the script and its Redis
    round trip, the replication wait) in seconds."""

    state_bytes: int
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
        self._written: Written | None = None
        self.unreplicated = 0
        """Commits the primary acknowledged but ``wait_replicas`` replicas did not within
        ``wait_timeout_ms`` (a failover in that window would lose them: see ARCHITECTURE)."""

    async def load(self, gpus_per_node: int) -> Snapshot:
        """The persisted snapshot, or an empty one for a fresh installation. The next
        commit writes only what changed since (after a version-2 document: everything)."""
        found = await read_state(self.client, self.keys, self.policy)
        if found is None:
            self._written = None
            return Snapshot(tasks={}, nodes={}, gpus_per_node=gpus_per_node, policy=self.policy)
        snap, self._written = found
        return snap

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

        Only the records that differ from the last commit are written (a commit that
        failed, or a first one, writes everything). Only the leading unicornd writes these
        keys, one commit at a time, so reading the owed list before the transaction (for
        the cancellations) is safe.
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
        delta, written = state_delta(self._written, snap)
        serialised = time.perf_counter()
        args: list[str | bytes | int] = [self.token, self.holder, delta.meta or b""]
        for kind in KINDS:
            sets = delta.sets[kind]
            args += ["1" if delta.reset[kind] else "0", len(sets)]
            for key, value in sets.items():
                args += [key, value]
            args += [len(delta.deletes[kind]), *delta.deletes[kind]]
        args += [len(voided), *(o.raw for o in voided)]
        args += [len(actions), *(json.dumps(action_to_dict(a)) for a in actions)]
        if finished is not None:
            now = time.time()
            args += [finished.raw, finished.action.action_id, repr(now), repr(now - KEEP_DONE_S)]
        else:
            args += ["", "", "", ""]
        self._written = None  # unknown until the script is known to have run
        try:
            _, replicated = await redis_io.eval_replicated(
                self.client,
                self.replication,
                ("EVAL", "commit", k.state_meta()),
                _COMMIT,
                10,
                k.state(),
                k.actions_pending(),
                k.actions_done_at(),
                k.fence(),
                k.leader(),
                k.commits(),
                k.state_meta(),
                *(k.state_records(kind) for kind in KINDS),
                *args,
            )
        except RedisCallError as e:
            if "FENCED" in str(e):
                raise Fenced(f"commit refused: {e}; another unicornd leads") from e
            raise
        self._written = written
        self.commits += 1
        if self.on_commit is not None:
            self.on_commit(CommitCost(delta.size, serialised - started, time.perf_counter() - started))
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
        return (
            await redis_io.call(
                ("ZSCORE", self.keys.actions_done_at()),
                self.client.zscore(self.keys.actions_done_at(), action_id),
            )
            is not None
        )

    async def move_untimed_done(self) -> int:
        """Move the ids of the done set written before ids were timed into the timed one,
        as done now (they are dropped :data:`KEEP_DONE_S` later), in batches that each
        move atomically; the number moved. Called at start, before the executor runs."""
        moved = 0
        while True:
            n = await redis_io.call(
                ("EVAL", "move_done", self.keys.actions_done()),
                self.client.eval(
                    _MOVE_DONE, 2, self.keys.actions_done(), self.keys.actions_done_at(), repr(time.time())
                ),
            )
            moved += int(n)
            if not n:
                return moved
