"""Actions the decision functions ask for, and the :class:`Decision` that carries them.

An action is a frozen value; the executor (the only code that calls Slurm or writes
agent commands) performs it and reports an :class:`Outcome`, which is committed and fed
back to :func:`unicornd.decide.on_outcome`: the executor never decides. Every action
has an ``action_id`` derived from what caused it (incident id + ladder step, plan
generation + task + step, node + join count), never from a clock or a counter in
memory. So deciding twice on the same snapshot and input gives the same ids, and a
restarted executor skips every id in its done set (``RedisKeys.actions_done_at()``, a
week of ids): no node is drained twice, no restart is sent twice.

Order matters: the executor performs actions in the order they were committed among
those that share a resource (:func:`resources`: a job's agents, a node, Slurm's
allocations), so a JIT checkpoint comes before the stop and a shrink before the grow
that takes the freed node, while a node check or one job's commands never hold up
another job's recovery.

Three kinds are *requests to the decision layer*, never executed: :class:`Replan`,
:class:`RestartAgent` and :class:`RollBack`. :func:`unicornd.decide.resolve` replaces
them, purely, with the planner's transition, the new agent's :class:`LaunchAgents` and
the rolled-back command's ``relaunch`` before anything is committed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, TypeAlias

import msgspec

from unicorn_core.errors import InvalidArgument, ProtocolError
from unicorn_core.protocol import AgentAction, AgentCommand
from unicornd.state import Calibration, Incident, NodeRecord, PlanBasis, Snapshot, TaskRecord


@dataclass(frozen=True)
class DrainNode:
    """``scontrol update nodename=NODE state=drain reason=REASON``.

    ``down``: the node is confirmed dead (:data:`~unicornd.decide.common.DEAD_NODE_RULES`:
    unreachable over SSH, or NOT_RESPONDING to slurmctld too); it is first set DOWN, which
    removes it from its jobs at once (a drained dead node keeps its jobs COMPLETING until
    slurmctld gives up on it, ~10 s on the dev cluster), then DRAIN, so that it stays out
    (DOWN+DRAIN) when its slurmd registers again, until an operator resumes it.
    """

    kind: ClassVar[str] = "drain_node"
    action_id: str
    node: str
    reason: str
    down: bool = False


@dataclass(frozen=True)
class ResumeNode:
    """``scontrol update nodename=NODE state=resume`` (an operator's resume, or a cancelled drain)."""

    kind: ClassVar[str] = "resume_node"
    action_id: str
    node: str
    reason: str


@dataclass(frozen=True)
class CheckNode:
    """Run the node check on ``node``: a returning node (outcome to ``on_node_check``) or
    the suspect of an incident, to confirm a fault before its node is drained
    (:mod:`detect.isolation`). ``paired``: run the paired check across these nodes (all
    of the job ``job_id``'s) instead, to find which one stalls the job's collectives; its
    outcome names the bad nodes (:attr:`Outcome.nodes`)."""

    kind: ClassVar[str] = "check_node"
    action_id: str
    node: str
    paired: tuple[str, ...] = ()
    job_id: int | None = None


@dataclass(frozen=True)
class SendCommand:
    """Write an :class:`~unicorn_core.protocol.AgentCommand` to the agent of ``job_id`` on ``node``."""

    kind: ClassVar[str] = "send_command"
    action_id: str
    job_id: int
    node: str
    action: AgentAction
    deadline_s: float
    argv: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def message(self, wall_time_s: float, *, fence: int = 0) -> AgentCommand:
        """The wire message; its ``command_id`` is this action's id (echoed in the result);
        ``fence``: the sending unicornd's fencing token (agents ignore older ones)."""
        return AgentCommand(
            job_id=self.job_id,
            node=self.node,
            wall_time_s=wall_time_s,
            command_id=self.action_id,
            action=self.action,
            argv=list(self.argv),
            env=dict(self.env),
            deadline_s=self.deadline_s,
            fence=fence,
        )


@dataclass(frozen=True)
class NodeArgv:
    """The training command for one node (torchrun's argv differs per node rank)."""

    node: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class LaunchAgents:
    """``unicorn-agent`` supervising each node's ``ARGV`` on the nodes of ``commands``: one
    ``srun --jobid=J --overlap`` step for all of them (each node's ARGV stored in Redis),
    or ``srun -w NODE ... -- ARGV`` for one node (``unicornd.executor``)."""

    kind: ClassVar[str] = "launch_agents"
    action_id: str
    task_id: str
    job_id: int
    commands: tuple[NodeArgv, ...]
    env: dict[str, str] = field(default_factory=dict)
    clear_commands: bool = False
    """Kept so stored actions still decode; the executor now always deletes the commands
    queued for the nodes' previous agents first (a new agent reads its stream from the
    start and would otherwise run commands written for an agent before it)."""

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(c.node for c in self.commands)


@dataclass(frozen=True)
class RestartAgent:
    """Start a new agent for ``job_id`` on ``node``, whose agent is gone while the node is up
    (the SSH probe said so), with the task's current training argv for that node.

    A request to the decision layer: :func:`unicornd.decide.resolve` renders it into a
    :class:`LaunchAgents` (``clear_commands``) before it is committed."""

    kind: ClassVar[str] = "restart_agent"
    action_id: str
    task_id: str
    job_id: int
    node: str


@dataclass(frozen=True)
class RollBack:
    """Restart the ranks of ``job_id`` on ``node`` past a loss spike or NaN: the task's
    command rendered again with every skipped range of the task (``--skip-iterations``,
    Megatron-LM's ``--iterations-to-skip``), so the ranks restore the newest version older
    than the bad data and never train on it (issue 23).

    A request to the decision layer: :func:`unicornd.decide.resolve` renders it into a
    ``relaunch`` :class:`SendCommand` (same layout, same nodes) before it is committed."""

    kind: ClassVar[str] = "roll_back"
    action_id: str
    task_id: str
    job_id: int
    node: str


@dataclass(frozen=True)
class Shrink:
    """Shrink the running job to exactly ``nodes`` (``scontrol update jobid=J NodeList=...``)."""

    kind: ClassVar[str] = "shrink"
    action_id: str
    task_id: str
    job_id: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Grow:
    """Add ``add`` to the running job (job expansion); on refusal the executor requeues."""

    kind: ClassVar[str] = "grow"
    action_id: str
    task_id: str
    job_id: int
    add: tuple[str, ...]


@dataclass(frozen=True)
class Requeue:
    """Requeue the job and start it again on exactly ``nodes``; ``()`` keeps it held (no GPUs)."""

    kind: ClassVar[str] = "requeue"
    action_id: str
    task_id: str
    job_id: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Replan:
    """Ask for the cluster-wide planner on the snapshot this decision leaves.

    A request to the decision layer: :func:`unicornd.decide.resolve` replaces it with the
    transition to the new plan (:func:`unicornd.replan.replan_decision`) before commit."""

    kind: ClassVar[str] = "replan"
    action_id: str
    reason: str


@dataclass(frozen=True)
class NotifyOperator:
    """Tell the operator (log at error, incident stream, ``unicornctl status``)."""

    kind: ClassVar[str] = "notify_operator"
    action_id: str
    incident_id: str | None
    why: str


@dataclass(frozen=True)
class CloseIncident:
    """Record the incident as closed (append to the incidents stream)."""

    kind: ClassVar[str] = "close_incident"
    action_id: str
    incident_id: str


REQUESTS: Final = (Replan, RestartAgent, RollBack)
"""Action kinds that :func:`unicornd.decide.resolve` replaces before commit."""

Action: TypeAlias = (
    DrainNode
    | ResumeNode
    | CheckNode
    | SendCommand
    | LaunchAgents
    | RestartAgent
    | RollBack
    | Shrink
    | Grow
    | Requeue
    | Replan
    | NotifyOperator
    | CloseIncident
)

ACTION_TYPES: Final[Mapping[str, type[Action]]] = {
    cls.kind: cls
    for cls in (
        DrainNode,
        ResumeNode,
        CheckNode,
        SendCommand,
        LaunchAgents,
        RestartAgent,
        RollBack,
        Shrink,
        Grow,
        Requeue,
        Replan,
        NotifyOperator,
        CloseIncident,
    )
}


def action_to_dict(action: Action) -> dict[str, Any]:
    """Plain JSON types with the tag ``kind``; :func:`action_from_dict` inverts it."""
    out = msgspec.json.decode(msgspec.json.encode(action))
    assert isinstance(out, dict)
    return {"kind": action.kind, **out}


def action_from_dict(data: object) -> Action:
    """Raises ProtocolError for an unknown ``kind``, a missing or mistyped field."""
    if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str):
        raise ProtocolError("invalid", f"action: expected an object with a string `kind`, got {data!r:.200}")
    cls = ACTION_TYPES.get(data["kind"])
    if cls is None:
        raise ProtocolError("unknown_type", f"action kind {data['kind']!r}; known: {', '.join(ACTION_TYPES)}")
    body = {k: v for k, v in data.items() if k != "kind"}
    try:
        return msgspec.convert(body, cls)
    except msgspec.ValidationError as exc:
        raise ProtocolError("invalid", f"action {data['kind']}: {exc}") from exc


@dataclass(frozen=True)
class Decision:
    """What one decision produced: actions in execution order, and records to persist.

    ``tasks``/``nodes``/``incidents`` are upserts (records not listed are unchanged);
    ``drop_tasks``/``drop_incidents`` ids of records removed before the upserts (their time
    in the snapshot is over: :meth:`Snapshot.expired`);
    ``notes`` say why, for the log. ``cancels``: id prefixes of owed actions this decision
    voids (not yet started; e.g. the rest of a plan's steps for a job that is requeued
    instead). ``calibration`` replaces the snapshot's (None: unchanged). unicornd persists
    the records, the cancellations and the actions together, then runs the actions, then
    acknowledges the input.
    """

    actions: tuple[Action, ...] = ()
    tasks: tuple[TaskRecord, ...] = ()
    nodes: tuple[NodeRecord, ...] = ()
    incidents: tuple[Incident, ...] = ()
    notes: tuple[str, ...] = ()
    plan_generation: int | None = None
    cancels: tuple[str, ...] = ()
    calibration: Calibration | None = None
    plan_basis: PlanBasis | None = None
    drop_tasks: tuple[str, ...] = ()
    drop_incidents: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ids = [a.action_id for a in self.actions]
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"decision has duplicate action ids: {sorted(ids)}")

    @property
    def empty(self) -> bool:
        """No action and no record changed (a duplicate or irrelevant input)."""
        return not (
            self.actions
            or self.tasks
            or self.nodes
            or self.incidents
            or self.cancels
            or self.calibration is not None
            or self.plan_basis is not None
            or self.drop_tasks
            or self.drop_incidents
        )

    def then(self, later: Decision) -> Decision:
        """This decision followed by ``later`` (decided on the snapshot this one leaves):
        actions in order, records upserted with ``later``'s winning."""

        def merged(
            a: tuple[Any, ...], b: tuple[Any, ...], key: str, dropped: tuple[str, ...] = ()
        ) -> tuple[Any, ...]:
            out = {getattr(r, key): r for r in a if getattr(r, key) not in dropped}
            out.update({getattr(r, key): r for r in b})
            return tuple(out.values())

        return Decision(
            actions=(*self.actions, *(a for a in later.actions if a.action_id not in self.action_ids())),
            tasks=merged(self.tasks, later.tasks, "task_id", later.drop_tasks),
            nodes=merged(self.nodes, later.nodes, "name"),
            incidents=merged(self.incidents, later.incidents, "incident_id", later.drop_incidents),
            notes=(*self.notes, *later.notes),
            plan_generation=later.plan_generation
            if later.plan_generation is not None
            else self.plan_generation,
            cancels=(*self.cancels, *later.cancels),
            calibration=later.calibration if later.calibration is not None else self.calibration,
            plan_basis=later.plan_basis if later.plan_basis is not None else self.plan_basis,
            drop_tasks=(*self.drop_tasks, *later.drop_tasks),
            drop_incidents=(*self.drop_incidents, *later.drop_incidents),
        )

    def action_ids(self) -> tuple[str, ...]:
        return tuple(a.action_id for a in self.actions)

    def applied_to(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` with this decision's records upserted (what a reload after persisting gives)."""
        return snapshot.apply(
            tasks=self.tasks,
            nodes=self.nodes,
            incidents=self.incidents,
            plan_generation=self.plan_generation,
            calibration=self.calibration,
            plan_basis=self.plan_basis,
            drop_tasks=self.drop_tasks,
            drop_incidents=self.drop_incidents,
        )


ALLOCATION: Final = "slurm-allocation"
"""The resource every change of Slurm's node allocation holds (drain, resume, shrink, grow,
requeue): they run one at a time, in commit order, because each may free or take a node
another one needs. A requeue onto named nodes holds it only until its job is pending on
them, not through its wait for the job's start (:meth:`unicornd.executor.Executor._requeue`)."""


def resources(action: Action) -> frozenset[str]:
    """What ``action`` touches: two actions that share a resource run in commit order;
    actions that share none may run at the same time. A job's agents (``job:J``) are one
    resource (checkpoint before stop, relaunch after the job's resize); a node's check and
    drain are ordered on ``node:N``."""
    if isinstance(action, DrainNode | ResumeNode):
        return frozenset({ALLOCATION, f"node:{action.node}"})
    if isinstance(action, CheckNode):
        return frozenset({f"node:{n}" for n in (action.node, *action.paired)})
    if isinstance(action, Shrink | Grow | Requeue):
        return frozenset({ALLOCATION, f"job:{action.job_id}"})
    if isinstance(action, SendCommand | LaunchAgents | RestartAgent | RollBack):
        return frozenset({f"job:{action.job_id}"})
    return frozenset()


class OutcomeStatus(enum.StrEnum):
    """How an action ended: ``done``; ``failed`` (a typed error: the command's exit code and
    output, the agent's answer); ``timed_out`` (its deadline passed first); ``unsupported``
    (Slurm cannot do it here, e.g. growing a job that holds GRES)."""

    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Outcome:
    """The result of one action, an input to :func:`unicornd.decide.on_outcome`.

    ``action_id`` is the action's (for an agent command: the ``command_id`` the agent
    echoed). ``kind`` is the action's kind, or ``agent_command`` for an agent's answer
    (a :class:`SendCommand` is *done* once written; its effect is the agent's answer).
    ``detail`` carries the error (command, exit code, output) or the agent's text.
    ``nodes``: the nodes a failed node check found at fault (its own node; for a paired
    check the nodes it convicted, possibly none when it could not tell).
    """

    action_id: str
    kind: str
    status: OutcomeStatus
    detail: str = ""
    node: str = ""
    nodes: tuple[str, ...] = ()

    AGENT_COMMAND: ClassVar[str] = "agent_command"

    @property
    def ok(self) -> bool:
        return self.status is OutcomeStatus.DONE
