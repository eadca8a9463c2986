"""The coordinator's state: enums with explicit transition tables, persisted records, policy.

Everything here is a value: frozen dataclasses whose ``to_dict()`` gives plain JSON types
(so unicornd can persist them in Redis) and whose ``from_dict()`` rejects bad data with
:class:`~unicorn_core.errors.ProtocolError` (wrong shape or type, unknown key) or
:class:`~unicorn_core.errors.InvalidArgument` (a value out of range). No I/O, no clock:
timestamps (``*_s``) are wall-clock seconds (``time.time()``) passed in by the caller,
because these records outlive the process and windows such as "failures in the last
day" must survive a restart; decisions only ever use differences of them.

State machines (every pair is tested; :func:`transition` raises on anything else)::

    TaskState    pending -> launching -> running <-> recovering -> launching ...
                 any live state -> finished | failed | stopped;  stopped -> pending (operator)
    NodeHealth   healthy -> suspect -> draining -> drained -> returning -> healthy
    LadderStage  detected -> retry_in_place -> restart_processes -> isolate -> replan
                 -> transition -> resumed -> closed   (Unicron Fig. 7; see the table)

Why one module of ~550 lines: these records, their transition tables and the snapshot
are the one schema of the committed state; they are read together by every decision
module and by the store, and changing one means reading the others.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Any, Final, Self, TypeVar

import msgspec

from detect.statuses import ErrorStatus, Severity
from launcher.megatron import check_user_args
from plan.calibration import LayoutTiming, Running
from unicorn_core.config import RecoveryConfig
from unicorn_core.errors import InvalidArgument, ProtocolError
from unicorn_core.keys import check_name
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec
from unicorn_core.taskspec import TaskSpec

# --- state machines ------------------------------------------------------------------


class TaskState(enum.StrEnum):
    """Lifecycle of a training task (one Slurm job submitted through unicorn).

    ``pending``: known, not running (waiting for GPUs or for its first plan).
    ``launching``: agents and training processes are being (re)started at a layout.
    ``running``: iterations advance. ``recovering``: an incident is open.
    ``finished`` / ``failed``: the job ended (terminal). ``stopped``: unicorn gave up
    (budget or no-progress breaker) and told the operator; only the operator restarts it.
    """

    PENDING = "pending"
    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"


class NodeHealth(enum.StrEnum):
    """unicorn's view of a node (beside Slurm's own state).

    ``suspect``: a fault points at it but it is not drained (e.g. the drain limiter asked
    the operator). ``draining``: a drain was ordered. ``drained``: out of every plan.
    ``returning``: back in Slurm, running the node check before it may rejoin a task.
    """

    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DRAINING = "draining"
    DRAINED = "drained"
    RETURNING = "returning"


class LadderStage(enum.StrEnum):
    """Stage of an incident on the error-handling ladder (Unicron Fig. 7).

    ``retry_in_place`` (SEV3), ``restart_processes`` (SEV2: same nodes, same layout),
    ``isolate`` (SEV1: drain the node), ``replan`` (waiting for the cluster-wide plan),
    ``transition`` (the plan is being applied), ``resumed`` (iterations advance again),
    ``escalated_to_operator`` (unicorn stopped acting: breaker, budget or drain limit),
    ``closed``.
    """

    DETECTED = "detected"
    RETRY_IN_PLACE = "retry_in_place"
    RESTART_PROCESSES = "restart_processes"
    ISOLATE = "isolate"
    REPLAN = "replan"
    TRANSITION = "transition"
    RESUMED = "resumed"
    ESCALATED_TO_OPERATOR = "escalated_to_operator"
    CLOSED = "closed"


_T = TaskState
TASK_TRANSITIONS: Final[Mapping[TaskState, frozenset[TaskState]]] = {
    _T.PENDING: frozenset({_T.LAUNCHING, _T.FINISHED, _T.FAILED, _T.STOPPED}),
    _T.LAUNCHING: frozenset({_T.RUNNING, _T.RECOVERING, _T.PENDING, _T.FINISHED, _T.FAILED, _T.STOPPED}),
    _T.RUNNING: frozenset({_T.RECOVERING, _T.LAUNCHING, _T.PENDING, _T.FINISHED, _T.FAILED, _T.STOPPED}),
    _T.RECOVERING: frozenset({_T.RUNNING, _T.LAUNCHING, _T.PENDING, _T.FINISHED, _T.FAILED, _T.STOPPED}),
    _T.FINISHED: frozenset(),
    _T.FAILED: frozenset(),
    _T.STOPPED: frozenset({_T.PENDING, _T.FINISHED, _T.FAILED}),
}
"""Allowed next states of a task. ``running -> launching`` is a replan that moves a
healthy task; ``-> pending`` is a plan that gives the task no GPUs."""

LIVE_TASK_STATES: Final = frozenset({_T.LAUNCHING, _T.RUNNING, _T.RECOVERING})
"""States in which a task has processes that can fail."""
ENDED_STATES: Final = frozenset({_T.FINISHED, _T.FAILED, _T.STOPPED})
"""States in which a task runs nothing until an operator registers it again."""

_N = NodeHealth
NODE_TRANSITIONS: Final[Mapping[NodeHealth, frozenset[NodeHealth]]] = {
    _N.HEALTHY: frozenset({_N.SUSPECT, _N.DRAINING, _N.DRAINED}),
    _N.SUSPECT: frozenset({_N.HEALTHY, _N.DRAINING, _N.DRAINED}),
    _N.DRAINING: frozenset({_N.DRAINED, _N.RETURNING}),
    _N.DRAINED: frozenset({_N.RETURNING}),
    _N.RETURNING: frozenset({_N.HEALTHY, _N.DRAINING, _N.DRAINED}),
}
"""Allowed next health states. ``-> drained`` directly is a drain seen in Slurm that
unicorn did not order (an administrator's, or a node marked down)."""

_L = LadderStage
_UP = frozenset({_L.ESCALATED_TO_OPERATOR, _L.CLOSED})
LADDER_TRANSITIONS: Final[Mapping[LadderStage, frozenset[LadderStage]]] = {
    _L.DETECTED: frozenset({_L.RETRY_IN_PLACE, _L.RESTART_PROCESSES, _L.ISOLATE}) | _UP,
    _L.RETRY_IN_PLACE: frozenset({_L.RESTART_PROCESSES, _L.ISOLATE, _L.RESUMED}) | _UP,
    _L.RESTART_PROCESSES: frozenset({_L.ISOLATE, _L.RESUMED}) | _UP,
    _L.ISOLATE: frozenset({_L.REPLAN}) | _UP,
    _L.REPLAN: frozenset({_L.TRANSITION, _L.ISOLATE}) | _UP,
    _L.TRANSITION: frozenset({_L.RESUMED, _L.RETRY_IN_PLACE, _L.RESTART_PROCESSES, _L.ISOLATE, _L.REPLAN})
    | _UP,
    _L.RESUMED: frozenset({_L.CLOSED}),
    _L.ESCALATED_TO_OPERATOR: frozenset({_L.ISOLATE, _L.CLOSED}),
    _L.CLOSED: frozenset(),
}
"""Allowed next ladder stages. Every open stage may go to ``escalated_to_operator``
(breaker, budget, drain limit) or straight to ``closed`` (the task ended, or the
operator closed it). Going back down from ``transition`` to a retry or a restart
handles a fault of the relaunched task: a fresh layout gets the in-place rungs again,
but the incident's attempt counters carry on, so repeated failure still climbs. A
second attempt at the same rung is not a transition: it increments ``attempts``."""

_E = TypeVar("_E", TaskState, NodeHealth, LadderStage)

_TABLES: Final[Mapping[type[enum.Enum], Mapping[Any, frozenset[Any]]]] = {
    TaskState: TASK_TRANSITIONS,
    NodeHealth: NODE_TRANSITIONS,
    LadderStage: LADDER_TRANSITIONS,
}


class IllegalTransition(InvalidArgument):
    """A state change that the transition table does not allow. Nothing was changed."""

    def __init__(self, old: enum.Enum, new: enum.Enum, allowed: Iterable[enum.Enum]) -> None:
        names = ", ".join(sorted(str(s.value) for s in allowed)) or "none (terminal)"
        super().__init__(
            f"{type(old).__name__}: {old.value} -> {new.value} is not allowed; from {old.value}: {names}"
        )
        self.old = old
        self.new = new


def transition(old: _E, new: _E) -> _E:
    """Return ``new`` if its table allows ``old -> new``, else raise :class:`IllegalTransition`.

    Staying in the same state is not a transition and raises too: callers that mean
    "no change" do not call this.
    """
    if type(old) is not type(new):
        raise InvalidArgument(f"cannot move a {type(old).__name__} to a {type(new).__name__}")
    allowed = _TABLES[type(old)][old]
    if new not in allowed:
        raise IllegalTransition(old, new, allowed)
    return new


# --- persistence helpers -------------------------------------------------------------


def _finite(value: float, what: str) -> None:
    if not math.isfinite(value):
        raise InvalidArgument(f"{what} must be finite, got {value!r}")


def _non_negative(value: int, what: str) -> None:
    if value < 0:
        raise InvalidArgument(f"{what} must be >= 0, got {value!r}")


def _name(value: str, what: str) -> None:
    """Node names and task ids become Redis key components: the same rule applies."""
    try:
        check_name(value)
    except InvalidArgument:
        raise InvalidArgument(f"{what} {value!r} must match [A-Za-z0-9_.-]+") from None


def _distinct(values: tuple[str, ...], what: str) -> None:
    if len(set(values)) != len(values):
        raise InvalidArgument(f"{what} must be distinct, got {list(values)}")


_R = TypeVar("_R")

KEEP_CLOSED_S: Final = 24 * 3600.0
"""How long a closed incident stays in the snapshot (the incidents stream keeps it)."""
KEEP_ENDED_S: Final = 24 * 3600.0
"""How long a finished, failed or stopped task stays in the snapshot after it ended
(:attr:`TaskRecord.ended_s`); the goodput ledger's history and the incidents stream keep
what it did. Without a limit every task a cluster ever ran stays, and every decision and
the ledger's every commit walk them all."""


def _upserted(old: Mapping[str, _R], new: dict[str, _R], drop: frozenset[str]) -> Mapping[str, _R]:
    """``old`` without ``drop``, then with ``new`` upserted; ``old`` itself when both are empty."""
    if not new and not drop.intersection(old):
        return old
    kept = {k: v for k, v in old.items() if k not in drop} if drop else old
    return {**kept, **new}


def _load(cls: type[_R], data: object) -> _R:
    """Convert plain JSON data to ``cls``; strict about types and unknown keys."""
    if not isinstance(data, Mapping):
        raise ProtocolError("invalid", f"{cls.__name__}: expected an object, got {type(data).__name__}")
    valid = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in valid)
    if unknown:
        raise ProtocolError(
            "invalid", f"{cls.__name__}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(valid)}"
        )
    try:
        return msgspec.convert(dict(data), cls)
    except msgspec.ValidationError as exc:
        raise ProtocolError("invalid", f"{cls.__name__}: {exc}") from exc


def _dump(value: object) -> dict[str, Any]:
    """Plain JSON types only (lists, not tuples): what ``json.loads`` would give back."""
    out = msgspec.json.decode(msgspec.json.encode(value))
    assert isinstance(out, dict)
    return out


class _Record:
    """``to_dict``/``from_dict`` for the frozen dataclasses below."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; ``from_dict(to_dict())`` equals the record."""
        return _dump(self)

    @classmethod
    def from_dict(cls, data: object) -> Self:
        """Inverse of :meth:`to_dict`. Raises ProtocolError (shape, types, unknown keys)
        or InvalidArgument (values out of range)."""
        return _load(cls, data)


# --- records -------------------------------------------------------------------------


@dataclass(frozen=True)
class RequeueWait:
    """A requeue of the task's job is under way (decided by ``action_id``).

    Until the job runs again its processes die on purpose: their exits and silence are
    not faults. ``done_s``: when the requeue command returned (None: not yet); the job
    RUNNING at a Slurm poll started after that is the signal to launch its agents.
    ``deadline_s``: when waiting for the job to run again ends in failure (the rung fails,
    see :func:`unicornd.decide.on_tick`): 120 s after the requeue returned. Until then it is
    a backstop (:data:`unicornd.replan.REQUEUE_QUEUED_LIMIT_S` after the commit): the
    requeue may wait behind other allocation changes (they run one at a time: a
    whole-cluster replan at 4,096 nodes queued minutes of them), and its own outcome ends
    the wait if it fails.
    """

    action_id: str
    deadline_s: float
    done_s: float | None = None


@dataclass(frozen=True)
class Rollback:
    """A roll back of a task past a loss spike or NaN (issue 23): the data of iterations
    ``first``..``last`` (inclusive, 1-based) is skipped, and the ranks restart from the newest
    saved version strictly older than ``first`` (from any tier; the trainer finds it, see
    ``unicorn-train --skip-iterations``). ``iteration``: the iteration the finding named.
    ``incident_id``: the incident that decided it; ``launch``: the prefix of the relaunch's
    action ids (the rolled-back ranks' iterations carry launch ids that start with it);
    ``version``: the version the ranks restored, as their first report shows it (the first
    iteration they reported, less one and, for Megatron-LM, less the skipped iterations just
    before it, which it logs no line for; None until then)."""

    first: int
    last: int
    iteration: int
    incident_id: str
    launch: str
    decided_s: float
    version: int | None = None

    def __post_init__(self) -> None:
        if self.first < 1 or self.last < self.first or not self.first <= self.iteration:
            raise InvalidArgument(
                f"rollback: need 1 <= first <= last and first <= iteration, got "
                f"{self.first}, {self.last}, {self.iteration}"
            )
        _finite(self.decided_s, "rollback: decided_s")
        if self.version is not None and not 0 <= self.version < self.first:
            raise InvalidArgument(
                f"rollback: version {self.version} must be >= 0 and older than iteration {self.first}"
            )

    @property
    def skipped(self) -> str:
        """The skipped range as ``unicorn-train --skip-iterations`` writes it (``A-B``)."""
        return f"{self.first}-{self.last}"


FRAMEWORKS: Final = ("unicorn-train", "megatron")
"""``unicorn-train``: the built-in trainer (layout as --tp/--pp/--dp/...); ``megatron``:
Megatron-LM's pretrain_gpt.py (layout as --tensor-model-parallel-size/...)."""


@dataclass(frozen=True)
class TaskRecord(_Record):
    """One training task as the coordinator tracks it.

    ``nodes`` are the nodes it runs on now, in node-rank order. ``last_iteration`` is the
    highest iteration ever reported (the no-progress breaker's mark).
    ``recoveries_without_progress`` counts ladder actions since the iteration last passed
    that mark; ``recovery_times_s`` are the times of ladder actions (the budget used is
    how many fall in the budget window). ``resizes_this_run`` counts shrinks and grows
    since the job (re)started (Slurm without slurmdbd allows one). ``incidents_opened``
    numbers this task's incidents, so incident ids are deterministic. ``launched_s`` is
    when the latest launch or relaunch was ordered (iterations reported after it prove
    the launch worked). ``framework`` says how a layout is passed to ``command``
    (:data:`FRAMEWORKS`); a registration checks it (:meth:`check_command`), so one that
    conflicts with unicorn's flags is refused before anything is stored. ``generation`` is
    the plan generation of the latest launch (its rendezvous port and run id derive from
    it, so a restarted agent rejoins its peers).
    ``finished_nodes``: nodes whose agent reported the training's clean exit since the
    latest (re)start of its ranks (all of them: the task finished). ``requeue``: a requeue
    of its job is under way (:class:`RequeueWait`). ``nodes`` is the one record of which
    task uses which node (:meth:`Snapshot.owner`). ``rollbacks``: every roll back past a
    loss spike or NaN (:class:`Rollback`), oldest first; their skipped ranges are part of
    every later launch's command (:meth:`skip_ranges`). ``last_iteration_s``: when a rank
    finished ``last_iteration`` (its wall clock; the goodput ledger times work by it).
    ``job_gres``: the generic resources its job asked for (``gres/gpu:8``), as Slurm reported
    them when the task registered; a job holding GRES is never expanded (Slurm refuses it),
    so adding nodes to it is a requeue (:func:`unicornd.replan.plan_transition`).
    ``gpu_types``: the GPU types (Slurm's GRES type names) it may run on; empty: any. A
    task is planned on nodes of one type only (:func:`unicornd.replan.pools`).
    ``ended_s``: when it became finished, failed or stopped (None before; a record written
    before the field existed has none); the record is dropped :data:`KEEP_ENDED_S` after
    it (:func:`unicornd.decide.ladder.on_tick`). ``first_iteration_s``: when a rank finished
    the first iteration reported after the latest launch (``launched_s``; whatever its
    number, unlike ``last_iteration_s``); at or before ``launched_s``, or None, the launch
    is still starting (a wait in place then gets the time a launch gets).
    """

    task_id: str
    name: str
    model: ModelSpec
    command: tuple[str, ...]
    weight: float = 1.0
    min_gpus: int = 1
    max_gpus: int | None = None
    job_id: int | None = None
    state: TaskState = TaskState.PENDING
    layout: Layout | None = None
    nodes: tuple[str, ...] = ()
    last_iteration: int | None = None
    recoveries_without_progress: int = 0
    recovery_times_s: tuple[float, ...] = ()
    resizes_this_run: int = 0
    incidents_opened: int = 0
    launched_s: float | None = None
    framework: str = "unicorn-train"
    generation: int = 0
    finished_nodes: tuple[str, ...] = ()
    requeue: RequeueWait | None = None
    rollbacks: tuple[Rollback, ...] = ()
    last_iteration_s: float | None = None
    job_gres: str = ""
    gpu_types: tuple[str, ...] = ()
    ended_s: float | None = None
    first_iteration_s: float | None = None

    def __post_init__(self) -> None:
        _name(self.task_id, "task_id")
        for kind in self.gpu_types:
            _name(kind, f"task {self.task_id}: gpu type")
        _distinct(self.gpu_types, f"task {self.task_id}: gpu_types")
        if self.framework not in FRAMEWORKS:
            raise InvalidArgument(
                f"task {self.task_id}: framework {self.framework!r} is not one of {', '.join(FRAMEWORKS)}"
            )
        self.spec()  # name, weight, GPU bounds: TaskSpec's rules
        if not self.command:
            raise InvalidArgument(f"task {self.task_id}: command must not be empty")
        if self.job_id is not None:
            _non_negative(self.job_id, f"task {self.task_id}: job_id")
        for node in self.nodes:
            _name(node, f"task {self.task_id}: node")
        _distinct(self.nodes, f"task {self.task_id}: nodes")
        if self.last_iteration is not None:
            _non_negative(self.last_iteration, f"task {self.task_id}: last_iteration")
        for what in ("recoveries_without_progress", "resizes_this_run", "incidents_opened", "generation"):
            _non_negative(getattr(self, what), f"task {self.task_id}: {what}")
        stamps = (self.launched_s, self.last_iteration_s, self.ended_s, self.first_iteration_s)
        for t in (*self.recovery_times_s, *(t for t in stamps if t is not None)):
            _finite(t, f"task {self.task_id}: timestamp")

    def starting(self) -> bool:
        """Its latest launch has not finished an iteration yet (``first_iteration_s`` none, or
        not after ``launched_s``); unknown (no launch time): not starting."""
        if self.launched_s is None:
            return False
        return self.first_iteration_s is None or self.first_iteration_s <= self.launched_s

    def skip_ranges(self) -> tuple[tuple[int, int], ...]:
        """The iterations whose data every launch of the task skips: ``(first, last)`` pairs,
        sorted, overlapping ones merged."""
        merged: list[tuple[int, int]] = []
        for first, last in sorted((r.first, r.last) for r in self.rollbacks):
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        return tuple(merged)

    def check_command(self) -> None:
        """Registration's check of the command against unicorn's flags (a ``megatron`` one:
        :func:`launcher.megatron.check_user_args`); raises InvalidArgument naming the task.

        Run where a task is registered (the CLI, the daemon's request), not on every decode:
        a stored task that today's rules refuse must not keep unicornd from reading its
        state (its relaunch refuses to render instead, with the reason)."""
        if self.framework == "megatron":
            try:
                check_user_args(self.command, self.model)
            except InvalidArgument as e:
                raise InvalidArgument(f"task {self.task_id}: {e}") from None

    def spec(self) -> TaskSpec:
        """The planner's view of this task."""
        return TaskSpec(
            name=self.name,
            model=self.model,
            weight=self.weight,
            min_gpus=self.min_gpus,
            max_gpus=self.max_gpus,
        )

    def budget_used(self, now_s: float, window_s: float) -> int:
        """Ladder actions within the last ``window_s`` seconds."""
        return sum(1 for t in self.recovery_times_s if now_s - t < window_s)

    def with_state(self, new: TaskState) -> TaskRecord:
        """Copy in state ``new`` (raises :class:`IllegalTransition`); same state: unchanged."""
        return self if new is self.state else replace(self, state=transition(self.state, new))


@dataclass(frozen=True)
class NodeRecord(_Record):
    """One node: health, why, and its history (which task uses it: :meth:`Snapshot.owner`).

    ``failures_s``: times unicorn found it faulty (SEV1 isolations, failed node checks);
    ``drains_s``: times unicorn drained it (the drain limiter counts these across the
    cluster); ``held``: failed too often, stays drained until an operator resumes it;
    ``joins``: how often it (re)joined, so join actions get deterministic ids;
    ``jobs``: the Slurm jobs holding it at the last poll (ascending ids). Those that are no
    task's job are other users' (:meth:`Snapshot.foreign_jobs`): unicorn neither drains
    nor plans a node they run on. ``gpus`` and ``gpu_type``: its GPUs as Slurm's GRES
    says (``gpu:h100:8``); ``gpus`` 0 means unknown (the snapshot's ``gpus_per_node``), and
    ``gpu_type`` "" untyped. Nodes of one type and count form a planning pool
    (:func:`unicornd.replan.pools`). ``slurm_down``: slurmctld said NOT_RESPONDING or DOWN
    at the last poll (Slurm's view, not unicorn's verdict: health is unchanged); such a
    node is no new capacity (:meth:`Snapshot.plannable`), as Slurm will not start a job
    there, but a task that runs on it keeps it (slurmd can die on a node that trains on;
    a silent agent there as well is a confirmed loss, :mod:`unicornd.inputs`).
    """

    name: str
    health: NodeHealth = NodeHealth.HEALTHY
    reason: str = ""
    failures_s: tuple[float, ...] = ()
    drains_s: tuple[float, ...] = ()
    held: bool = False
    joins: int = 0
    jobs: tuple[int, ...] = ()
    gpus: int = 0
    gpu_type: str = ""
    slurm_down: bool = False

    def __post_init__(self) -> None:
        _name(self.name, "node name")
        for t in (*self.failures_s, *self.drains_s):
            _finite(t, f"node {self.name}: timestamp")
        _non_negative(self.joins, f"node {self.name}: joins")
        _non_negative(self.gpus, f"node {self.name}: gpus")
        for job_id in self.jobs:
            if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id <= 0:
                raise InvalidArgument(f"node {self.name}: job id {job_id!r} is not a positive integer")

    def with_health(self, new: NodeHealth, reason: str | None = None) -> NodeRecord:
        """Copy in health ``new`` (raises :class:`IllegalTransition`); same health: only the reason."""
        health = self.health if new is self.health else transition(self.health, new)
        return replace(self, health=health, reason=self.reason if reason is None else reason)


@dataclass(frozen=True)
class StageEntry:
    """One step of an incident's timeline: it entered ``stage`` at ``t_s`` (or, with the
    same stage as the entry before, something happened there: ``detail`` says what, e.g.
    the agent's answer to a failed restart)."""

    stage: LadderStage
    t_s: float
    detail: str = ""


@dataclass(frozen=True)
class Incident(_Record):
    """A fault of one task (or of an idle node, ``task_id`` None) and its way up the ladder.

    ``node``/``rank``/``status``/``severity``/``rule``/``evidence`` describe the finding
    that opened it (the root cause); ``severity`` is raised to the worst seen since.
    ``attempts`` counts actions per rung; ``last_action_s`` is when the latest one was
    issued (findings soon after it are its consequences, and stage deadlines run from
    it). ``isolated_nodes`` are the nodes this incident drained; ``pending_drain`` the
    node waiting for an operator's confirmation; ``pending_check`` the nodes whose node
    check must confirm the fault before any is drained (:mod:`detect.isolation`);
    ``confirmed_by`` what confirmed the last drain (a
    :class:`detect.isolation.Confirmation` value). ``finding_ids`` (the newest
    :attr:`Policy.remembered_findings`) make a redelivered finding a no-op. ``rollback``:
    the roll back this incident ordered (skipped range, bound and restored version;
    :class:`Rollback`), None when it ordered none.
    """

    incident_id: str
    task_id: str | None
    node: str
    rank: int | None
    status: ErrorStatus
    severity: Severity
    rule: str
    evidence: str
    opened_s: float
    stage: LadderStage = LadderStage.DETECTED
    attempts: dict[LadderStage, int] = field(default_factory=dict)
    timeline: tuple[StageEntry, ...] = ()
    last_action_s: float = 0.0
    finding_ids: tuple[str, ...] = ()
    isolated_nodes: tuple[str, ...] = ()
    pending_drain: str | None = None
    note: str = ""
    pending_check: tuple[str, ...] = ()
    confirmed_by: str = ""
    rollback: Rollback | None = None

    def __post_init__(self) -> None:
        if not self.incident_id:
            raise InvalidArgument("incident_id must be non-empty")
        _name(self.node, f"incident {self.incident_id}: node")
        if self.rank is not None:
            _non_negative(self.rank, f"incident {self.incident_id}: rank")
        _finite(self.opened_s, f"incident {self.incident_id}: opened_s")
        _finite(self.last_action_s, f"incident {self.incident_id}: last_action_s")
        for stage, count in self.attempts.items():
            _non_negative(count, f"incident {self.incident_id}: attempts[{stage}]")
        for entry in self.timeline:
            _finite(entry.t_s, f"incident {self.incident_id}: timeline time")

    @property
    def is_open(self) -> bool:
        return self.stage is not LadderStage.CLOSED

    def attempts_at(self, stage: LadderStage) -> int:
        return self.attempts.get(stage, 0)

    def moved(self, new: LadderStage, now_s: float) -> Incident:
        """Copy in stage ``new`` with a timeline entry (raises :class:`IllegalTransition`)."""
        stage = transition(self.stage, new)
        return replace(self, stage=stage, timeline=(*self.timeline, StageEntry(stage, now_s)))

    def noted(self, detail: str, now_s: float) -> Incident:
        """Copy with ``detail`` in the timeline at the current stage (no transition)."""
        return replace(self, timeline=(*self.timeline, StageEntry(self.stage, now_s, detail[:500])))


@dataclass(frozen=True)
class MeasuredLayout:
    """Measured iteration times of a model (``model``: :func:`plan.calibration.model_key`)
    at ``layout`` on GPU type ``gpu``; ``updated_s``: the newest report's time (the oldest
    entry goes first when :data:`MAX_MEASURED_LAYOUTS` are kept)."""

    gpu: str
    model: str
    layout: Layout
    iteration_s: Running
    updated_s: float

    def __post_init__(self) -> None:
        _finite(self.updated_s, "measured layout: updated_s")


MAX_MEASURED_LAYOUTS: Final = 256
"""Measured (GPU type, model, layout) entries kept: bounded memory whatever runs."""


@dataclass(frozen=True)
class Calibration(_Record):
    """What the planner learned from the cluster (:mod:`unicornd.calibrate`, math in
    :mod:`plan.calibration`): running estimates, never raw samples.

    ``layouts``: iteration times per (GPU type, model, layout). ``transitions``: per task id,
    how long its plan transitions took (a plan's launch to the first iteration of the new
    ranks). ``warm_after``: per task id, the reports up to this iteration are the latest
    launch's warm-up, not measured. ``node_failures``: nodes unicorn found faulty (every
    entry ever added to a :attr:`NodeRecord.failures_s`) since ``since_s``, the first
    decision that counted (None: none yet); node-hours are the nodes known times the time
    since then.
    """

    layouts: tuple[MeasuredLayout, ...] = ()
    transitions: dict[str, Running] = field(default_factory=dict)
    warm_after: dict[str, int] = field(default_factory=dict)
    node_failures: int = 0
    since_s: float | None = None

    def __post_init__(self) -> None:
        _non_negative(self.node_failures, "calibration: node_failures")
        if self.since_s is not None:
            _finite(self.since_s, "calibration: since_s")

    def timings(self, gpu: str, model: str) -> tuple[LayoutTiming, ...]:
        """The measured layouts of ``model`` on ``gpu``."""
        return tuple(
            LayoutTiming(m.layout, m.iteration_s) for m in self.layouts if m.gpu == gpu and m.model == model
        )

    def measured(self, gpu: str, model: str, layout: Layout) -> Running | None:
        for m in self.layouts:
            if m.gpu == gpu and m.model == model and m.layout == layout:
                return m.iteration_s
        return None


@dataclass(frozen=True)
class PlanBasis(_Record):
    """The planner's measured inputs as one plan took them: the calibration at ``t_s``.

    Plans use it instead of the live calibration, so the planner's inputs change at known
    moments (:data:`PLAN_BASIS_REFRESH_S`), not with every iteration report, and a plan
    solved ahead for the next failure (:mod:`unicornd.lookup`) is still the plan that
    failure gets."""

    calibration: Calibration
    t_s: float

    def __post_init__(self) -> None:
        _finite(self.t_s, "plan basis: t_s")


PLAN_BASIS_REFRESH_S: Final = 300.0
"""A plan basis is renewed this often while the calibration moves
(:func:`unicornd.decide.on_basis_due`): the planner sees measurements at most this late (a
measured speed moves plans by percents; a failure's plan solved in advance is worth more
than inputs seconds fresher)."""


# --- policy and snapshot -------------------------------------------------------------


Policy = RecoveryConfig
"""Every constant the decision functions use: the ``[recovery]`` config section (see
:class:`unicorn_core.config.RecoveryConfig` for each one's default and why)."""


@dataclass(frozen=True)
class Snapshot:
    """What the decision functions see: every record, the cluster shape and the policy.

    ``incidents`` holds open incidents and recently closed ones (kept so a redelivered
    finding is recognised). ``plan_generation`` numbers applied plans (action ids of a
    transition derive from it). ``calibration``: the planner's measured inputs (a restarted
    or standby unicornd plans with them too); ``plan_basis``: the calibration the last plan
    that took one used (:class:`PlanBasis`; None before the first). Treat the mappings as read-only;
    :meth:`apply` returns a new snapshot.
    """

    tasks: Mapping[str, TaskRecord]
    nodes: Mapping[str, NodeRecord]
    gpus_per_node: int
    incidents: Mapping[str, Incident] = field(default_factory=dict)
    plan_generation: int = 0
    policy: Policy = field(default_factory=Policy)
    calibration: Calibration = field(default_factory=Calibration)
    plan_basis: PlanBasis | None = None
    check: InitVar[bool] = True
    """False: the mappings are known to hold each record under its own key (:meth:`apply`
    builds them so), and are not checked again (O(records) on every decision at scale)."""

    def __post_init__(self, check: bool) -> None:
        if not check:
            return
        if self.gpus_per_node <= 0:
            raise InvalidArgument(f"gpus_per_node must be > 0, got {self.gpus_per_node!r}")
        for key, task in self.tasks.items():
            if key != task.task_id:
                raise InvalidArgument(f"tasks: key {key!r} holds task {task.task_id!r}")
        for key, node in self.nodes.items():
            if key != node.name:
                raise InvalidArgument(f"nodes: key {key!r} holds node {node.name!r}")
        for key, inc in self.incidents.items():
            if key != inc.incident_id:
                raise InvalidArgument(f"incidents: key {key!r} holds incident {inc.incident_id!r}")

    def owner(self, node: str) -> TaskRecord | None:
        """The task that runs on ``node`` now (not ended), if any."""
        for task in self.tasks.values():
            if node in task.nodes:
                return task
        return None

    def foreign_jobs(self, node: str) -> tuple[int, ...]:
        """Jobs on ``node`` (at the last Slurm poll) that are no task's: other users' work."""
        rec = self.nodes.get(node)
        if rec is None or not rec.jobs:
            return ()
        ours = {t.job_id for t in self.tasks.values() if t.job_id is not None}
        return tuple(j for j in rec.jobs if j not in ours)

    def gpus_per_node_of(self, task: TaskRecord) -> int:
        """GPUs per node where ``task`` runs (its nodes are of one kind: the planner never
        mixes them): its first known node's, else the snapshot's ``gpus_per_node``."""
        for name in task.nodes:
            rec = self.nodes.get(name)
            if rec is not None and rec.gpus:
                return rec.gpus
        return self.gpus_per_node

    def plannable(self) -> list[str]:
        """The nodes the planner may use, by name: healthy, not held, and free of other
        users' jobs and up in Slurm (not ``slurm_down``) unless a task runs there already
        (it keeps what it has)."""
        used = {n for t in self.tasks.values() for n in t.nodes}
        return sorted(
            n.name
            for n in self.nodes.values()
            if n.health is NodeHealth.HEALTHY
            and not n.held
            and (n.name in used or (not n.slurm_down and not self.foreign_jobs(n.name)))
        )

    def task_of_job(self, job_id: int) -> TaskRecord | None:
        for task in self.tasks.values():
            if task.job_id == job_id:
                return task
        return None

    def open_incident(self, task_id: str) -> Incident | None:
        """The task's open incident (at most one exists)."""
        for inc in self.incidents.values():
            if inc.task_id == task_id and inc.is_open:
                return inc
        return None

    def expired(self, now_s: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(task ids, incident ids) whose time in the snapshot is over: incidents closed
        :data:`KEEP_CLOSED_S` ago, and tasks that ended (finished, failed, stopped)
        :data:`KEEP_ENDED_S` ago with every incident of theirs, unless one is still open (a
        task the breaker stopped waits for the operator).
        A task without ``ended_s`` (written before it existed) stays."""
        ended = {
            t.task_id
            for t in self.tasks.values()
            if t.state in ENDED_STATES and t.ended_s is not None and now_s - t.ended_s >= KEEP_ENDED_S
        }
        ended -= {i.task_id for i in self.incidents.values() if i.is_open}
        incidents = tuple(
            i.incident_id
            for i in self.incidents.values()
            if not i.is_open
            and (i.task_id in ended or (i.timeline and now_s - i.timeline[-1].t_s >= KEEP_CLOSED_S))
        )
        return tuple(sorted(ended)), incidents

    def open_node_incident(self, node: str) -> Incident | None:
        """The open incident of an idle node (``task_id`` None) on ``node``."""
        for inc in self.incidents.values():
            if inc.task_id is None and inc.node == node and inc.is_open:
                return inc
        return None

    def node(self, name: str) -> NodeRecord:
        """The node's record; a node never seen is healthy with no history."""
        return self.nodes.get(name) or NodeRecord(name)

    def apply(
        self,
        *,
        tasks: Iterable[TaskRecord] = (),
        nodes: Iterable[NodeRecord] = (),
        incidents: Iterable[Incident] = (),
        plan_generation: int | None = None,
        calibration: Calibration | None = None,
        plan_basis: PlanBasis | None = None,
        drop_tasks: Iterable[str] = (),
        drop_incidents: Iterable[str] = (),
    ) -> Snapshot:
        """A copy with these records upserted, and the ``drop_*`` ones removed first (what
        unicornd persists after a decision). A mapping nothing is upserted into or dropped
        from is the same object as before (readers that derive something from one, e.g. the
        goodput ledger, keep it while it stays)."""
        new_tasks, new_nodes, new_incidents = tuple(tasks), tuple(nodes), tuple(incidents)
        return replace(
            self,
            tasks=_upserted(self.tasks, {t.task_id: t for t in new_tasks}, frozenset(drop_tasks)),
            nodes={**self.nodes, **{n.name: n for n in new_nodes}} if new_nodes else self.nodes,
            incidents=_upserted(
                self.incidents, {i.incident_id: i for i in new_incidents}, frozenset(drop_incidents)
            ),
            plan_generation=self.plan_generation if plan_generation is None else plan_generation,
            calibration=self.calibration if calibration is None else calibration,
            plan_basis=self.plan_basis if plan_basis is None else plan_basis,
            check=False,
        )
