"""Actions the decision functions ask for, and the :class:`Decision` that carries them.

An action is a frozen value; the executor (the only code that calls Slurm or writes
agent commands) performs it. Every action has an ``action_id`` derived from what caused
it (incident id + ladder step, plan generation + task + step, node + join count), never
from a clock or a counter in memory. So deciding twice on the same snapshot and input
gives the same ids, and a restarted executor skips every id in its done set
(``RedisKeys.actions_done()``): no node is drained twice, no restart is sent twice.

Order matters: the executor performs a decision's actions in tuple order (a JIT
checkpoint before the stop, a shrink before the grow that takes the freed node).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, TypeAlias

import msgspec

from unicorn_core.errors import InvalidArgument, ProtocolError
from unicorn_core.protocol import AgentAction, AgentCommand
from unicornd.state import Incident, NodeRecord, Snapshot, TaskRecord


@dataclass(frozen=True)
class DrainNode:
    """``scontrol update nodename=NODE state=drain reason=REASON``.

    ``down``: the node is confirmed dead (unreachable over SSH); it is first set DOWN, which
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
    """Run the node check on a returning node; its outcome goes to ``on_node_check``."""

    kind: ClassVar[str] = "check_node"
    action_id: str
    node: str


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

    def message(self, wall_time_s: float) -> AgentCommand:
        """The wire message; its ``command_id`` is this action's id (echoed in the result)."""
        return AgentCommand(
            job_id=self.job_id,
            node=self.node,
            wall_time_s=wall_time_s,
            command_id=self.action_id,
            action=self.action,
            argv=list(self.argv),
            env=dict(self.env),
            deadline_s=self.deadline_s,
        )


@dataclass(frozen=True)
class NodeArgv:
    """The training command for one node (torchrun's argv differs per node rank)."""

    node: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class LaunchAgents:
    """``srun --jobid=J -w NODE --overlap unicorn-agent ... -- ARGV`` on each node of ``commands``."""

    kind: ClassVar[str] = "launch_agents"
    action_id: str
    task_id: str
    job_id: int
    commands: tuple[NodeArgv, ...]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(c.node for c in self.commands)


@dataclass(frozen=True)
class RestartAgent:
    """Start a new agent for ``job_id`` on ``node``, whose agent is gone while the node is up
    (the SSH probe said so), with the task's current training argv for that node."""

    kind: ClassVar[str] = "restart_agent"
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
    """Run the cluster-wide planner on a fresh snapshot, then ``plan_transition``."""

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


Action: TypeAlias = (
    DrainNode
    | ResumeNode
    | CheckNode
    | SendCommand
    | LaunchAgents
    | RestartAgent
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
    ``notes`` say why, for the log. unicornd persists the records and the actions
    together, then runs the actions, then acknowledges the input.
    """

    actions: tuple[Action, ...] = ()
    tasks: tuple[TaskRecord, ...] = ()
    nodes: tuple[NodeRecord, ...] = ()
    incidents: tuple[Incident, ...] = ()
    notes: tuple[str, ...] = ()
    plan_generation: int | None = None

    def __post_init__(self) -> None:
        ids = [a.action_id for a in self.actions]
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"decision has duplicate action ids: {sorted(ids)}")

    @property
    def empty(self) -> bool:
        """No action and no record changed (a duplicate or irrelevant input)."""
        return not (self.actions or self.tasks or self.nodes or self.incidents)

    def action_ids(self) -> tuple[str, ...]:
        return tuple(a.action_id for a in self.actions)

    def applied_to(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` with this decision's records upserted (what a reload after persisting gives)."""
        return snapshot.apply(
            tasks=self.tasks, nodes=self.nodes, incidents=self.incidents, plan_generation=self.plan_generation
        )
