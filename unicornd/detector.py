"""The coordinator's detector: agent messages and a clock in, classified findings out.

Pure: no I/O. :meth:`Detector.on_message` classifies what an agent reported (an abnormal
exit, an exception, a GPU event, the agent's own fault report), feeds heartbeats and
iteration timings to the trackers and the training numbers of iteration timings to loss
health (:mod:`detect.losshealth`: NaN, loss spike, grad-norm explosion) and their ranks'
compute times to the straggler statistic (:mod:`detect.stragglers`);
:meth:`Detector.check` turns silence into findings (a lost node agent, a task whose
iterations stopped; the agents' heartbeats say how long their ranks waited for a CPU,
so a task starved of CPU is not called hung). Both take the caller's monotonic clock,
so the daemon and tests drive it alike.

A finding is reported once per episode: a lost agent once until it beats again, a
task hang once per stalled iteration (until the stalled ranks advance; another rank
advancing, or stalling behind them, is the same episode).

What the detector expects follows the committed decisions (:meth:`Detector.follow`):
agents launched are expected to beat, ranks (re)started have their timing relearned,
agents stopped or jobs requeued or ended are forgotten. A job whose task waits for its
requeue (``TaskRecord.requeue`` in the committed snapshot) is not heard at all: its
heartbeats and iteration reports come from processes that Slurm ends on purpose, until
unicornd launches its agents again. No executor calls in here.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Final

from detect import (
    SLOW_STEP_TIMEOUT_S,
    Classification,
    Classifier,
    ErrorStatus,
    Evidence,
    HeartbeatTracker,
    IterationMonitor,
    Liveness,
    Severity,
    worst,
)
from detect.classify import NEAREST_RULE
from detect.losshealth import LossHealth, LossHealthConfig, LossSample, named_iteration
from detect.statuses import SECONDARY_BY_DEFAULT
from detect.stragglers import Straggler, StragglerConfig, StragglerMonitor
from unicorn_core.config import AgentConfig, DetectConfig
from unicorn_core.protocol import (
    AgentAction,
    ExceptionReport,
    FaultReport,
    GpuHealthEvent,
    Heartbeat,
    IterationPhase,
    IterationTiming,
    Message,
    ProcessExit,
    SlowStep,
)
from unicornd.actions import Decision, LaunchAgents, Requeue, SendCommand
from unicornd.seed import expected_agents
from unicornd.state import ENDED_STATES, LIVE_TASK_STATES, Snapshot, TaskRecord

BARE_EXIT_RULES: Final = frozenset({"exit_nonzero", "exit_status_unknown", NEAREST_RULE})
"""The classifier's fallbacks for an exit whose own output no rule explains
(:meth:`detect.Classifier.classify_exit`; the nearest labelled line's status is a guess, so
the rank's own exception report still names the cause)."""
EXIT_AFTER_EXCEPTION_S: Final = 30.0
"""An exit this long after the rank's exception (agents' wall clocks) can be the exception's:
Python unwinds, runs atexit handlers and tears down process groups in seconds. An exception
the rank survived (a thread's, reported by the hook's threading.excepthook) is seldom
followed by a bare exit this soon."""

STOPPED: Final = "\x00stopped"
"""The launch id of an agent unicornd stopped on purpose (never a command's id)."""


@dataclass(frozen=True)
class JobEvidence:
    """A :class:`detect.Evidence` seen in one job (task): what the detector hands on; unicornd
    turns it into a :class:`unicornd.decide.Finding` (the ladder's input, with an id)."""

    job_id: int
    evidence: Evidence
    iteration: int | None = None
    """For a finding from an iteration report (loss health): the report's iteration, the
    iterations it covers (``span``) and the launch id of the ranks that sent it. A
    ``nan_loss`` classified from text carries the iteration the text names (span 1, launch
    id unknown)."""
    span: int = 1
    launch_id: str = ""
    straggler: Straggler | None = None
    """For a ``straggler`` finding: the verdict with its numbers (decided by
    :func:`unicornd.decide.on_straggler`, never by the ladder)."""
    agent_epoch: int = 0
    """For a silence (source ``heartbeat``): :meth:`Detector.agent_epoch` when it was found;
    a probe's verdict stands only if it has not changed since."""
    current_launch: bool = False
    """An exit, exception or fault report stamped with the launch this unicornd last
    commanded on its node: the ranks that launch started, not ones it replaced."""

    @property
    def classification(self) -> Classification:
        return self.evidence.classification


@dataclass
class _JobState:
    monitor: IterationMonitor
    hang_reported: int | None = None
    """The stalled iteration of the hang last reported (None: no hang in progress)."""
    last_iteration: int | None = None
    rank_nodes: dict[int, str] = field(default_factory=dict)
    """Which node each rank reported from (a hang names the node of its stopped rank)."""
    final: bool = False
    """A rank reported the run's last iteration: the ranks save and end next."""


@dataclass
class Detector:
    """Findings from agent messages; see the module docstring."""

    detect_cfg: DetectConfig
    agent_cfg: AgentConfig
    classifier: Classifier
    liveness: HeartbeatTracker = field(init=False)
    _jobs: dict[int, _JobState] = field(init=False, default_factory=dict)
    _lost: set[tuple[int, str]] = field(init=False, default_factory=set)
    _loss: dict[int, LossHealth] = field(init=False, default_factory=dict)
    """Per job: loss health (:mod:`detect.losshealth`). Kept across restarts (a spike at
    the same data after a restart is found again without a second warm-up)."""
    _launches: dict[tuple[int, str], str] = field(init=False, default_factory=dict)
    """Per (job, node): the id of the launch or restart this unicornd last commanded there,
    :data:`STOPPED` once it stopped that agent on purpose. Iteration reports stamped with
    another launch id (or from a stopped agent) come from ranks being replaced (they keep
    training until the agent stops them): they are neither timed nor judged, so they
    cannot register a rank the new layout lacks or mark an iteration as seen before the
    new ranks report it. Unknown (e.g. after a takeover): every report counts."""
    _undo: dict[tuple[int, str], tuple[str, str | None, str]] = field(init=False, default_factory=dict)
    """Per (job, node): (the action that last set ``_launches`` there, the value before it,
    the value it set), to put back if that action fails (:meth:`command_failed`): the agent
    then still runs the ranks it was to replace."""
    _agent_epochs: dict[tuple[int, str], int] = field(init=False, default_factory=dict)
    """Per (job, node): a number that changes whenever unicornd launches or stops that
    agent on purpose (:meth:`agent_epoch`); a silence found before it changed was about an
    agent that is no longer there."""
    _epoch_seq: int = field(init=False, default=0)
    stale_reports: int = field(init=False, default=0)
    """Exits, exceptions and fault reports of replaced ranks, dropped (:meth:`replaced`)."""
    _stragglers: dict[int, StragglerMonitor] = field(init=False, default_factory=dict)
    """Per job: the straggler statistic (:mod:`detect.stragglers`), relearned at every
    (re)launch (the layout decides which ranks do the same work)."""
    _reported: dict[int, frozenset[str]] = field(init=False, default_factory=dict)
    """Per job: its nodes with an open straggler report in the committed snapshot; a new
    statistic clears them once they are no longer slow."""

    _unheard: set[int] = field(init=False, default_factory=set)
    """Jobs whose task, in the committed snapshot, waits for a requeue or is not live (held
    pending, or ended: stopped, finished, failed): their heartbeats and iteration reports
    are not heard (:meth:`on_message`); their processes end on purpose. (Bounded like the
    snapshot's tasks, which are kept.) Found by the 4,096-node hour:
    the job is forgotten when its requeue is committed, and a beat of its agents read after
    that (they run until the requeue, which may wait behind other allocation changes, is
    performed) put them back under watch; when the requeue ended them, their silence was
    a finding about processes ended on purpose."""

    _raised: dict[tuple[int, str, int], tuple[str, Classification, float]] = field(
        init=False, default_factory=dict
    )
    """Per (job, node, rank): the launch id, classification and wall time of the last exception
    that rank reported (:meth:`_explained_exit`). One entry per rank at most; a job's go with it."""

    _heard_until_s: float | None = field(init=False, default=None)
    """Every agent event written before this (monotonic) time has been handled
    (:meth:`heard_until`); None: trust the clock (no reader reports its progress)."""

    def __post_init__(self) -> None:
        self.liveness = HeartbeatTracker(
            timeout_s=self.detect_cfg.heartbeat_timeout_s,
            # A freshly launched agent needs time to start Python and connect.
            initial_timeout_s=max(self.detect_cfg.heartbeat_timeout_s, 30.0),
        )

    def _job(self, job_id: int) -> _JobState:
        state = self._jobs.get(job_id)
        if state is None:
            state = self._jobs[job_id] = _JobState(
                IterationMonitor(
                    hang_factor=self.detect_cfg.hang_factor,
                    warmup_iterations=self.detect_cfg.warmup_iterations,
                    max_hang_factor=self.detect_cfg.max_hang_factor,
                    slow_step_timeout_s=SLOW_STEP_TIMEOUT_S,
                )
            )
        return state

    def expect_agent(self, job_id: int, node: str, now_s: float) -> None:
        """An agent was launched for (job, node): its silence from now on counts."""
        self.liveness.expect(job_id, node, now_s)
        self._new_epoch(job_id, node)

    def _agent_launched(self, job_id: int, node: str, now_s: float) -> None:
        """A new agent's launch for (job, node) was committed: a new episode. Its silence
        counts only once the executor performs the launch (:meth:`launching`), after a new
        agent's grace, and a silence found of the agent it replaces (in ``_lost`` until a
        beat) no longer keeps the new one from being watched (a probe's verdict about the
        old agent is dropped: :meth:`agent_epoch`)."""
        self.liveness.forget(job_id, node)
        self._lost.discard((job_id, node))
        self.liveness.expect(job_id, node, now_s, started=False)
        self._new_epoch(job_id, node)

    def launching(self, job_id: int, nodes: Collection[str], launch_id: str, now_s: float) -> None:
        """The executor performs launch ``launch_id`` of the agents of ``job_id`` on ``nodes``
        now: their grace for a first beat starts now. Until then their silence does not
        count: a launch may wait minutes after its commit behind other actions on its job
        (its resize waits for every allocation change committed before it, one at a time).
        Found by the 4,096-node hour: a replan's agents were "never heard from" 30 s after
        the commit, before they had been started. A node that a later action has launched
        or stopped since keeps that action's state; one this unicornd has no launch on
        record for (a launch owed by the leader before it) starts its grace again."""
        for node in nodes:
            if self._launches.get((job_id, node), launch_id) == launch_id:
                self.liveness.launched(job_id, node, now_s)

    def agent_epoch(self, job_id: int, node: str) -> int:
        """Changes each time unicornd launches or stops the agent of (job, node) on purpose
        (0: never tracked). A probe of a silence compares it before and after: the agent it
        was asked about may have been replaced meanwhile
        (:meth:`unicornd.inputs.AgentInputs.silence_over`)."""
        return self._agent_epochs.get((job_id, node), 0)

    def _new_epoch(self, job_id: int, node: str) -> None:
        self._epoch_seq += 1
        self._agent_epochs[(job_id, node)] = self._epoch_seq

    def seed_silence(self, job_id: int, node: str, silent_s: float, now_s: float) -> None:
        """At start: the agent has been silent ``silent_s`` (its heartbeat key says so,
        :mod:`unicornd.seed`), as if its last beat came then; no new agent's grace."""
        self.liveness.beat(job_id, node, now_s - silent_s)

    def forget_agent(self, job_id: int, node: str, action_id: str = "") -> None:
        """The agent was stopped on purpose (by ``action_id``): its silence means nothing."""
        self.liveness.forget(job_id, node)
        self._new_epoch(job_id, node)
        self._lost.discard((job_id, node))
        self._launch(job_id, node, STOPPED, action_id)  # its ranks' last reports are stale
        job = self._jobs.get(job_id)
        if job is not None:
            job.monitor.forget_source(node)  # its reports stop; the others' silence still counts

    def forget_job(self, job_id: int) -> None:
        self.liveness.forget_job(job_id)
        self._jobs.pop(job_id, None)
        self._loss.pop(job_id, None)
        self._stragglers.pop(job_id, None)
        self._reported.pop(job_id, None)
        self._lost = {k for k in self._lost if k[0] != job_id}
        self._launches = {k: v for k, v in self._launches.items() if k[0] != job_id}
        self._undo = {k: v for k, v in self._undo.items() if k[0] != job_id}
        self._raised = {k: v for k, v in self._raised.items() if k[0] != job_id}
        # Dropped: a probe in flight holds a number > 0 and now reads 0, a change.
        self._agent_epochs = {k: v for k, v in self._agent_epochs.items() if k[0] != job_id}

    def expect_checkpoint(self, job_id: int, now_s: float) -> None:
        """A checkpoint was commanded: every rank's next step may take a checkpoint's time."""
        job = self._jobs.get(job_id)
        if job is not None and job.monitor.ranks:
            job.monitor.expect_slow_step(IterationPhase.CHECKPOINT, now_s)

    def restart_job(self, job_id: int, nodes: Collection[str] = ()) -> None:
        """The job's processes were relaunched (maybe at a new layout) on ``nodes``: relearn its
        timing; its loss statistics stay, but iterations will be reported again. The CPU-wait
        counters of the agents on ``nodes`` stay too, the others go
        (:meth:`detect.IterationMonitor.relaunched`)."""
        job = self._jobs.pop(job_id, None)
        if job is not None:
            job.monitor.relaunched(nodes)
            self._jobs[job_id] = _JobState(job.monitor)
        self._stragglers.pop(job_id, None)
        health = self._loss.get(job_id)
        if health is not None:
            health.restarted()

    def follow(self, before: Snapshot, after: Snapshot, decision: Decision, now_s: float) -> None:
        """Follow a committed decision (``now_s``: monotonic): see the module docstring."""
        job_nodes: dict[int, tuple[str, ...]] = {}  # a job's nodes in ``after``, found once

        def nodes_of(job_id: int) -> tuple[str, ...]:
            if job_id not in job_nodes:  # a scan of the tasks: once per job, not per action
                task = after.task_of_job(job_id)
                job_nodes[job_id] = () if task is None else tuple(task.nodes)
            return job_nodes[job_id]

        for action in decision.actions:
            if isinstance(action, LaunchAgents):
                # New agents on the launch's nodes: their counters start afresh, and the
                # agents they replace may be dead (their series would freeze the horizon).
                kept = set(nodes_of(action.job_id)) - set(action.nodes)
                self.restart_job(action.job_id, kept)
                for node in action.nodes:
                    self._agent_launched(action.job_id, node, now_s)
                    self._launch(action.job_id, node, action.action_id, action.action_id)
            elif isinstance(action, Requeue):
                self.forget_job(action.job_id)  # its processes are killed on purpose
            elif isinstance(action, SendCommand):
                if action.action in (AgentAction.RESTART_RANKS, AgentAction.RELAUNCH):
                    self.restart_job(action.job_id, nodes_of(action.job_id))
                    self._launch(action.job_id, action.node, action.action_id, action.action_id)
                elif action.action is AgentAction.STOP:
                    self.forget_agent(action.job_id, action.node, action.action_id)
                elif action.action is AgentAction.CHECKPOINT_NOW:
                    self.expect_checkpoint(action.job_id, now_s)
        # The tasks this decision changed, among them every task it requeued or ended: whether
        # their jobs are heard follows from their committed records (_hear).
        for put in decision.tasks:
            task = after.tasks.get(put.task_id)
            if task is not None:
                self._hear(task)
                self._left(before.tasks.get(put.task_id), task)
        for task in after.tasks.values():
            old = before.tasks.get(task.task_id)
            if (
                task.job_id is not None
                and task.state in ENDED_STATES
                and (old is None or old.state not in ENDED_STATES)
            ):
                self.forget_job(task.job_id)
        self._follow_reports(after)

    def _left(self, old: TaskRecord | None, task: TaskRecord) -> None:
        """Forget the agents on the nodes ``task`` left: they end on purpose (a stop, or its
        job's shrink or requeue). A node it left for being unhealthy gets no stop (it may
        not answer): found by the 4,096-node hour, its agent ran until the job's shrink
        (minutes later, behind the replan's other allocation changes) and was then "lost"."""
        if old is None or old.job_id is None or old.job_id != task.job_id:
            return
        for node in set(old.nodes) - set(task.nodes):
            if self._launches.get((old.job_id, node)) != STOPPED:
                self.forget_agent(old.job_id, node)

    def _hear(self, task: TaskRecord) -> None:
        """Hear ``task``'s job or not, as the committed snapshot says (:attr:`_unheard`)."""
        if task.job_id is None:
            return
        if task.requeue is None and task.state in LIVE_TASK_STATES:
            self._unheard.discard(task.job_id)
        else:
            self._unheard.add(task.job_id)

    def _follow_reports(self, after: Snapshot) -> None:
        """Keep :attr:`_reported` to the committed straggler reports (open incidents without a
        task, status ``straggler``) of each live task's nodes."""
        reported: dict[int, set[str]] = {}
        for inc in after.incidents.values():
            if inc.is_open and inc.task_id is None and inc.status is ErrorStatus.STRAGGLER:
                for task in after.tasks.values():
                    if task.job_id is not None and task.state in LIVE_TASK_STATES and inc.node in task.nodes:
                        reported.setdefault(task.job_id, set()).add(inc.node)
        self._reported = {job: frozenset(nodes) for job, nodes in reported.items()}
        for job_id, nodes in self._reported.items():
            monitor = self._stragglers.get(job_id)
            if monitor is not None:
                monitor.assume_convicted(nodes - monitor.convicted)

    def expect_running(self, snapshot: Snapshot, now_s: float) -> None:
        """At start: expect the agents of every task that runs (their silence counts, after
        the initial grace), except jobs being requeued."""
        for job_id, node in expected_agents(snapshot):
            self.expect_agent(job_id, node, now_s)
        for task in snapshot.tasks.values():
            self._hear(task)

    def heard_until(self, t_s: float) -> None:
        """Every agent event written before monotonic ``t_s`` has been handled: the events
        reader read each of its streams to the end in a read sent at ``t_s``.

        From the first call on, silence (a lost heartbeat, a stalled iteration) is measured
        up to the latest such time, not up to the clock: after a pause of unicornd's loop
        (a full garbage collection, a long decision) or of Redis, the ticker may wake before
        the reader has caught up, and reports waiting in Redis would count as the ranks'
        silence. A silence unicornd has not finished listening to is no evidence against a
        healthy job; detection waits for the reader instead (at most one read behind while
        it keeps up). Only moves forward. (It was the first suspect for the scale bench's
        unexplained stalls at 4,096 nodes, and did not remove them: BENCHMARKS.md.)
        """
        if self._heard_until_s is None or t_s > self._heard_until_s:
            self._heard_until_s = t_s

    def _until(self, now_s: float) -> float:
        return now_s if self._heard_until_s is None else min(now_s, self._heard_until_s)

    def silent(self, job_id: int, node: str, now_s: float) -> bool:
        """The agent of ``job_id`` on ``node`` is silent past its heartbeat timeout at
        ``now_s`` (as far as the reader has read: :meth:`heard_until`)."""
        return self.liveness.state(job_id, node, self._until(now_s)) is Liveness.EXPIRED

    def last_iteration(self, job_id: int) -> int | None:
        state = self._jobs.get(job_id)
        return None if state is None else state.last_iteration

    def on_message(self, msg: Message, now_s: float) -> list[JobEvidence]:
        """Classify one agent message received at ``now_s`` (monotonic)."""
        if isinstance(msg, Heartbeat | IterationTiming | SlowStep) and msg.job_id in self._unheard:
            return []  # processes of a job being requeued (or not live): they end on purpose
        if isinstance(msg, Heartbeat):
            self._beat(msg, now_s)
            return []
        if isinstance(msg, SlowStep):
            job = self._job(msg.job_id)
            # A rank the monitor does not know (its job was just restarted, so its timing is
            # relearned: ranks about to be replaced announce their SIGTERM save) has no
            # deadline to extend: the announcement is stale, not an error.
            if msg.rank in job.monitor.ranks:
                job.monitor.expect_slow_step(msg.phase, now_s, iteration=msg.iteration, rank=msg.rank)
            return []
        if isinstance(msg, IterationTiming):
            return self._timing(msg, now_s)
        if isinstance(msg, ProcessExit | ExceptionReport | FaultReport) and self.replaced(
            msg.job_id, msg.node, msg.launch_id
        ):
            # Likely what failed CI: the superseded agent of a shrunk job reports its ranks'
            # SIGKILL; after the shrink's incident has closed, a new incident would restart the
            # healthy new ranks. Ranks replaced on purpose end on purpose: their exits, exceptions and
            # log lines are no fault of the launch that replaced them.
            self.stale_reports += 1
            return []
        return self._classify(msg, now_s)

    def _beat(self, msg: Heartbeat, now_s: float) -> None:
        if self._launches.get((msg.job_id, msg.node)) == STOPPED:
            # An agent stopped on purpose, beating through its grace: it would be watched
            # again (then "lost" when it ends) and its CPU-wait series, never fed again,
            # would freeze the job's silence horizon (detect.stats: found in review).
            return
        self.liveness.beat(msg.job_id, msg.node, now_s)
        self._lost.discard((msg.job_id, msg.node))
        if msg.cpu_wait_s is not None:
            # How long the node's ranks waited for a CPU: starvation is no hang.
            self._job(msg.job_id).monitor.observe_cpu_wait(msg.node, msg.cpu_wait_s, now_s)

    def _classify(self, msg: Message, now_s: float) -> list[JobEvidence]:
        """The finding of an exit, exception, GPU event or agent fault report (none if benign)."""
        c: Classification | None = None
        rank: int | None = None
        source = ""
        if isinstance(msg, ProcessExit):
            if msg.exit_code == 0:
                return []
            c = self.classifier.classify_exit(msg.exit_code, msg.signal, msg.stderr_tail, msg.error_file_text)
            c = self._explained_exit(msg, c)
            rank, source = msg.rank, "exit"
        elif isinstance(msg, ExceptionReport):
            c = self.classifier.classify_exception(msg.exc_type, msg.message, msg.traceback)
            if msg.rank is not None and msg.launch_id and c.is_fault:
                self._raised[(msg.job_id, msg.node, msg.rank)] = (msg.launch_id, c, msg.wall_time_s)
            rank, source = msg.rank, "exception"
        elif isinstance(msg, GpuHealthEvent):
            c = self.classifier.classify_gpu(msg.kind, msg.value)
            source = "gpu"
        elif isinstance(msg, FaultReport):
            c = self._fault(msg)
            rank, source = msg.rank, f"agent:{msg.rule}"
        if c is None or not c.is_fault or self._teardown_noise(msg, c):
            return []
        # A NaN the training names in words (Megatron-LM's rerun state machine, in a log line,
        # the rank's exception or its exit's output) rolls back like a NaN loss report.
        iteration = named_iteration(c.evidence) if c.status is ErrorStatus.NAN_LOSS else None
        launch = msg.launch_id if isinstance(msg, ProcessExit | ExceptionReport | FaultReport) else ""
        current = bool(launch) and self._launches.get((msg.job_id, msg.node)) == launch
        evidence = Evidence(msg.node, rank, now_s, c, source)
        return [JobEvidence(msg.job_id, evidence, iteration=iteration, current_launch=current)]

    def _explained_exit(self, msg: ProcessExit, c: Classification) -> Classification:
        """A bare non-zero exit (:data:`BARE_EXIT_RULES`: nothing in its own output named a
        cause) of a rank that reported an exception in the same launch ended because of that
        exception: it takes the exception's status (severity at least SEV2, the rank is gone).

        Found by the safety bench: a user's bug raised again after its restart (absorbed, the
        restart had just been ordered), then the rank exited; the exit, ``exited_abnormally``
        (a node can cause that), climbed to isolation and ran a node check on a healthy node
        for an error of the training code. As the exception's status it is never a node's."""
        if msg.rank is None or not msg.launch_id:
            return c
        raised = self._raised.pop((msg.job_id, msg.node, msg.rank), None)
        if raised is None or c.rule not in BARE_EXIT_RULES or raised[0] != msg.launch_id:
            return c
        _launch, exc, raised_at = raised
        if not 0.0 <= msg.wall_time_s - raised_at <= EXIT_AFTER_EXCEPTION_S:
            return c  # another exception (a thread's, one the rank survived): not why it ended
        severity = worst([exc.severity, Severity.SEV2]) or Severity.SEV2
        ended = c.evidence.splitlines()[0] if c.evidence else c.rule
        return Classification(
            exc.status, severity, exc.rule, f"{exc.evidence}\n(then {ended})", exc.secondary
        )

    def _teardown_noise(self, msg: Message, c: Classification) -> bool:
        """A SEV3 log line after the run's last iteration. Found in CI: the ranks tear their
        groups down at their own pace, and the last to go logs its peers' closed sockets. A
        retry in place cannot help a run that is ending; its exit code says how it ended."""
        if not isinstance(msg, FaultReport) or c.severity is not Severity.SEV3:
            return False
        job = self._jobs.get(msg.job_id)
        return job is not None and job.final

    def replaced(self, job_id: int, node: str, launch_id: str) -> bool:
        """A report of ranks that this unicornd has since replaced on ``node`` (another
        launch or restart there, or its agent stopped). Unknown either way: not replaced."""
        current = self._launches.get((job_id, node))
        return current == STOPPED or (current is not None and bool(launch_id) and launch_id != current)

    def _launch(self, job_id: int, node: str, launch_id: str, action_id: str) -> None:
        key = (job_id, node)
        if action_id:
            self._undo[key] = (action_id, self._launches.get(key), launch_id)
        self._launches[key] = launch_id

    def command_failed(self, action_id: str, node: str | None = None) -> None:
        """The launch, restart or stop ``action_id`` failed (the agent's answer, or the
        command never reached it): the ranks it was to replace may still run, so their
        reports count again (what was current before it is again; nothing: all count).
        ``node``: it failed there only (one agent of a whole-job launch answered it failed;
        the other nodes' new ranks are current). Nothing changes where a later action has
        replaced them since."""
        for key, (by, before, value) in list(self._undo.items()):
            if by != action_id or (node is not None and key[1] != node):
                continue
            del self._undo[key]
            if self._launches.get(key) != value:
                continue
            if before is None:
                del self._launches[key]
            else:
                self._launches[key] = before

    def stale_timing(self, msg: IterationTiming) -> bool:
        """An iteration report of ranks unicornd has replaced on its node: another launch's,
        a stopped agent's, or unstamped once unicornd has launched there (every launch it
        makes stamps its ranks' reports). Neither a hang monitor's input nor progress."""
        return self.replaced(msg.job_id, msg.node, msg.launch_id) or (
            not msg.launch_id and (msg.job_id, msg.node) in self._launches
        )

    def _timing(self, msg: IterationTiming, now_s: float) -> list[JobEvidence]:
        if self.stale_timing(msg):
            # An unstamped report on a node unicornd has launched on since: every launch
            # unicornd makes stamps its ranks' reports, so this one is of the ranks before
            # it (an agent started without a launch id, read after the relaunch committed).
            # Found by the scale bench: such reports taught the new launch's monitor the old
            # mean (or watched the old layout's last rank), and the new ranks' start-up was
            # judged a stall at 2 x that mean (t039 at 326 s, t121 at 1,059 s, every run).
            # A replaced launch's ranks, still running until the agent stops them. They
            # must not reach the new launch's monitor: a rank of the old layout the new one
            # lacks would be watched from its last report on and, once the new layout's
            # timing is learned, judged hung (found in CI: "rank 3 reported no iteration for
            # 9.81 s" after a 4-rank job went on with 3).
            return []
        job = self._job(msg.job_id)
        job.monitor.observe(msg.rank, msg.iteration, msg.interval_s, msg.phase, now_s=now_s)
        job.rank_nodes[msg.rank] = msg.node
        if job.last_iteration is None or msg.iteration > job.last_iteration:
            job.last_iteration = msg.iteration
        if msg.final:  # the run ends next: its silence from now on is no hang
            job.final = True
            job.monitor.reset()
            job.hang_reported = None
        return [*self._stragglers_of(msg, now_s), *self._loss_health(msg, now_s)]

    def _stragglers_of(self, msg: IterationTiming, now_s: float) -> list[JobEvidence]:
        """Straggler verdicts the report (of the current launch) completed
        (:mod:`detect.stragglers`)."""
        if msg.compute_s is None:
            return []
        monitor = self._stragglers.get(msg.job_id)
        if monitor is None:
            d = self.detect_cfg
            cfg = StragglerConfig(
                window=d.straggler_window,
                windows=d.straggler_windows,
                factor=d.straggler_factor,
                min_nodes=d.straggler_min_nodes,
                warmup=d.straggler_warmup,
            )
            monitor = self._stragglers[msg.job_id] = StragglerMonitor(cfg)
            monitor.assume_convicted(self._reported.get(msg.job_id, frozenset()))
        verdicts = monitor.observe(
            msg.rank,
            msg.node,
            msg.iteration,
            msg.compute_s,
            msg.duration_s,
            phase=msg.phase,
            stage=msg.stage,
        )
        return [
            JobEvidence(
                msg.job_id,
                Evidence(v.node, v.rank, now_s, v.classification(), f"straggler:{v.node}"),
                straggler=v,
            )
            for v in verdicts
        ]

    def _loss_health(self, msg: IterationTiming, now_s: float) -> list[JobEvidence]:
        """Training-state findings (NaN, loss spike, grad-norm explosion) of the report.

        Each names the node and rank that reported it; its source ``loss:<status>`` keeps
        the finding ids of one report apart. They never drain a node by themselves
        (:data:`detect.isolation.ISOLATION`): ``silent_data_corruption`` only runs the
        paired check, whose failure drains. Only reports of the current launch come here."""
        health = self._loss.get(msg.job_id)
        if health is None:
            health = self._loss[msg.job_id] = LossHealth(self._loss_cfg())
        sample = LossSample(
            node=msg.node,
            iteration=msg.iteration,
            loss=msg.loss,
            grad_norm=msg.grad_norm,
            skipped=msg.skipped_iterations,
            nan=msg.nan_iterations,
            span=msg.span,
            rank=msg.rank,
        )
        return [
            JobEvidence(
                msg.job_id,
                Evidence(f.node, f.rank, now_s, f.classification, f"loss:{f.status.value}"),
                iteration=f.iteration if f.iteration >= 1 else None,
                span=msg.span,
                launch_id=msg.launch_id,
            )
            for f in health.observe(sample)
        ]

    def _loss_cfg(self) -> LossHealthConfig:
        d = self.detect_cfg
        return LossHealthConfig(
            warmup=d.loss_warmup,
            window=d.loss_window,
            spike_z=d.loss_spike_z,
            spike_ratio=d.loss_spike_ratio,
            grad_z=d.grad_norm_z,
            grad_ratio=d.grad_norm_ratio,
            max_skipped=d.max_skipped_iterations,
            sdc_findings=d.sdc_findings,
            sdc_window=d.sdc_window,
        )

    def _fault(self, msg: FaultReport) -> Classification:
        """The agent's classification, if it names a known status and severity; else re-classified.
        Secondary as its rule is (looked up by name; a rule this classifier lacks: as its status's
        default, :data:`detect.statuses.SECONDARY_BY_DEFAULT`), but an exit line the agent sent
        at SEV1/SEV2 (one that corroborates an exit it saw) is primary."""
        try:
            status, severity = ErrorStatus(msg.status), Severity(msg.severity)
        except ValueError:
            return self.classifier.classify_text(msg.evidence)
        if status is ErrorStatus.NONE:
            return self.classifier.classify_text(msg.evidence)
        # the rule's own flag (another node's lost daemon, a peer's remote error: a
        # consequence), which the message does not carry; a rule this classifier lacks (an
        # agent's site rule): as a rule of that status is by default. Except a line reporting
        # an exit that the agent sent at SEV1/SEV2: it does so only when the line corroborates
        # an exit it saw itself (launcher.agent: EXIT_LINE_WINDOW_S), and that line is what
        # moves an open incident's ladder (the exit's own finding, torchrun's summary, is
        # absorbed; CI of 71e3c96: a relaunch that could not start waited for its rung's timeout)
        rule = self.classifier.rule_named(msg.rule)
        secondary = rule.secondary if rule is not None else status in SECONDARY_BY_DEFAULT
        if status is ErrorStatus.EXITED_ABNORMALLY and severity is not Severity.SEV3:
            secondary = False
        return Classification(status, severity, msg.rule, msg.evidence[:1000], secondary)

    def check(self, now_s: float) -> list[JobEvidence]:
        """Findings from silence at ``now_s`` (as far as the reader has read:
        :meth:`heard_until`): lost agents, and tasks whose iterations stopped."""
        out: list[JobEvidence] = []
        until_s = self._until(now_s)
        for exp in self.liveness.expired(until_s):
            key = (exp.job_id, exp.node)
            if key in self._lost:
                continue
            self._lost.add(key)
            evidence = Evidence(exp.node, None, now_s, exp.classification(), "heartbeat")
            out.append(JobEvidence(exp.job_id, evidence, agent_epoch=self.agent_epoch(*key)))
        for job_id, job in self._jobs.items():
            verdict = job.monitor.check(now_s, until_s)
            if verdict is None:
                job.hang_reported = None
                continue
            if job.hang_reported == verdict.last_iteration:
                continue  # the same stall: other ranks advancing or joining it is no new episode
            job.hang_reported = verdict.last_iteration
            rank = verdict.ranks[0] if verdict.ranks else None
            node = job.rank_nodes.get(rank, "") if rank is not None else ""
            out.append(JobEvidence(job_id, Evidence(node, rank, now_s, verdict.classification(), "hang")))
        return out
