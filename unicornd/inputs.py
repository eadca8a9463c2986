"""unicornd's inputs from agents, Slurm and the clock, each turned into one pure decision.

- :class:`AgentInputs`: each job's ``events`` stream (heartbeats, exits, exceptions, GPU
  events, iterations -> the detector -> findings, progress, nodes finished) and its
  ``cmd-results`` stream (each agent's answer to a command -> an
  :class:`~unicornd.actions.Outcome`), both read through the coordinator's consumer group;
- :class:`SlurmWatch`: one poll of nodes and jobs a second (a node back, drained outside
  unicorn; a task's job ended; a requeued job running again; which jobs hold each node).
  :func:`observe` is the one place Slurm's nodes enter unicornd: only the nodes in
  ``[slurm]``'s scope (:mod:`unicorn_core.slurm.scope`) pass, with the jobs on each;
- :class:`Ticker`: silence becomes findings (lost agents, hangs), stage and requeue
  deadlines pass, progress held in memory is committed.

A silent agent is confirmed out of band (SSH, :mod:`unicornd.oob`) before it is decided
on, when ``[ssh] enabled``: the probe's verdict is the input.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Final

from detect.isolation import Confirmation
from detect.statuses import ErrorStatus, Severity
from unicorn_core import redis_io
from unicorn_core.config import Config
from unicorn_core.errors import UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import get_logger
from unicorn_core.protocol import (
    CommandResult,
    IterationPhase,
    IterationTiming,
    Message,
    ProcessExit,
)
from unicorn_core.slurm.backend import SlurmBackend
from unicorn_core.slurm.scope import Scope, jobs_by_node
from unicorn_core.slurm.types import JobInfo, JobState, NodeInfo, NodeState
from unicornd import decide, oob, seed
from unicornd.actions import Decision, Outcome, OutcomeStatus
from unicornd.agentusers import AgentUsers
from unicornd.calibrate import IterationSample
from unicornd.core import Core
from unicornd.decide import ClassificationLike
from unicornd.detector import Detector, JobEvidence
from unicornd.replan import PLANNED_STATES
from unicornd.state import LIVE_TASK_STATES, NodeHealth, Snapshot

log = get_logger(__name__)

TICK_S: Final = 0.05
SLURM_POLL_S: Final = 1.0
RESERVATION_REFRESH_S: Final = 30.0
"""How often :func:`observe` reads the ``[slurm] reservation``'s nodes again (one more
slurmctld RPC; a reservation changes rarely, the poll runs every second)."""
NVML_CONFIRMS: Final = frozenset({"gpu_ecc_uncorrectable", "gpu_retired_pages", "gpu_remapped_rows"})
"""Rules of NVML readings that confirm a node fault by themselves (see :mod:`detect.isolation`)."""


def _nvml_confirms(c: ClassificationLike) -> bool:
    """An NVML reading that shows the GPU is faulty: uncorrectable memory errors, or an Xid
    NVIDIA's catalogue rates as needing the node taken out (SEV1)."""
    return c.rule in NVML_CONFIRMS or (c.rule.startswith("xid_") and c.severity is Severity.SEV1)


def entry_time(entry_id: str) -> float:
    """The time of a stream entry: Redis stamps its id with its clock in ms when it is added.

    Decisions on an entry use it (never later than now), so an entry delivered again
    after a crash is decided at the same time as the first time: the restarted daemon
    decides exactly as the uninterrupted one. (Redis runs beside unicornd on the head
    node; a Redis clock ahead of ours is capped at ours.)
    """
    try:
        stamped = int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return time.time()
    return min(stamped, time.time())


@dataclass(frozen=True)
class NodeView:
    """One look at Slurm through the scope: ``nodes`` in scope, ``outside`` the others,
    every job, and ``held``: the jobs holding each node in scope (none: absent)."""

    nodes: tuple[NodeInfo, ...]
    outside: tuple[NodeInfo, ...]
    jobs: tuple[JobInfo, ...]
    held: Mapping[str, tuple[int, ...]]


async def observe(slurm: SlurmBackend, scope: Scope) -> tuple[NodeView, Scope]:
    """Nodes and jobs as unicornd may see them: the one place nodes enter its snapshot.

    A reservation's nodes are read again every :data:`RESERVATION_REFRESH_S` (they change
    while it lasts); the scope with them is returned. A reservation that cannot be read
    again (it ended, slurmctld refused) keeps the nodes last read, logged: losing it must not
    stop the poll (jobs ending, nodes lost) nor widen the scope. Raises the adapter's errors
    for the nodes and jobs, or for a reservation never read (the caller skips the poll).
    """
    nodes = await slurm.list_nodes()
    jobs = await slurm.list_jobs()
    mono = time.monotonic()
    if scope.reservation and (scope.reserved_s is None or mono - scope.reserved_s >= RESERVATION_REFRESH_S):
        try:
            reserved = frozenset(await slurm.reservation_nodes(scope.reservation))
            scope = replace(scope, reserved=reserved, reserved_s=mono)
        except UnicornError as e:
            if scope.reserved is None:
                raise
            log.warning(
                "reservation_unreadable",
                reservation=scope.reservation,
                kept=len(scope.reserved),
                error=str(e),
            )
            scope = replace(scope, reserved_s=mono)
    inside, outside = scope.split(nodes)
    names = {n.name for n in inside}
    held = {node: ids for node, ids in jobs_by_node(jobs).items() if node in names}
    return NodeView(tuple(inside), tuple(outside), tuple(jobs), held), scope


class AgentInputs:
    """Handles one entry of a job's ``events`` or ``cmd-results`` stream."""

    def __init__(self, cfg: Config, core: Core, detector: Detector) -> None:
        self.cfg = cfg
        self.core = core
        self.detector = detector
        self.keys = RedisKeys(cfg.redis.key_prefix)
        self.probes: dict[tuple[int, str, int], asyncio.Task[None]] = {}
        """Probes in flight, by (job, node, agent epoch): one per agent at a time; a new agent
        launched meanwhile gets its own (the old one's verdict is dropped)."""

    def streams(self, forgotten: set[int]) -> list[str]:
        """The events and command-results streams of every job a known task holds (its agents
        write only there), but those of jobs whose streams are gone for good."""
        snap = self.core.snap
        jobs = sorted({t.job_id for t in snap.tasks.values() if t.job_id is not None} - forgotten)
        return [s for j in jobs for s in (self.keys.events(j), self.keys.command_results(j))]

    async def on_message(self, msg: Message, now_mono: float, entry_id: str, stream: str) -> None:
        now = entry_time(entry_id)
        if isinstance(msg, CommandResult) and stream == self.keys.command_results(msg.job_id):
            status = OutcomeStatus.DONE if msg.ok else OutcomeStatus.FAILED
            outcome = Outcome(msg.command_id, Outcome.AGENT_COMMAND, status, msg.detail, msg.node)
            if not msg.ok:
                log.warning(
                    "agent_command_failed", command_id=msg.command_id, node=msg.node, detail=msg.detail
                )
                self.detector.command_failed(msg.command_id, msg.node or None)
            await self.core.decide(now, lambda s: decide.on_outcome(s, outcome, now))
            return
        if stream != self.keys.events(msg.job_id):
            # Each job's agents may write only their job's streams (Redis ACL); a message
            # there about another job, or of the wrong kind, is forged or misrouted.
            log.warning(
                "event_wrong_stream", id=entry_id, stream=stream, job_id=msg.job_id, type=type(msg).__name__
            )
            return
        found = self.detector.on_message(msg, now_mono)
        if isinstance(msg, IterationTiming):
            task = self.core.snap.task_of_job(msg.job_id)
            if task is not None:
                tid, it, at, lid = task.task_id, msg.iteration, msg.wall_time_s, msg.launch_id
                plan = self.core.ctx.plan
                # Training steps only: a save or an evaluation is not the layout's speed.
                sample = (
                    IterationSample(msg.duration_s, msg.span, self.core.ctx.gpu.name)
                    if msg.phase is IterationPhase.TRAIN and msg.duration_s > 0
                    else None
                )
                # reported_s: when the rank finished the iteration (its wall clock), so an
                # iteration finished before a recovery action does not count as its success.
                await self.core.decide(
                    now,
                    lambda s: decide.on_progress(
                        s, tid, it, now, reported_s=at, launch_id=lid, sample=sample, plan=plan
                    ),
                )
        elif (
            isinstance(msg, ProcessExit)
            and msg.rank is None
            and msg.exit_code == 0
            and not self.detector.replaced(msg.job_id, msg.node, msg.launch_id)
        ):  # a replaced launch's torchrun may end 0 (its SIGTERM save): not this launch's end
            job, node = msg.job_id, msg.node
            await self.core.decide(now, lambda s: decide.on_node_finished(s, job, node, now))
        for jf in found:
            await self.on_finding(jf, finding_id=f"{entry_id}:{jf.evidence.source}", now_s=now)

    async def on_finding(self, jf: JobEvidence, finding_id: str, now_s: float | None = None) -> None:
        """Decide on a finding (``now_s``: its input's time; default: now)."""
        f = jf.evidence
        node = f.node
        task = self.core.snap.task_of_job(jf.job_id)
        if not node and task is not None and task.nodes:
            node = task.nodes[0]  # a task-level hang whose stopped rank's node is unknown
        if not node:
            return
        if jf.straggler is not None:  # sub-healthy: replaced or reported on its numbers
            await self._decide_straggler(decide.StragglerFinding(finding_id, jf.job_id, jf.straggler), now_s)
            return
        if f.source == "heartbeat":
            age = await self._beat_age(jf.job_id, node)
            if age is not None and age < self.cfg.detect.heartbeat_timeout_s:
                # Found by the scale bench: with the events stream read late (a backlog),
                # live agents looked silent and their tasks were restarted.
                log.info(
                    "silence_not_confirmed",
                    job_id=jf.job_id,
                    node=node,
                    beat_age_s=round(age, 3),
                    why="the agent's heartbeat key is fresh: its beats wait in the events stream",
                )
                return
        if f.source == "heartbeat" and self.cfg.ssh.enabled and node in self.core.snap.nodes:
            self._probe(jf, node, finding_id)  # never a node outside the scope
            return
        epoch = jf.agent_epoch if f.source == "heartbeat" else None
        await self._decide_finding(jf, node, finding_id, jf.classification, now_s, epoch=epoch)

    async def _decide_straggler(self, found: decide.StragglerFinding, now_s: float | None) -> None:
        s = found.straggler
        log.warning(
            "straggler",
            job_id=found.job_id,
            node=s.node,
            rank=s.rank,
            ratio=round(s.ratio, 3),
            recovered=s.recovered,
            windows=s.windows,
        )
        now = time.time() if now_s is None else now_s
        plan = self.core.ctx.plan
        await self.core.decide(now, lambda snap: decide.on_straggler(snap, found, now, plan=plan))

    async def _beat_age(self, job_id: int, node: str) -> float | None:
        """Seconds since the agent's newest heartbeat as its heartbeat key holds it (the agent
        sets the key with each beat, beside the stream entry; it expires after
        ``agent.heartbeat_ttl_s``). None when the key is gone or unreadable: then the
        silence stands. Wall clocks: an agent clock behind by more than the timeout only
        makes this check never spare it; one ahead by more than the timeout is not
        believed (None)."""
        key = self.keys.heartbeat(job_id, node)
        try:
            raw = await redis_io.call(("GET", key), self.core.store.client.get(key))
            msg = None if raw is None else seed.decode_beat(raw, (job_id, node))
        except UnicornError as e:
            log.warning("heartbeat_key_unreadable", job_id=job_id, node=node, error=str(e))
            return None
        if msg is None:
            return None
        age = time.time() - msg.wall_time_s
        if age < -self.cfg.detect.heartbeat_timeout_s:
            # The agent's clock is ahead by more than the timeout: its stamps say nothing
            # of how long ago it beat, so they never spare a silence.
            log.warning("heartbeat_clock_ahead", job_id=job_id, node=node, ahead_s=round(-age, 3))
            return None
        return age

    def _probe(self, jf: JobEvidence, node: str, finding_id: str) -> None:
        """Confirm a silent agent out of band (SSH) before deciding; one probe per agent at a time."""
        epoch = jf.agent_epoch  # as the silence was found: a launch since then replaced that agent
        key = (jf.job_id, node, epoch)
        if key in self.probes:
            return

        async def confirm() -> None:
            log.info("probing", job_id=jf.job_id, node=node, why=jf.classification.evidence)
            try:
                try:
                    result = await oob.probe_node(self.cfg.ssh, self.cfg.agent, node, jf.job_id)
                    found = oob.verdict(result, jf.classification.evidence, self.detector.classifier)
                    confirmed_by = oob.confirmation(result, found)
                    log.warning(
                        "probe",
                        job_id=jf.job_id,
                        node=node,
                        reachable=result.reachable,
                        agents=list(result.agent_states),
                        kernel_lines=len(result.kernel_lines),
                        rule=found.rule,
                        confirmed_by=confirmed_by or "-",
                        s=round(result.elapsed_s, 3),
                    )
                except Exception as e:  # a broken probe must not hide the silence (nor confirm it)
                    log.error("probe_failed", job_id=jf.job_id, node=node, error=repr(e))
                    found, confirmed_by = jf.classification, ""
                why = "" if confirmed_by else await self.silence_over(jf.job_id, node, epoch)
                if why:
                    log.info("silence_not_confirmed", job_id=jf.job_id, node=node, rule=found.rule, why=why)
                    return
                await self._decide_finding(
                    jf,
                    node,
                    f"{finding_id}:probe",
                    found,
                    confirmed_by=confirmed_by,
                    epoch=None if confirmed_by else epoch,
                )
            finally:  # also when cancelled mid-probe: the entry never outlives its task
                self.probes.pop(key, None)

        self.probes[key] = asyncio.create_task(confirm(), name=f"probe-{node}-{jf.job_id}")

    async def silence_over(self, job_id: int, node: str, epoch: int) -> str:
        """Why a silence a probe did not confirm no longer stands (empty: it does): the agent
        was launched or stopped on purpose since the silence was found (``epoch``:
        :meth:`~unicornd.detector.Detector.agent_epoch` then), or it has beaten since. The
        probe's verdict was about an agent that is gone or alive, and a restart would harm a
        healthy job. A confirmed node fault (no SSH answer, a kernel fault line) stands:
        it is the node's, not the agent's."""
        if self.detector.agent_epoch(job_id, node) != epoch:
            return "the agent was launched or stopped on purpose while it was probed"
        age = await self._beat_age(job_id, node)
        if age is not None and age < self.cfg.detect.heartbeat_timeout_s:
            return f"the agent beat {age:.3g} s ago, while it was probed"
        return ""

    async def _decide_finding(
        self,
        jf: JobEvidence,
        node: str,
        finding_id: str,
        classification: ClassificationLike,
        now_s: float | None = None,
        *,
        confirmed_by: str = "",
        epoch: int | None = None,
    ) -> None:
        """Decide on ``classification``. ``epoch``: for an unconfirmed silence, the agent's
        epoch when it was found; checked again under the decision lock, since a decision
        committed while this one waited for the lock (a replan's relaunch) may have replaced
        the agent the silence was about."""
        f = jf.evidence
        if f.source == "gpu" and _nvml_confirms(classification):
            # The device's own report of a fault it does not recover from. Corrected link
            # errors, temperature and an unreadable GPU go through the node check instead.
            confirmed_by = Confirmation.NVML
        finding = decide.Finding.of(
            classification,
            finding_id=finding_id,
            job_id=jf.job_id,
            node=node,
            rank=f.rank,
            rank_died=f.source == "exit",
            confirmed_by=confirmed_by,
            iteration=jf.iteration,
            span=jf.span,
            launch_id=jf.launch_id,
            current_launch=jf.current_launch,
        )
        if finding is None:
            return
        log.warning(
            "finding",
            job_id=jf.job_id,
            node=node,
            rank=f.rank,
            status=str(finding.status),
            severity=str(finding.severity),
            rule=finding.rule,
            source=f.source,
            confirmed_by=confirmed_by or "-",
        )
        now = time.time() if now_s is None else now_s
        job_id = jf.job_id

        def on_finding(snap: Snapshot) -> Decision:
            if epoch is not None and self.detector.agent_epoch(job_id, node) != epoch:
                log.info(
                    "silence_not_confirmed",
                    job_id=job_id,
                    node=node,
                    why="the agent was launched or stopped on purpose before the decision",
                )
                return Decision()
            return decide.on_finding(snap, finding, now)

        await self.core.decide(now, on_finding)


class SlurmWatch:
    """Polls Slurm once a second and turns what changed into decisions."""

    def __init__(
        self,
        core: Core,
        slurm: SlurmBackend,
        agent_users: AgentUsers,
        detector: Detector | None = None,
        scope: Scope | None = None,
    ) -> None:
        self.core = core
        self.slurm = slurm
        self.agent_users = agent_users
        self.detector = detector
        self.scope = scope or Scope()

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(SLURM_POLL_S)

    async def poll(self) -> None:
        observed = time.time()
        try:
            view, self.scope = await observe(self.slurm, self.scope)
        except UnicornError as e:
            log.warning("slurm_unavailable", error=str(e))
            return
        jobs = {j.job_id: j for j in view.jobs}
        core = self.core
        now = time.time()
        # Jobs and Slurm's down nodes first: a join's (or a retyped node's) replan must see
        # which nodes other users' jobs hold now, and which Slurm holds down.
        await self._node_jobs(view.held, now)
        await self._node_down(view.nodes, now)
        await self._node_gpus(view.nodes, now)
        await self._nodes(view.nodes, now, view.held)
        await self._node_jobs(view.held, now)  # the nodes that joined just now
        await self._node_down(view.nodes, now)
        render = core.ctx.render_for
        for task in list(core.snap.tasks.values()):
            if task.job_id is None or task.state not in PLANNED_STATES:
                continue
            job = jobs.get(task.job_id)
            if task.requeue is not None:
                if job is not None and job.state is JobState.RUNNING:
                    by_generation = partial(render, core.snap.gpus_per_node_of(task))
                    running = partial(
                        decide.on_job_running,
                        job_id=task.job_id,
                        observed_s=observed,
                        now_s=now,
                        render=by_generation,
                    )
                    await core.decide(now, running)
                continue  # a requeued job is PENDING or COMPLETING on its way back
            if job is None or job.state.finished:
                ok = job is not None and job.state is JobState.COMPLETED
                log.info("task_job_ended", task=task.task_id, job_id=task.job_id, ok=ok)
                if job is not None and job.state is JobState.CANCELLED:  # scancel: the user's stop
                    await core.decide(
                        now,
                        partial(decide.on_task_stop, task_id=task.task_id, now_s=now, why="job cancelled"),
                    )
                else:
                    await core.decide(
                        now, partial(decide.on_task_finished, task_id=task.task_id, now_s=now, ok=ok)
                    )
        try:
            await self.agent_users.forget_gone(core.snap, jobs)
        except UnicornError as e:
            log.warning("agent_user_cleanup_failed", error=str(e))

    async def _node_jobs(self, held: Mapping[str, tuple[int, ...]], now: float) -> None:
        core = self.core
        if any(rec.jobs != held.get(name, ()) for name, rec in core.snap.nodes.items()):
            await core.decide(now, partial(decide.on_node_jobs, jobs=held, now_s=now))

    async def _node_gpus(self, nodes: Sequence[NodeInfo], now: float) -> None:
        """Known nodes whose GRES changed (a site retyped them): decided only then."""
        snap = self.core.snap
        facts = {n.name: (n.gpus, n.gpu_type) for n in nodes}
        if any((rec.gpus, rec.gpu_type) != facts[name] for name, rec in snap.nodes.items() if name in facts):
            await self.core.decide(now, partial(decide.on_node_gpus, gpus=facts, now_s=now))

    async def _nodes(
        self, nodes: Sequence[NodeInfo], now: float, held: Mapping[str, tuple[int, ...]] | None = None
    ) -> None:
        """Nodes that joined, were drained outside unicorn, or stopped responding.

        A node that other users' jobs hold (``held``, less the tasks' jobs) joins only once
        they left: its join check would wait for their allocation, fail, and leave it out
        of every plan; it is neither checked nor taken meanwhile (a known one stays drained,
        a new one stays unknown)."""
        core = self.core
        ours = {t.job_id for t in core.snap.tasks.values() if t.job_id is not None}
        for info in nodes:
            rec = core.snap.nodes.get(info.name)
            if rec is None or (info.usable and rec.health is NodeHealth.DRAINED):
                others = [j for j in (held or {}).get(info.name, ()) if j not in ours]
                if others:
                    log.debug("join_deferred", node=info.name, other_jobs=others)
                    continue
                kind = (info.gpus, info.gpu_type)
                join = partial(
                    decide.on_node_join, node=info.name, now_s=now, gpus=kind, slurm_down=_down(info)
                )
                await core.decide(now, join)
            elif not info.usable and info.drained and rec.health in (NodeHealth.HEALTHY, NodeHealth.DRAINING):
                await core.decide(
                    now, partial(decide.on_node_drained, node=info.name, now_s=now, reason=info.reason)
                )
        for info in nodes:
            if _down(info):
                await self._silent_and_not_responding(info, now)

    async def _node_down(self, nodes: Sequence[NodeInfo], now: float) -> None:
        """Known nodes Slurm now holds down (NOT_RESPONDING or DOWN), or up again: decided only then."""
        core = self.core
        down = frozenset(info.name for info in nodes if _down(info))
        polled = frozenset(info.name for info in nodes)
        if any(rec.slurm_down != (name in down) for name, rec in core.snap.nodes.items() if name in polled):
            await core.decide(now, partial(decide.on_node_slurm_down, polled=polled, down=down, now_s=now))

    async def _silent_and_not_responding(self, info: NodeInfo, now: float) -> None:
        """Slurm's view confirms a lost agent: its node is NOT_RESPONDING or DOWN while the
        agent of a live task there is silent past its heartbeat timeout. Both together are
        a confirmed node loss (:mod:`detect.isolation`); either alone is not (slurmd can
        die on a node that trains on, and an agent can die on a node that is fine)."""
        core = self.core
        rec = core.snap.nodes.get(info.name)
        task = core.snap.owner(info.name)
        if rec is None or rec.health not in (NodeHealth.HEALTHY, NodeHealth.SUSPECT):
            return
        if (
            task is None
            or task.job_id is None
            or task.state not in LIVE_TASK_STATES
            or task.requeue is not None
        ):
            return
        if self.detector is None or not self.detector.silent(task.job_id, info.name, time.monotonic()):
            return
        flags = ",".join(sorted(info.flags)) or "-"
        finding = decide.Finding(
            finding_id=f"slurm:{info.name}:{rec.joins}:{task.job_id}",
            job_id=task.job_id,
            node=info.name,
            rank=None,
            status=ErrorStatus.LOST_CONNECTION,
            severity=Severity.SEV1,
            rule=decide.SLURM_NOT_RESPONDING,
            evidence=f"slurmctld: {info.name} {info.state} ({flags}) {info.reason}; agent silent",
            confirmed_by=Confirmation.SLURM,
        )
        log.warning("finding", job_id=task.job_id, node=info.name, rule=finding.rule, confirmed_by="slurm")
        await core.decide(now, partial(decide.on_finding, finding=finding, now_s=now))


def _down(info: NodeInfo) -> bool:
    """slurmctld holds ``info`` down: NOT_RESPONDING, or DOWN."""
    return not info.responding or info.state is NodeState.DOWN


class Ticker:
    """Silence into findings every :data:`TICK_S`; deadlines and a flush every second."""

    def __init__(
        self, core: Core, detector: Detector, on_finding: Callable[[JobEvidence, str], object]
    ) -> None:
        self.core = core
        self.detector = detector
        self.on_finding = on_finding

    async def run(self) -> None:
        last_tick = 0.0
        while True:
            await asyncio.sleep(TICK_S)
            found: Sequence[JobEvidence] = self.detector.check(time.monotonic())
            for jf in found:
                fid = f"{jf.evidence.source}:{jf.job_id}:{jf.evidence.node}:{time.time():.3f}"
                await self.on_finding(jf, fid)  # type: ignore[misc]
            now = time.time()
            if now - last_tick >= 1.0:
                last_tick = now
                await self.core.decide(now, partial(decide.on_tick, now_s=now))
                await self.core.decide(now, partial(decide.on_basis_due, now_s=now))
                await self.core.flush()
