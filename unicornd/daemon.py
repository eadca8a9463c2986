"""unicornd: the coordinator's closed loop (detect -> decide -> act) on real Slurm and Redis.

Root tasks, each named, under one guard (the first to end or fail takes the rest down
and the process exits non-zero, so systemd restarts it):

- ``events``: agent messages from the events stream (consumer group) -> the detector ->
  :mod:`unicornd.decide`; acknowledged only after the decision is persisted;
- ``control``: requests (register a task, drain, resume, confirm a drain) from the
  control stream, same discipline;
- ``ticker``: silence becomes findings (lost agents, hangs), stage timeouts climb;
- ``slurm``: node and job states from Slurm (a node back, drained outside unicorn, a
  task's job ended);
- ``executor``: performs the owed actions, in order, one at a time; the only code that
  changes Slurm or writes agent commands;
- ``liveness``: the TTL key ``unicornctl status --check`` looks at.

Every decision is a pure function of the snapshot, an input and the clock; its records
and actions are committed together (:class:`unicornd.store.Store`) before the input is
acknowledged, so kill -9 loses no event and performs no action twice.

Signals: SIGTERM drains (stop taking inputs, finish the action in flight, exit 0);
SIGINT and SIGQUIT stop now (exit 0; owed actions stay owed and run after a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any, Final, cast

import redis.asyncio as aioredis

from detect import Classifier, load_classifier
from plan.hardware import gpu_spec
from plan.objective import FailureModel
from unicorn_core import acl, munge, protocol, redis_io
from unicorn_core.config import Config
from unicorn_core.errors import CommandFailed, InvalidArgument, ProtocolError, UnicornError
from unicorn_core.jobenv import JobEnvironment
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.logs import get_logger
from unicorn_core.protocol import (
    AgentAction,
    CommandResult,
    IterationTiming,
    Message,
    ProcessExit,
)
from unicorn_core.slurm.backend import ResizeUnsupported, SlurmBackend, StepHandle
from unicorn_core.slurm.types import JobInfo, JobState
from unicornd import decide, oob
from unicornd.actions import (
    Action,
    CheckNode,
    CloseIncident,
    Decision,
    DrainNode,
    Grow,
    LaunchAgents,
    NodeArgv,
    NotifyOperator,
    Replan,
    Requeue,
    RestartAgent,
    ResumeNode,
    SendCommand,
    Shrink,
)
from unicornd.alerts import AlertSink, alerts_for
from unicornd.decide import ClassificationLike
from unicornd.detector import Detector, JobFinding
from unicornd.ingest import StreamIngest
from unicornd.launch import agent_argv, bin_dir, renderer
from unicornd.metrics import SnapshotMetrics, start_metrics_server
from unicornd.registry import registration_digest
from unicornd.replan import PLANNED_STATES, plan_for, plan_transition
from unicornd.state import NodeHealth, NodeRecord, Policy, Snapshot, TaskRecord, TaskState
from unicornd.store import Store, prune

log = get_logger(__name__)

OPERATOR_OPS: Final = frozenset({"drain", "resume", "confirm_drain"})
"""Control requests unicornd takes only from the operators' stream."""
_ENDED: Final = frozenset({TaskState.FINISHED, TaskState.FAILED, TaskState.STOPPED})
LIVENESS_TTL_S: Final = 5.0
TICK_S: Final = 0.05
SLURM_POLL_S: Final = 1.0
_PROGRESS_EVERY: Final = 10
"""Persist a running task's iteration mark every this many iterations (and at once while
an incident is open or a launch awaits its first iteration)."""


class Daemon:
    """One coordinator process. :meth:`run` returns the exit status."""

    def __init__(
        self,
        cfg: Config,
        slurm: SlurmBackend,
        client: aioredis.Redis,
        *,
        policy: Policy | None = None,
        classifier: Classifier | None = None,
        consumer: str = "unicornd",
        config_path: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.slurm = slurm
        self.client = client
        self.keys = RedisKeys(cfg.redis.key_prefix)
        self.store = Store(client, self.keys, policy or cfg.recovery)
        self.detector = Detector(
            cfg.detect, cfg.agent, classifier or load_classifier(cfg.detect.rules_file or None)
        )
        self.consumer = consumer
        self.config_path = config_path
        self.snapshot: Snapshot | None = None
        self.steps: dict[tuple[int, str], StepHandle] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._drain_only = False
        self._finished_nodes: dict[int, set[str]] = {}
        # task -> (iteration, reported_s, launch_id) seen but not persisted yet: progress is
        # persisted every _PROGRESS_EVERY iterations, and the rest once a second (tick) and
        # before a task ends, so the snapshot's last iteration is never more than 1 s behind.
        self._unrecorded: dict[str, tuple[int, float, str]] = {}
        self._quiet_jobs: set[int] = set()
        self._forgotten_jobs: set[int] = set()
        self._probes: dict[tuple[int, str], asyncio.Task[None]] = {}
        self.alerts = AlertSink(cfg.alerts)
        self.metrics = SnapshotMetrics(gpu=gpu_spec(cfg.plan.gpu))
        self.actions_run = 0

    # --- deciding -----------------------------------------------------------------------

    @property
    def snap(self) -> Snapshot:
        assert self.snapshot is not None
        return self.snapshot

    async def decide(self, fn: Callable[..., Decision], *args: Any, **kw: Any) -> Decision:
        """Run one pure decision on the current snapshot and persist it with its actions."""
        async with self._lock:
            decision = fn(self.snap, *args, **kw)
            if not decision.empty or decision.plan_generation is not None:
                self._committed(self.snap, await self.store.apply(self.snap, decision))
                if decision.actions:
                    self._wake.set()
            for note in decision.notes:
                log.info("decision", note=note)
            return decision

    def _committed(self, before: Snapshot, after: Snapshot) -> None:
        """``after`` is persisted: it becomes current, alerts go out, metrics follow it."""
        self.snapshot = after
        self.alerts.submit(alerts_for(before, after, time.time()))
        self.metrics.update(after)

    # --- startup ------------------------------------------------------------------------

    async def _load(self) -> None:
        nodes = await self.slurm.list_nodes()
        gpus = max((n.gpus for n in nodes), default=1) or 1
        snap = await self.store.load(gpus)
        if snap.gpus_per_node != gpus:
            snap = replace(snap, gpus_per_node=gpus)
        known = {n.name: n for n in nodes}
        added = []
        for info in nodes:
            if info.name not in snap.nodes:
                health = NodeHealth.HEALTHY if info.usable else NodeHealth.DRAINED
                added.append(NodeRecord(info.name, health=health, reason="" if info.usable else info.reason))
        snap = prune(snap.apply(nodes=added), time.time())
        self.snapshot = snap
        self.metrics.update(snap)
        await self.store.commit(snap)
        log.info(
            "state_loaded",
            tasks=len(snap.tasks),
            nodes=len(snap.nodes),
            slurm_nodes=len(known),
            open_incidents=sum(i.is_open for i in snap.incidents.values()),
            owed_actions=len(await self.store.pending()),
        )
        for task in snap.tasks.values():
            if task.state in (TaskState.RUNNING, TaskState.RECOVERING, TaskState.LAUNCHING) and task.job_id:
                for node in task.nodes:
                    self.detector.expect_agent(task.job_id, node, time.monotonic())

    # --- root tasks ---------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._drain)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGQUIT, self._stop.set)
        # Roles first: the committed state is what clients wait for, and a client that
        # sees it must be able to log in as its role (a job's wrapper registering at once).
        await self._apply_roles()
        await self._load()
        events = StreamIngest(self.client, self._event_streams, self.consumer, self._on_event)
        control = StreamIngest(
            self.client,
            lambda: (self.keys.control(), self.keys.operator_control()),
            self.consumer,
            raw_handler=self._on_control_raw,
        )
        roots: dict[str, Coroutine[Any, Any, None]] = {
            "events": events.run(),
            "control": control.run(),
            "ticker": self._ticker(),
            "slurm": self._slurm_watch(),
            "executor": self._executor(),
            "liveness": self._liveness(),
            "alerts": self.alerts.run(),
        }
        server = start_metrics_server(self.cfg.metrics, self.metrics)
        if server is not None:
            log.info("metrics_listening", url=server.url)
        tasks = [asyncio.create_task(coro, name=name) for name, coro in roots.items()]
        stopper = asyncio.create_task(self._stop.wait(), name="stop")
        status = 0
        try:
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is stopper or (self._drain_only and not t.cancelled() and t.exception() is None):
                    continue
                exc = t.exception()
                log.error("root_task_ended", task=t.get_name(), error=repr(exc) if exc else "returned")
                status = 1
        finally:
            for t in [*tasks, stopper, *self._probes.values()]:
                t.cancel()
            if server is not None:
                server.close()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)
            with contextlib.suppress(UnicornError):
                await redis_io.call(("DEL",), self.client.delete(self.keys.daemon_liveness()))
        log.info("unicornd_stopped", status=status, actions_run=self.actions_run)
        return status

    def _drain(self) -> None:
        log.info("draining: finishing the action in flight, then exiting")
        self._drain_only = True
        self._wake.set()

    async def _liveness(self) -> None:
        while True:
            await redis_io.call(
                ("SET", self.keys.daemon_liveness()),
                self.client.set(
                    self.keys.daemon_liveness(),
                    json.dumps({"pid": os.getpid(), "t": time.time()}),
                    px=int(LIVENESS_TTL_S * 1000),
                ),
            )
            await asyncio.sleep(LIVENESS_TTL_S / 3)

    # --- agents' streams and Redis users ------------------------------------------------

    def _event_streams(self) -> list[str]:
        """The events stream of every job a known task holds (its agents write only there),
        but those of jobs whose agents are gone for good (:meth:`_forget_agent_users`)."""
        jobs = sorted(
            {t.job_id for t in self.snap.tasks.values() if t.job_id is not None} - self._forgotten_jobs
        )
        return [self.keys.events(j) for j in jobs]

    async def _apply_roles(self) -> None:
        if self.cfg.redis.operator_password_file or self.cfg.redis.user_password_file:
            log.info("redis_roles", users=await acl.apply_roles(self.client, self.cfg.redis))

    async def _agent_env(self, job_id: int) -> dict[str, str]:
        """The Redis credentials of ``job_id``'s agents, as config overrides for their environment.

        With ``redis.agent_acl`` the job gets its own Redis user (:func:`acl.agent_rules`),
        whose password is made once per job and kept under a key only unicornd reads, so a
        later relaunch of some of the job's agents does not lock out the others.
        """
        self._forgotten_jobs.discard(job_id)
        if not self.cfg.redis.agent_acl:
            return {}
        key = self.keys.agent_password(job_id)
        await redis_io.call(("SET", key), self.client.set(key, acl.new_password(), nx=True))
        password = cast(bytes, await redis_io.call(("GET", key), self.client.get(key))).decode()
        user = acl.agent_user(self.keys, job_id)
        await acl.set_user(self.client, user, acl.agent_rules(self.keys, job_id, password))
        return {
            "UNICORN_REDIS__URL": acl.url_with_user(self.cfg.redis.url, user, password),
            "UNICORN_REDIS__PASSWORD_FILE": "",
        }

    async def _forget_agent_users(self, jobs: Mapping[int, JobInfo]) -> None:
        """Delete the Redis user, password and streams of jobs whose agents are gone for good:
        no task that may still run holds the job, and Slurm has no running or pending job by
        that id (the job's steps, agents included, end with it)."""
        if not self.cfg.redis.agent_acl:
            return
        held = {
            t.job_id
            for t in self.snap.tasks.values()
            if t.job_id is not None
            and (t.state not in _ENDED or (t.job_id in jobs and not jobs[t.job_id].state.finished))
        }
        for user in await acl.users(self.client):
            job = acl.agent_job(self.keys, user)
            if job is None or job in held:
                continue
            self._forgotten_jobs.add(job)  # stop reading its stream before it is deleted
            await acl.delete_user(self.client, user)
            gone = (
                self.keys.agent_password(job),
                self.keys.job_env(job),
                self.keys.events(job),
                self.keys.command_results(job),
            )
            await redis_io.call(("DEL", *gone), self.client.delete(*gone))
            log.info("agent_user_deleted", job_id=job, user=user)

    # --- inputs -------------------------------------------------------------------------

    async def _on_event(self, msg: Message, now_mono: float, entry_id: str, stream: str) -> None:
        if stream != self.keys.events(msg.job_id):
            # Each job's agents may write only their job's stream (Redis ACL); a message
            # there about another job is forged or misrouted: never act on it.
            log.warning("event_wrong_stream", id=entry_id, stream=stream, job_id=msg.job_id)
            return
        found = self.detector.on_message(msg, now_mono)
        task = self.snap.task_of_job(msg.job_id) if msg.job_id else None
        if isinstance(msg, IterationTiming) and task is not None:
            await self._progress(task, msg.iteration, msg.wall_time_s, msg.launch_id)
        elif isinstance(msg, ProcessExit) and task is not None and msg.rank is None and msg.exit_code == 0:
            await self._node_finished(task, msg.node)
        elif isinstance(msg, CommandResult) and not msg.ok:
            log.warning("agent_command_failed", command_id=msg.command_id, node=msg.node, detail=msg.detail)
        for jf in found:
            await self._finding(jf, finding_id=f"{entry_id}:{jf.finding.source}")

    async def _progress(self, task: TaskRecord, iteration: int, reported_s: float, launch_id: str) -> None:
        mark = task.last_iteration
        urgent = task.state is not TaskState.RUNNING or self.snap.open_incident(task.task_id) is not None
        if mark is None or urgent or iteration >= mark + _PROGRESS_EVERY:
            self._unrecorded.pop(task.task_id, None)
            # reported_s: when the rank finished the iteration (its wall clock), so an
            # iteration finished before a recovery action does not count as its success.
            await self.decide(
                decide.on_progress,
                task.task_id,
                iteration,
                time.time(),
                reported_s=reported_s,
                launch_id=launch_id,
            )
        elif iteration > mark and iteration > self._unrecorded.get(task.task_id, (-1, 0.0, ""))[0]:
            self._unrecorded[task.task_id] = (iteration, reported_s, launch_id)

    async def _record_progress(self, task_id: str | None = None) -> None:
        """Persist the iterations seen but not yet recorded (of ``task_id``, or of every task)."""
        for tid in [task_id] if task_id is not None else list(self._unrecorded):
            seen = self._unrecorded.pop(tid, None)
            task = self.snap.tasks.get(tid)
            if seen is None or task is None or seen[0] <= (task.last_iteration or -1):
                continue
            iteration, reported_s, launch_id = seen
            await self.decide(
                decide.on_progress, tid, iteration, time.time(), reported_s=reported_s, launch_id=launch_id
            )

    async def _node_finished(self, task: TaskRecord, node: str) -> None:
        done = self._finished_nodes.setdefault(task.job_id or 0, set())
        done.add(node)
        # RECOVERING too: a restarted run may resume at its last iteration and end at once,
        # with no new iteration to close the incident first.
        if set(task.nodes) <= done and task.state in (
            TaskState.RUNNING,
            TaskState.LAUNCHING,
            TaskState.RECOVERING,
        ):
            await self._record_progress(task.task_id)
            task = self.snap.tasks.get(task.task_id, task)
            log.info("task_finished", task=task.task_id, iteration=task.last_iteration)
            for n in task.nodes:
                self.detector.forget_agent(task.job_id or 0, n)
            await self.decide(decide.on_task_finished, task.task_id, time.time(), ok=True)

    async def _finding(self, jf: JobFinding, finding_id: str) -> None:
        f = jf.finding
        if jf.job_id in self._quiet_jobs:
            log.info("finding_ignored", job_id=jf.job_id, node=f.node, why="job being requeued")
            return
        node = f.node
        task = self.snap.task_of_job(jf.job_id)
        if not node and task is not None:
            # A task-level hang: blame the node of the suspect rank when we know it.
            node = task.nodes[0] if task.nodes else ""
        if not node:
            return
        if f.source == "heartbeat" and self.cfg.ssh.enabled and jf.job_id is not None:
            self._probe(jf, node, finding_id)
            return
        await self._decide_finding(jf, node, finding_id, jf.classification)

    def _probe(self, jf: JobFinding, node: str, finding_id: str) -> None:
        """Confirm a silent agent out of band (SSH) before deciding; one probe per agent at a time."""
        key = (jf.job_id, node)
        if key in self._probes:
            return

        async def confirm() -> None:
            log.info("probing", job_id=jf.job_id, node=node, why=jf.classification.evidence)
            try:
                result = await oob.probe_node(self.cfg.ssh, self.cfg.agent, node, jf.job_id)
                found = oob.verdict(result, jf.classification.evidence, self.detector.classifier)
                log.warning(
                    "probe",
                    job_id=jf.job_id,
                    node=node,
                    reachable=result.reachable,
                    agents=list(result.agent_states),
                    kernel_lines=len(result.kernel_lines),
                    rule=found.rule,
                    s=round(result.elapsed_s, 3),
                )
            except Exception as e:  # a broken probe must not hide the silence
                log.error("probe_failed", job_id=jf.job_id, node=node, error=repr(e))
                found = jf.classification
            try:
                await self._decide_finding(jf, node, f"{finding_id}:probe", found)
            finally:
                self._probes.pop(key, None)

        self._probes[key] = asyncio.create_task(confirm(), name=f"probe-{node}-{jf.job_id}")

    async def _decide_finding(
        self, jf: JobFinding, node: str, finding_id: str, classification: ClassificationLike
    ) -> None:
        f = jf.finding
        finding = decide.Finding.of(
            classification,
            finding_id=finding_id,
            job_id=jf.job_id,
            node=node,
            rank=f.rank,
            rank_died=f.source == "exit",
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
        )
        await self.decide(decide.on_finding, finding, time.time())

    async def _on_control_raw(self, fields: dict[bytes, bytes], entry_id: str, stream: str) -> None:
        try:
            req = json.loads(fields.get(PAYLOAD_FIELD.encode(), b""))
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise ProtocolError("invalid", "control request must be an object with a string 'op'")
            await self._control(req, operator=stream == self.keys.operator_control())
        except (ValueError, UnicornError) as e:
            log.warning("control_rejected", id=entry_id, stream=stream, error=str(e))
            await self._reply(stream, entry_id, ok=False, detail=str(e))
            return
        await self._reply(stream, entry_id, ok=True, detail="")

    async def _reply(self, stream: str, entry_id: str, *, ok: bool, detail: str) -> None:
        await redis_io.call(
            ("SET", "reply"),
            self.client.set(
                self.keys.reply(stream, entry_id), json.dumps({"ok": ok, "detail": detail}), ex=3600
            ),
        )

    async def _authenticate_registration(self, req: Mapping[str, Any], task: TaskRecord) -> None:
        """The registration was signed (MUNGE) for exactly this request by the owner of the
        task's job, root, or unicornd's own user (the SlurmUser). Without this, anyone who
        may write the control stream could run a command inside another user's job."""
        signed = await munge.verify(str(req.get("credential", "")), socket=self.cfg.slurm.munge_socket)
        if signed.payload != registration_digest(req):
            raise munge.NotAuthenticated("the MUNGE credential signs another request")
        if signed.uid in (0, os.getuid()):
            return
        job = await self.slurm.get_job(task.job_id or 0)
        try:
            owner = pwd.getpwnam(job.user).pw_uid
        except KeyError:
            owner = int(job.user) if job.user.isdigit() else -1
        if signed.uid != owner:
            raise munge.NotAuthenticated(
                f"job {job.job_id} belongs to {job.user}; the request was signed by uid {signed.uid}"
            )

    async def _control(self, req: dict[str, Any], *, operator: bool) -> None:
        """One request; ``operator``: it came on the operators' stream (only they can write it)."""
        op = req["op"]
        now = time.time()
        if op in OPERATOR_OPS and not operator:
            raise InvalidArgument(
                f"{op!r} is an operator's request: send it with unicornctl as an operator "
                f"(it goes on {self.keys.operator_control()!r}, which only operators may write)"
            )
        if op == "register":
            task = TaskRecord.from_dict(req.get("task"))
            raw_env = req.get("environment")
            environment = None if raw_env is None else JobEnvironment.from_dict(raw_env)
            await self._authenticate_registration(req, task)
            if environment is None or task.job_id is None:
                await self.decide(decide.on_task_arrived, task, now)
                return
            # Stored before the decision, so the agents it launches find it; out of the
            # snapshot, which every user may read (the variables may hold the user's tokens).
            key = self.keys.job_env(task.job_id)
            await redis_io.call(("SET", key), self.client.set(key, environment.to_json()))
            try:
                await self.decide(decide.on_task_arrived, task, now)
            except BaseException:
                await redis_io.call(("DEL", key), self.client.delete(key))
                raise
        elif op == "resume":
            node = str(req.get("node", ""))
            if node not in self.snap.nodes:
                raise InvalidArgument(f"unknown node {node!r}")
            await self.decide(decide.on_node_join, node, now, by_operator=True)
        elif op == "drain":
            node, reason = str(req.get("node", "")), str(req.get("reason", ""))
            await self.decide(decide.on_operator_drain, node, reason, now)
        elif op == "confirm_drain":
            await self.decide(decide.on_operator_confirm_drain, str(req.get("incident", "")), now)
        elif op == "finish":
            await self.decide(
                decide.on_task_finished, str(req.get("task", "")), now, ok=bool(req.get("ok", True))
            )
        elif op == "stop":
            why = str(req.get("why", "")) or "stop requested"
            await self.decide(decide.on_task_stop, str(req.get("task", "")), now, why=why)
        else:
            raise InvalidArgument(
                f"unknown op {op!r}; known: register, resume, drain, confirm_drain, finish, stop"
            )

    async def _ticker(self) -> None:
        last_tick = 0.0
        while True:
            await asyncio.sleep(TICK_S)
            for jf in self.detector.check(time.monotonic()):
                await self._finding(
                    jf, finding_id=f"{jf.finding.source}:{jf.job_id}:{jf.finding.node}:{time.time():.3f}"
                )
            now = time.time()
            if now - last_tick >= 1.0:
                last_tick = now
                await self._record_progress()
                await self.decide(decide.on_tick, now)

    async def _slurm_watch(self) -> None:
        while True:
            try:
                nodes = await self.slurm.list_nodes()
                jobs = {j.job_id: j for j in await self.slurm.list_jobs()}
            except UnicornError as e:
                log.warning("slurm_unavailable", error=str(e))
                await asyncio.sleep(SLURM_POLL_S)
                continue
            now = time.time()
            for info in nodes:
                rec = self.snap.nodes.get(info.name)
                if rec is None or (info.usable and rec.health is NodeHealth.DRAINED):
                    await self.decide(decide.on_node_join, info.name, now)
                elif (
                    not info.usable
                    and info.drained
                    and rec.health in (NodeHealth.HEALTHY, NodeHealth.DRAINING)
                ):
                    await self.decide(decide.on_node_drained, info.name, now, info.reason)
            for task in list(self.snap.tasks.values()):
                if task.job_id is None or task.state not in PLANNED_STATES:
                    continue
                job = jobs.get(task.job_id)
                if job is None or job.state.finished:
                    await self._record_progress(task.task_id)
                    ok = job is not None and job.state is JobState.COMPLETED
                    log.info("task_job_ended", task=task.task_id, job_id=task.job_id, ok=ok)
                    for n in task.nodes:
                        self.detector.forget_agent(task.job_id, n)
                    if job is not None and job.state is JobState.CANCELLED:  # scancel: the user's stop
                        await self.decide(decide.on_task_stop, task.task_id, now, why="job cancelled")
                    else:
                        await self.decide(decide.on_task_finished, task.task_id, now, ok=ok)
            try:
                await self._forget_agent_users(jobs)
            except UnicornError as e:
                log.warning("agent_user_cleanup_failed", error=str(e))
            await asyncio.sleep(SLURM_POLL_S)

    # --- acting -------------------------------------------------------------------------

    async def _executor(self) -> None:
        backoff = 0.2
        while True:
            if self._drain_only and not self._wake.is_set():
                self._stop.set()
                return
            action, done = await self.store.next_action()
            if action is None:
                if self._drain_only:
                    self._stop.set()
                    return
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                continue
            if not done:
                t0 = time.monotonic()
                try:
                    await self._execute(action)
                except UnicornError as e:
                    if e.temporary:
                        log.warning("action_retry", action=action.action_id, error=str(e), backoff_s=backoff)
                        await asyncio.sleep(backoff)
                        backoff = min(5.0, backoff * 2)
                        continue
                    log.error("action_failed", action=action.action_id, kind=action.kind, error=str(e))
                    await self._incident_log(
                        {"kind": "action_failed", "action": action.action_id, "error": str(e)}
                    )
                log.info(
                    "action_done",
                    action=action.action_id,
                    kind=action.kind,
                    s=round(time.monotonic() - t0, 3),
                )
                self.actions_run += 1
            backoff = 0.2
            await self.store.finish(action)
            if self._drain_only:
                self._stop.set()
                return

    async def _execute(self, action: Action) -> None:
        handlers: dict[type[Any], Callable[[Any], Awaitable[None]]] = {
            DrainNode: self._drain_node,
            ResumeNode: lambda a: self.slurm.resume(a.node),
            SendCommand: self._send,
            LaunchAgents: self._launch,
            Shrink: lambda a: self.slurm.shrink(a.job_id, a.nodes),
            Grow: self._grow,
            RestartAgent: self._restart_agent,
            Requeue: self._requeue,
            Replan: self._replan,
            CheckNode: self._check_node,
            NotifyOperator: self._notify,
            CloseIncident: self._close,
        }
        await handlers[type(action)](action)

    async def _drain_node(self, action: DrainNode) -> None:
        if action.down:
            await self.slurm.down(action.node, action.reason)
        await self.slurm.drain(action.node, action.reason)

    async def _grow(self, action: Grow) -> None:
        try:
            await self.slurm.grow(action.job_id, len(action.add), exclude=self._all_but(action.add))
        except ResizeUnsupported as e:
            log.warning("grow_unsupported", job_id=action.job_id, error=str(e))
            self._quiesce(action.job_id)
            job = await self.slurm.get_job(action.job_id)
            await self.slurm.requeue(action.job_id, [*job.nodes, *action.add])
            await self._wait_running(action.job_id)

    async def _requeue(self, action: Requeue) -> None:
        self._quiesce(action.job_id)
        try:
            await self.slurm.requeue(action.job_id, action.nodes)
        except CommandFailed as e:
            # Already requeued (e.g. by the action's first run before a crash): idempotent.
            if "pending" not in f"{e.stdout} {e.stderr}".lower():
                raise
        if action.nodes:
            await self._wait_running(action.job_id)

    async def _notify(self, action: NotifyOperator) -> None:
        log.error("operator_needed", incident=action.incident_id, why=action.why)
        await self._incident_log({"kind": "operator", "incident": action.incident_id, "why": action.why})

    async def _close(self, action: CloseIncident) -> None:
        inc = self.snap.incidents.get(action.incident_id)
        await self._incident_log({"kind": "closed", "incident": inc.to_dict() if inc else action.incident_id})

    def _quiesce(self, job_id: int) -> None:
        """The job's processes are being killed on purpose (requeue): their exits and
        silence are not faults until its agents are launched again."""
        self._quiet_jobs.add(job_id)
        self.detector.forget_job(job_id)

    def _all_but(self, nodes: tuple[str, ...]) -> list[str]:
        return sorted(set(self.snap.nodes) - set(nodes))

    async def _wait_running(self, job_id: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await self.slurm.get_job(job_id)).state is JobState.RUNNING:
                return
            await asyncio.sleep(0.5)
        raise InvalidArgument(f"job {job_id} did not run again within {timeout_s:g}s")

    async def _send(self, action: SendCommand) -> None:
        msg = action.message(time.time())
        await redis_io.call(
            ("XADD", self.keys.agent_commands(action.job_id, action.node)),
            self.client.xadd(
                self.keys.agent_commands(action.job_id, action.node), {PAYLOAD_FIELD: protocol.encode(msg)}
            ),
        )
        if action.action in (AgentAction.RESTART_RANKS, AgentAction.RELAUNCH):
            self.detector.restart_job(action.job_id)
            self._finished_nodes.pop(action.job_id, None)
        elif action.action is AgentAction.STOP:
            self.detector.forget_agent(action.job_id, action.node)
        elif action.action is AgentAction.CHECKPOINT_NOW:
            self.detector.expect_checkpoint(action.job_id, time.monotonic())

    async def _launch(self, action: LaunchAgents) -> None:
        credentials = await self._agent_env(action.job_id)
        self._quiet_jobs.discard(action.job_id)
        self.detector.restart_job(action.job_id)
        self._finished_nodes.pop(action.job_id, None)
        for cmd in action.commands:
            old = self.steps.pop((action.job_id, cmd.node), None)
            if old is not None:
                with contextlib.suppress(UnicornError, ProcessLookupError):
                    await old.stop(grace_s=5.0)
            argv = agent_argv(
                self.cfg.agent,
                action.job_id,
                cmd.node,
                cmd.argv,
                config_path=self.config_path,
                launch_id=action.action_id,
            )
            step = await self.slurm.launch_step(
                action.job_id,
                [cmd.node],
                argv,
                env={**action.env, **credentials},
                options=[f"--output=/tmp/unicorn-agent-{action.job_id}-{cmd.node}.out"],
                capture=False,
            )
            self.steps[(action.job_id, cmd.node)] = step
            self.detector.expect_agent(action.job_id, cmd.node, time.monotonic())

    async def _restart_agent(self, action: RestartAgent) -> None:
        """A new agent on a node whose agent is gone, with the argv of the task's latest launch."""
        task = self.snap.tasks.get(action.task_id)
        if task is None or task.layout is None or action.node not in task.nodes:
            raise InvalidArgument(f"restart_agent {action.action_id}: task no longer runs on {action.node}")
        render = renderer(self.cfg.agent, self.snap.gpus_per_node, task.generation)
        argv = tuple(render(task, task.layout, task.nodes)[action.node])
        # Commands written for the gone agent (e.g. this rung's restart_ranks) are void:
        # the new agent would otherwise restart the ranks it just started.
        stream = self.keys.agent_commands(action.job_id, action.node)
        await redis_io.call(("DEL", stream), self.client.delete(stream))
        command = (NodeArgv(action.node, argv),)
        await self._launch(LaunchAgents(action.action_id, task.task_id, action.job_id, command))

    async def _replan(self, action: Replan) -> None:
        async with self._lock:
            snap = self.snap
            plan = plan_for(snap, gpu_spec(self.cfg.plan.gpu), FailureModel(self.cfg.plan.node_mtbf_h))
            if plan is None:
                log.info("replan", reason=action.reason, tasks=0)
                return
            gen = snap.plan_generation + 1
            render = renderer(self.cfg.agent, snap.gpus_per_node, gen)
            decision = plan_transition(snap, plan, render, time.time())
            log.info(
                "replan",
                reason=action.reason,
                generation=gen,
                plan={a.task: a.workers for a in plan.assignments},
                actions=len(decision.actions),
            )
            self._committed(snap, await self.store.apply(snap, decision))
            for note in decision.notes:
                log.info("decision", note=note)

    async def _check_node(self, action: CheckNode) -> None:
        argv = [str(bin_dir(self.cfg.agent) / "unicornctl"), "node-check"]
        try:
            out = await self.slurm.run_on_nodes([action.node], argv, timeout_s=120.0)
            passed, detail = out.exit_code == 0, (out.stderr or out.stdout).strip()[-300:]
        except UnicornError as e:
            passed, detail = False, str(e)
        log.info("node_check", node=action.node, passed=passed, detail=detail)
        await self.decide(decide.on_node_check, action.node, passed, time.time(), detail)

    async def _incident_log(self, doc: dict[str, Any]) -> None:
        await redis_io.call(
            ("XADD", self.keys.incidents()),
            self.client.xadd(
                self.keys.incidents(), {PAYLOAD_FIELD: json.dumps({"t": time.time(), **doc})}, maxlen=10_000
            ),
        )


async def run_daemon(cfg: Config, *, config_path: str | None = None) -> int:
    from unicorn_core.slurm import make_backend

    slurm = await make_backend(cfg.slurm)
    client = redis_io.connect(cfg.redis, client_name="unicornd")
    try:
        return await Daemon(cfg, slurm, client, config_path=config_path).run()
    finally:
        await client.aclose()
