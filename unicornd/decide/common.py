"""Shared by the decision modules: findings, the draft a decision builds, action ids, drain reasons."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Final, Protocol

from detect.isolation import Verdict, verdict
from detect.statuses import ErrorStatus, Severity, worst
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import AgentAction
from unicornd.actions import (
    Action,
    Decision,
    SendCommand,
)
from unicornd.state import (
    Calibration,
    Incident,
    LadderStage,
    NodeRecord,
    Snapshot,
    TaskRecord,
)

_L = LadderStage

AGENT_LOST: Final = "agent_lost"
AGENT_SILENT: Final = "agent_silent"
HEARTBEAT_TIMEOUT: Final = "heartbeat_timeout"
AGENT_RULES: Final = frozenset({AGENT_LOST, AGENT_SILENT, HEARTBEAT_TIMEOUT, "probe_denied", "probe_failed"})
"""Rules of a silent agent (:mod:`unicornd.oob`; ``heartbeat_timeout`` when nothing
confirmed the node dead): its restart rung starts a new agent there instead of
commanding the gone one. If the node is in fact dead, that start fails and Slurm's or
the probe's confirmation isolates it."""
SSH_UNREACHABLE: Final = "ssh_unreachable"
"""The out-of-band probe could not reach the node: dead, its drain sets it DOWN first."""
SLURM_NOT_RESPONDING: Final = "slurm_not_responding"
"""slurmctld reports the node NOT_RESPONDING or DOWN while its agent is silent: dead."""
DEAD_NODE_RULES: Final = frozenset({SSH_UNREACHABLE, SLURM_NOT_RESPONDING})
"""Rules that confirm a node dead by a second source: its drain sets it DOWN first, what
slurmctld does by itself only after ``SlurmdTimeout``. A job must lose the node before
unicorn requeues it: Slurm 22.05 starts a job requeued while a node of it still completes
with an empty GRES allocation (``_step_get_gres_cnt JobId=J node offset invalid``), and
every step of it then fails ("Invalid generic resource (gres) specification")."""


RUNG_OF_SEVERITY: Final[dict[Severity, LadderStage]] = {
    Severity.SEV3: _L.RETRY_IN_PLACE,
    Severity.SEV2: _L.RESTART_PROCESSES,
    Severity.SEV1: _L.ISOLATE,
}
"""The first rung a finding of each severity asks for."""

RUNG_LEVEL: Final[dict[LadderStage, int]] = {
    _L.DETECTED: 0,
    _L.RETRY_IN_PLACE: 1,
    _L.RESTART_PROCESSES: 2,
    _L.TRANSITION: 2,  # a relaunch: findings up to SEV2 right after it are its consequences
    _L.ISOLATE: 3,
    _L.REPLAN: 3,
}

ROLLBACK_STATUSES: Final = frozenset({ErrorStatus.NAN_LOSS, ErrorStatus.LOSS_SPIKE})
"""Training-state findings that roll the task back past the bad data instead of restarting
it from its newest state (issue 23): that state has already learned from the bad batch."""

WAITING_FOR_PLAN: Final = frozenset({_L.ISOLATE, _L.REPLAN})
AWAITING_PROGRESS: Final = frozenset({_L.RETRY_IN_PLACE, _L.RESTART_PROCESSES, _L.TRANSITION})
UNPRINTABLE: Final = re.compile(r"[^\x20-\x7e]+")
EVIDENCE_CHARS: Final = 500


class ClassificationLike(Protocol):
    """What :meth:`Finding.of` reads from a ``detect`` classification."""

    @property
    def status(self) -> ErrorStatus: ...
    @property
    def severity(self) -> Severity | None: ...
    @property
    def rule(self) -> str: ...
    @property
    def evidence(self) -> str: ...
    @property
    def secondary(self) -> bool: ...


@dataclass(frozen=True)
class Finding:
    """A classified fault, as the event ingest hands it to :func:`on_finding`.

    ``finding_id`` identifies the evidence (e.g. the stream entry id): the same finding
    delivered twice has the same id and the second delivery changes nothing.
    ``job_id`` None means evidence from outside a job (e.g. an SSH probe found the node
    dead). ``rank_died``: the rank's process is gone (so a retry must restart it).
    ``secondary``: usually a consequence of a failure elsewhere (peers' NCCL timeouts).
    ``confirmed_by``: the out-of-band source that vouches the node is at fault (a
    :class:`detect.isolation.Confirmation` value; "" for the training's own output and
    unconfirmed silence). Only a confirmed finding can drain a node. ``iteration``,
    ``span``, ``launch_id``: for a finding from an iteration report (loss health), the
    report's iteration, the iterations it covers, and the action that started the
    reporting ranks ("" unknown). ``current_launch``: the report is stamped with the launch
    unicornd last commanded on its node (its ranks were started by it, not replaced by it).
    """

    finding_id: str
    job_id: int | None
    node: str
    rank: int | None
    status: ErrorStatus
    severity: Severity
    rule: str = ""
    evidence: str = ""
    rank_died: bool = False
    secondary: bool = False
    confirmed_by: str = ""
    iteration: int | None = None
    span: int = 1
    launch_id: str = ""
    current_launch: bool = False

    def __post_init__(self) -> None:
        if not self.finding_id:
            raise InvalidArgument("finding_id must be non-empty")
        if not self.node:
            raise InvalidArgument("finding node must be non-empty")
        if self.iteration is not None and (self.iteration < 1 or self.span < 1):
            raise InvalidArgument(
                f"finding iteration and span must be >= 1, got {self.iteration}, {self.span}"
            )

    def bad_iterations(self) -> tuple[int, int] | None:
        """The iterations a training-state finding points at (:data:`ROLLBACK_STATUSES`):
        the report's span ending at its iteration (a Megatron-LM line covers the log
        interval); None for any other finding."""
        if self.status not in ROLLBACK_STATUSES or self.iteration is None:
            return None
        return max(1, self.iteration - self.span + 1), self.iteration

    @classmethod
    def of(
        cls,
        classification: ClassificationLike,
        *,
        finding_id: str,
        job_id: int | None,
        node: str,
        rank: int | None = None,
        rank_died: bool = False,
        confirmed_by: str = "",
        iteration: int | None = None,
        span: int = 1,
        launch_id: str = "",
        current_launch: bool = False,
    ) -> Finding | None:
        """A finding from a classification; None when it is benign (no severity)."""
        if classification.severity is None:
            return None
        return cls(
            finding_id=finding_id,
            job_id=job_id,
            node=node,
            rank=rank,
            status=classification.status,
            severity=classification.severity,
            rule=classification.rule,
            evidence=classification.evidence,
            rank_died=rank_died,
            secondary=classification.secondary,
            confirmed_by=confirmed_by,
            iteration=iteration,
            span=span,
            launch_id=launch_id,
            current_launch=current_launch,
        )


class Draft:
    """The records and actions one decision builds up (local to one call), and its clock."""

    def __init__(self, snapshot: Snapshot, now_s: float) -> None:
        self.snap = snapshot
        self.policy = snapshot.policy
        self.now_s = now_s
        self.tasks: dict[str, TaskRecord] = {}
        self.nodes: dict[str, NodeRecord] = {}
        self.incidents: dict[str, Incident] = {}
        self.actions: list[Action] = []
        self.notes: list[str] = []
        self.cancels: list[str] = []
        self.calibration: Calibration | None = None

    def task(self, task_id: str) -> TaskRecord:
        return self.tasks.get(task_id) or self.snap.tasks[task_id]

    def node(self, name: str) -> NodeRecord:
        return self.nodes.get(name) or self.snap.node(name)

    def put(self, record: TaskRecord | NodeRecord | Incident) -> None:
        if isinstance(record, TaskRecord):
            self.tasks[record.task_id] = record
        elif isinstance(record, NodeRecord):
            self.nodes[record.name] = record
        else:
            self.incidents[record.incident_id] = record

    def stop_agent(self, action_id: str, job_id: int, node: str) -> None:
        """Order the agent of ``job_id`` on ``node`` to stop (ranks save and exit)."""
        self.act(
            SendCommand(
                action_id=action_id,
                job_id=job_id,
                node=node,
                action=AgentAction.STOP,
                deadline_s=self.policy.command_deadline_s,
            )
        )

    def cancel(self, prefix: str) -> None:
        """Void the owed actions whose id starts with ``prefix`` (not yet started)."""
        if prefix not in self.cancels:
            self.cancels.append(prefix)

    def act(self, action: Action) -> None:
        if all(a.action_id != action.action_id for a in self.actions):
            self.actions.append(action)

    def note(self, text: str) -> Decision:
        self.notes.append(text)
        return self.decision()

    def drains_within_window(self) -> int:
        window = self.policy.drain_window_s
        merged = {**self.snap.nodes, **self.nodes}
        return sum(1 for n in merged.values() for t in n.drains_s if self.now_s - t < window)

    def decision(self) -> Decision:
        return Decision(
            actions=tuple(self.actions),
            tasks=tuple(self.tasks.values()),
            nodes=tuple(self.nodes.values()),
            incidents=tuple(self.incidents.values()),
            notes=tuple(self.notes),
            cancels=tuple(self.cancels),
            calibration=self.calibration,
        )


@dataclass(frozen=True)
class Fault:
    """What a rung acts on: the node, the status for the drain reason, and a detail."""

    node: str
    status: str
    detail: str
    rank_died: bool = False
    rule: str = ""
    confirmed_by: str = ""
    bad_iterations: tuple[int, int] | None = None
    """A loss spike's or NaN's iterations (:meth:`Finding.bad_iterations`): its restart rung
    rolls back past them instead of restarting from the newest state."""
    iteration: int = 0

    @classmethod
    def of(cls, finding: Finding) -> Fault:
        rank = "" if finding.rank is None else f" rank {finding.rank}"
        detail = f"{finding.rule}{rank}: {finding.evidence}".strip()
        return cls(
            finding.node,
            finding.status.value,
            detail,
            finding.rank_died,
            finding.rule,
            finding.confirmed_by,
            finding.bad_iterations(),
            finding.iteration or 0,
        )

    @property
    def error_status(self) -> ErrorStatus:
        """``status`` as a Table 1 status (a timeout's status name counts as the hang it is)."""
        try:
            return ErrorStatus(self.status)
        except ValueError:
            return ErrorStatus.TASK_HANG

    def verdict(self) -> Verdict:
        """May this fault drain its node now (:func:`detect.isolation.verdict`)."""
        return verdict(self.error_status, self.confirmed_by)


def recent(times: tuple[float, ...], now_s: float, window_s: float) -> tuple[float, ...]:
    """Timestamps still inside the window (records stay bounded)."""
    return tuple(t for t in times if now_s - t < window_s)


def drain_reason(draft: Draft, status: str, detail: str) -> str:
    """``unicorn: <status> <detail>`` on one printable line, without double quotes, capped."""
    text = UNPRINTABLE.sub(" ", f"unicorn: {status} {detail}")
    text = " ".join(text.replace('"', "'").split())
    return text[: draft.policy.drain_reason_chars]


def remember(draft: Draft, inc: Incident, finding: Finding) -> Incident:
    keep = draft.policy.remembered_findings
    severity = worst((inc.severity, finding.severity)) or inc.severity
    return replace(inc, finding_ids=(*inc.finding_ids, finding.finding_id)[-keep:], severity=severity)


def seen_in(snapshot: Snapshot, finding_id: str) -> Incident | None:
    for inc in snapshot.incidents.values():
        if finding_id in inc.finding_ids:
            return inc
    return None


def step_id(inc: Incident, stage: LadderStage, attempt: int, kind: str, target: str) -> str:
    """Deterministic action id: incident + rung + attempt + what + where."""
    return f"{inc.incident_id}/{stage.value}/{attempt}/{kind}/{target}"
