"""The scale bench's node agents: N emulated ``unicorn-agent`` speaking the real protocol.

Every message is a :mod:`unicorn_core.protocol` message, encoded by its encoder and written
where the real agent writes it (:mod:`launcher.outbox`): a heartbeat is ``SET
hb(job, node) PX heartbeat_ttl`` plus ``XADD events(job) MAXLEN ~ 100000``, once a
second per agent; iteration timings, exits and GPU events are ``XADD events(job)``;
answers are ``XADD cmd-results(job)``. Commands are read from ``cmd(job, node)`` from the
start and deleted once handled, as the agent does. What is emulated: one process and one
Redis connection write for all agents (each tick's messages in one pipeline, where 4,096
agents would use 4,096 connections; Redis receives the same commands), and what the
training does (:class:`AgentTimings`): no torchrun, no ranks, no checkpoints.

Training: a job iterates every ``iter_s`` while every node of it has a live agent whose
ranks run; its last node reports each iteration (Megatron-LM's last rank prints the
iteration line). ``iter_s`` is the step time of the layout the job runs: whenever its agents
start or relaunch, :class:`Fleet` reads the job's task record as unicornd committed it and
asks ``step_time`` (the bench passes the planner's performance model). A job keeping the
step time of its first layout after a replan gave it fewer nodes would report that layout
as faster than the model says, and unicornd's calibration would then reshuffle the
cluster on that false evidence (session 24: 67 of 200 tasks moved at the second drain in
an offline replay, 2 with the step time following the layout). A crashed rank,
a dead node or a GPU fault stalls the whole job until unicornd restarts or relaunches it.

Faults (:func:`fault_schedule`, a Poisson process seeded by the bench's seed):

- ``rank_crash``: a rank of the node is killed (``ProcessExit`` with SIGKILL: SEV2, restart);
- ``gpu_ecc``: an uncorrectable ECC error (``GpuHealthEvent``: SEV1 confirmed by NVML: drain,
  replan) and the rank on that GPU dies;
- ``node_loss``: the node dies: its agent falls silent (its heartbeat key expires) and
  slurmctld marks it NOT_RESPONDING later (:class:`scale_slurm.ScriptedSlurm`);
- ``rack``: ``rack_size`` consecutive nodes die at once (a rack's power or switch).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import redis.asyncio as aioredis
from scale_slurm import SlurmEvent

from unicorn_core import protocol, redis_io
from unicorn_core.errors import RedisCallError
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.protocol import (
    AgentAction,
    AgentCommand,
    CommandResult,
    GpuFaultKind,
    GpuHealthEvent,
    Heartbeat,
    IterationTiming,
    Message,
    ProcessExit,
)

STREAM_MAXLEN: Final = 100_000
""":data:`launcher.outbox.STREAM_MAXLEN` (not imported: the bench process needs no torch)."""
SINGLE_KINDS: Final = ("rank_crash", "gpu_ecc", "node_loss")
TICK_S: Final = 0.05
LATE_TICK_RECORD_S: Final = 0.2
COMMAND_BLOCK_MS: Final = 200
SILENT_KINDS: Final = frozenset({"node_loss", "rack"})
"""Faults that unicornd only sees as silence (no message)."""


# --- the fault schedule (pure) ----------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``at_s`` seconds into the measurement window, on ``nodes``."""

    at_s: float
    kind: str
    nodes: tuple[str, ...]


def racks(nodes: Sequence[str], rack_size: int) -> list[tuple[str, ...]]:
    """The full racks: ``rack_size`` consecutive nodes in name order."""
    ordered = sorted(nodes)
    return [tuple(ordered[i : i + rack_size]) for i in range(0, len(ordered) - rack_size + 1, rack_size)]


def fault_schedule(
    seed: int,
    nodes: Sequence[str],
    duration_s: float,
    *,
    rate_per_min: float,
    bursts: int,
    rack_size: int = 16,
    weights: Mapping[str, float] | None = None,
) -> list[Fault]:
    """Faults over ``[0, duration_s)``, in time order: ``bursts`` whole racks at uniformly
    drawn times (as many as there are racks), and single-node faults arriving as a Poisson
    process of ``rate_per_min``, of a kind drawn by ``weights`` (default: half rank
    crashes, a quarter each ECC errors and node losses), on nodes outside those racks. A
    node that died is never chosen again; deterministic in its arguments."""
    if rate_per_min < 0 or bursts < 0 or rack_size < 1:
        raise ValueError("need rate_per_min >= 0, bursts >= 0, rack_size >= 1")
    rng = random.Random(seed)
    w = dict(weights or {"rank_crash": 0.5, "gpu_ecc": 0.25, "node_loss": 0.25})
    kinds, shares = list(w), [w[k] for k in w]
    whole = racks(nodes, rack_size)
    chosen = rng.sample(whole, min(bursts, len(whole)))
    out = [Fault(rng.uniform(0, duration_s), "rack", r) for r in chosen]
    dead = {n for r in chosen for n in r}
    t = 0.0
    while rate_per_min > 0:
        t += rng.expovariate(rate_per_min / 60.0)
        if t >= duration_s:
            break
        kind = rng.choices(kinds, shares)[0]
        alive = [n for n in sorted(nodes) if n not in dead]
        if not alive:
            break
        node = rng.choice(alive)
        if kind in SILENT_KINDS:
            dead.add(node)
        out.append(Fault(t, kind, (node,)))
    return sorted(out, key=lambda f: f.at_s)


def deaths(faults: Iterable[Fault]) -> dict[str, float]:
    """When each node dies (seconds into the window): node losses and racks."""
    out: dict[str, float] = {}
    for f in faults:
        if f.kind in SILENT_KINDS:
            for n in f.nodes:
                out.setdefault(n, f.at_s)
    return out


# --- the agents -------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentTimings:
    """How long the emulated node side takes (assumed, in the range the dev cluster shows:
    BENCHMARKS.md's recovery bench resumes a rank exception in ~6 s)."""

    agent_start_s: float = 0.5
    """An agent step started to its first heartbeat (Python start, Redis connect)."""
    restart_s: float = 1.0
    """``restart_ranks``/``relaunch``: the old ranks stopped and torchrun started (answered)."""
    resume_s: float = 3.0
    """Ranks started to training again (restore from the memory tier, warm-up)."""
    checkpoint_s: float = 0.3
    """``checkpoint_now``: answered once SIGUSR1 reached the ranks."""


@dataclass
class Agent:
    job_id: int
    node: str
    pid: int
    launch_id: str
    ready_mono: float
    """When its ranks train (inf: crashed, waiting for a restart)."""
    alive: bool = True
    seq: int = 0
    cursor: str = "0-0"
    last_beat_wall: float = 0.0


@dataclass
class Job:
    job_id: int
    task_id: str
    nodes: tuple[str, ...]
    ranks_per_node: int
    iteration: int
    iter_s: float
    samples: int
    next_iter_mono: float = 0.0


@dataclass
class InjectedFault:
    """A fault as injected: when (wall), whom, and when unicornd could first know of it
    (``evidence_wall``: the message written, Redis's time; for silence, the earliest last
    heartbeat of its nodes plus the heartbeat timeout)."""

    fault_id: int
    kind: str
    nodes: tuple[str, ...]
    at_wall: float
    job_id: int | None
    evidence_wall: float | None = None
    entry_id: str = ""
    """The stream entry of the fault's message (unicornd's finding ids start with it)."""


@dataclass
class FleetCounters:
    heartbeats: int = 0
    iterations: int = 0
    events: int = 0
    """Entries written to ``events`` and ``cmd-results`` streams (what unicornd must read)."""
    commands: Counter[str] = field(default_factory=Counter)
    ticks: int = 0
    late_ticks: int = 0
    """Ticks that started more than one tick late (the generator could not keep up)."""
    late: list[tuple[float, float]] = field(default_factory=list)
    """(wall time, seconds late) of ticks :data:`LATE_TICK_RECORD_S` or more late: the
    generator itself stalled, so its agents' reports really were late."""
    write_delay_max_s: float = 0.0
    """The longest a tick's messages waited to be written (Redis stalled, or the generator
    fell behind)."""


class Fleet:
    """Every emulated agent and job, and the faults injected into them (module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        jobs: Sequence[Job],
        *,
        heartbeat_interval_s: float,
        heartbeat_ttl_s: float,
        heartbeat_timeout_s: float,
        events_stream: str,
        timings: AgentTimings | None = None,
        seed: int = 0,
        step_time: Callable[[bytes], float | None] | None = None,
    ) -> None:
        """``step_time``: a task record as stored (:meth:`RedisKeys.state_records`) -> the
        step time of its layout (None: unknown, the job keeps its step time)."""
        self.client = client
        self.keys = keys
        self.jobs = {j.job_id: j for j in jobs}
        self.hb_interval_s = heartbeat_interval_s
        self.hb_ttl_ms = int(heartbeat_ttl_s * 1000)
        self.hb_timeout_s = heartbeat_timeout_s
        self.events_stream = events_stream
        self.timings = timings or AgentTimings()
        self.rng = random.Random(seed)
        self.step_time = step_time
        self._layout_reads: dict[int, asyncio.Task[None]] = {}
        """Jobs whose step time is being read (one read at a time per job)."""
        self.step_time_changes = 0
        self.agents: dict[tuple[int, str], Agent] = {}
        self.dead_nodes: set[str] = set()
        self.counters = FleetCounters()
        self.faults: list[InjectedFault] = []
        self.commands: list[dict[str, Any]] = []
        """Commands received: entry time (Redis's, wall), job, node, action, id."""
        self.slurm_events: list[tuple[float, int, str, int]] = []
        """What Slurm did to a job, as this fleet followed it: (wall time, job, op, nodes)."""
        self.errors: Counter[str] = Counter()
        self._pids = itertools.count(10_000)
        self._heap: list[tuple[float, int, Agent]] = []
        self._order = itertools.count()
        self._out: list[tuple[str, Message]] = []
        """(stream, message): written with the next tick."""
        self._deletes: list[str] = []
        """Heartbeat keys of agents that stopped cleanly (deleted with the next tick)."""
        self._queued: list[
            tuple[float, list[tuple[str, Message]], list[str], list[tuple[InjectedFault, Message]]]
        ] = []
        """Ticks not written yet: (tick time, messages, deletes, fault marks)."""
        self._queued_event = asyncio.Event()
        self._fault_marks: list[tuple[InjectedFault, Message]] = []
        """Faults whose message goes out with the next tick: its XADD's entry id (Redis's
        clock) is when unicornd could first know of the fault."""
        now = time.monotonic()
        for job in jobs:
            for node in job.nodes:
                self._start_agent(job.job_id, node, "", now, phase=self.rng.random() * heartbeat_interval_s)
            job.next_iter_mono = now + self.rng.random() * job.iter_s

    # --- agents come and go -------------------------------------------------------------

    def _start_agent(self, job_id: int, node: str, launch_id: str, now: float, *, phase: float) -> None:
        old = self.agents.get((job_id, node))
        if old is not None:
            old.alive = False
        agent = Agent(job_id, node, next(self._pids), launch_id, ready_mono=now + phase)
        self.agents[(job_id, node)] = agent
        heapq.heappush(self._heap, (now + phase, next(self._order), agent))

    def _kill(self, job_id: int, nodes: Iterable[str]) -> None:
        for node in nodes:
            agent = self.agents.pop((job_id, node), None)
            if agent is not None:
                agent.alive = False

    def on_slurm(self, ev: SlurmEvent) -> None:
        """Follow what Slurm did: steps start agents, requeues and shrinks end them."""
        now = time.monotonic()
        job = self.jobs.get(ev.job_id) if ev.job_id is not None else None
        if ev.job_id is not None:
            self.slurm_events.append((time.time(), ev.job_id, ev.op, len(ev.nodes)))
        if ev.op == "launch" and job is not None and ev.job_id is not None:
            for node in ev.nodes:
                if node in self.dead_nodes:
                    continue  # srun cannot start anything on a dead node
                self._start_agent(ev.job_id, node, ev.launch_id, now, phase=self.timings.agent_start_s)
                self.agents[(ev.job_id, node)].ready_mono = (
                    now + self.timings.agent_start_s + self.timings.resume_s
                )
            self._follow_layout(job)
        elif ev.op in ("requeue", "cancel") and job is not None:
            self._kill(job.job_id, job.nodes)
            job.nodes = ev.nodes if ev.op == "requeue" else ()
        elif ev.op == "shrink" and job is not None:
            self._kill(job.job_id, [n for n in job.nodes if n not in ev.nodes])
            job.nodes = ev.nodes
        elif ev.op == "grow" and job is not None:
            job.nodes = (*job.nodes, *ev.nodes)
        elif ev.op == "down":
            for j in self.jobs.values():
                if set(ev.nodes) & set(j.nodes):
                    self._kill(j.job_id, ev.nodes)
                    j.nodes = tuple(n for n in j.nodes if n not in ev.nodes)

    def _follow_layout(self, job: Job) -> None:
        """Read ``job``'s committed task record and take its layout's step time (module
        docstring). A read already under way for the job is enough: the record it reads
        is at least as new as the launch that asked."""
        if self.step_time is None or job.job_id in self._layout_reads:
            return
        step_time = self.step_time

        async def read() -> None:
            try:
                raw = await redis_io.call(
                    ("HGET", "tasks"),
                    self.client.hget(self.keys.state_records("tasks"), job.task_id),
                )
            except RedisCallError as e:
                self.errors[f"layout read: {str(e)[:60]}"] += 1
                return
            finally:
                self._layout_reads.pop(job.job_id, None)
            seconds = step_time(cast(bytes, raw)) if raw is not None else None
            if seconds is not None and seconds != job.iter_s:
                job.iter_s = seconds
                self.step_time_changes += 1

        self._layout_reads[job.job_id] = asyncio.get_running_loop().create_task(read())

    def live_agents(self) -> int:
        return sum(1 for a in self.agents.values() if a.alive)

    # --- faults -------------------------------------------------------------------------

    def inject(self, fault: Fault, fault_id: int) -> list[InjectedFault]:
        """Inject ``fault`` now (its messages go out with the next tick); one record per job
        it hits (a rack can hit several), or one without a job (an idle node)."""
        wall = time.time()
        owners = [a for a in self.agents.values() if a.alive and a.node in fault.nodes]
        by_job: dict[int | None, list[Agent]] = {}
        for agent in owners:
            by_job.setdefault(agent.job_id, []).append(agent)
        if not by_job:
            by_job[None] = []
        records = []
        for job_id, hit in by_job.items():
            nodes = tuple(a.node for a in hit) or fault.nodes
            rec = InjectedFault(fault_id, fault.kind, nodes, wall, job_id)
            records.append(rec)
            self.faults.append(rec)
            if fault.kind in SILENT_KINDS:
                # the first of its nodes whose silence outlasts the timeout is the first evidence
                beats = [a.last_beat_wall for a in hit if a.last_beat_wall > 0]
                rec.evidence_wall = (min(beats) if beats else wall) + self.hb_timeout_s if hit else None
                if job_id is not None:
                    self._kill(job_id, nodes)
            elif hit:
                self._message_fault(fault.kind, hit[0], rec, wall)
        if fault.kind in SILENT_KINDS:
            self.dead_nodes.update(fault.nodes)
        return records

    def _message_fault(self, kind: str, agent: Agent, rec: InjectedFault, wall: float) -> None:
        agent.ready_mono = math.inf  # its rank died: the job stalls until a restart
        job = self.jobs[agent.job_id]
        rank = job.nodes.index(agent.node) * job.ranks_per_node if agent.node in job.nodes else 0
        msg: Message
        if kind == "rank_crash":
            msg = ProcessExit(
                job_id=agent.job_id,
                node=agent.node,
                wall_time_s=wall,
                rank=rank,
                local_rank=0,
                pid=agent.pid + 1,
                exit_code=None,
                signal=9,
                error_file_text=None,
                stderr_tail="",
            )
        else:
            msg = GpuHealthEvent(
                job_id=agent.job_id,
                node=agent.node,
                wall_time_s=wall,
                gpu_index=0,
                kind=GpuFaultKind.ECC_UNCORRECTABLE,
                value=1.0,
                detail="uncorrectable ECC errors: 1 (volatile)",
                injected=True,
            )
        self._out.append((self.keys.events(agent.job_id), msg))
        self._fault_marks.append((rec, msg))  # the message leaves with the next tick (<= TICK_S)

    # --- commands -----------------------------------------------------------------------

    def _answer_later(self, agent: Agent, cmd: AgentCommand) -> None:
        loop = asyncio.get_running_loop()
        t = self.timings
        delay = t.checkpoint_s if cmd.action is AgentAction.CHECKPOINT_NOW else t.restart_s
        if cmd.action is AgentAction.STOP:
            delay = 0.1

        def answer() -> None:
            if not agent.alive:
                return
            wall = time.time()
            detail = {"stop": "stopped", "checkpoint_now": "SIGUSR1 sent to 8 process(es)"}.get(
                cmd.action.value, "restarted"
            )
            if cmd.action in (AgentAction.RESTART_RANKS, AgentAction.RELAUNCH):
                agent.launch_id = cmd.command_id
                agent.ready_mono = time.monotonic() + t.resume_s
            if cmd.action is AgentAction.RELAUNCH:
                self._follow_layout(self.jobs[agent.job_id])
            result = CommandResult(
                job_id=agent.job_id,
                node=agent.node,
                wall_time_s=wall,
                command_id=cmd.command_id,
                ok=True,
                detail=detail,
            )
            self._out.append((self.keys.command_results(agent.job_id), result))
            if cmd.action is AgentAction.STOP:  # the agent ends and deletes its liveness key
                agent.alive = False
                self.agents.pop((agent.job_id, agent.node), None)
                self._deletes.append(self.keys.heartbeat(agent.job_id, agent.node))

        loop.call_later(delay, answer)

    async def commands_loop(self) -> None:
        """Read every live agent's command stream (one XREAD for all of them)."""
        reader = self.client
        while True:
            live = {self.keys.agent_commands(a.job_id, a.node): a for a in self.agents.values() if a.alive}
            if not live:
                await asyncio.sleep(COMMAND_BLOCK_MS / 1000)
                continue
            try:
                raw = await redis_io.call(
                    ("XREAD", "cmd"),
                    reader.xread({k: a.cursor for k, a in live.items()}, count=16, block=COMMAND_BLOCK_MS),
                )
            except RedisCallError as e:
                self.errors[f"xread: {str(e)[:80]}"] += 1
                await asyncio.sleep(0.2)
                continue
            reply = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]], raw or [])
            for stream_raw, entries in reply:
                stream = stream_raw.decode()
                agent = live.get(stream)
                if agent is None:
                    continue
                for entry_id_raw, fields in entries:
                    entry_id = entry_id_raw.decode()
                    agent.cursor = entry_id
                    await self._command(agent, stream, entry_id, fields.get(PAYLOAD_FIELD.encode(), b""))

    async def _command(self, agent: Agent, stream: str, entry_id: str, data: bytes) -> None:
        try:
            msg = protocol.decode(data)
        except Exception as e:  # a command the real agent would reject: counted
            self.errors[f"command: {e}"[:80]] += 1
            return
        if not isinstance(msg, AgentCommand):
            self.errors["command: not a command"] += 1
            return
        self.counters.commands[msg.action.value] += 1
        self.commands.append(
            {
                "t": int(entry_id.split("-", maxsplit=1)[0]) / 1000.0,
                "job": agent.job_id,
                "node": agent.node,
                "action": msg.action.value,
                "id": msg.command_id,
            }
        )
        self._answer_later(agent, msg)
        with contextlib.suppress(RedisCallError):
            await redis_io.call(("XDEL", stream), self.client.xdel(stream, entry_id))

    async def slurm_loop(self) -> None:
        """Follow the scripted Slurm's events (steps, requeues, shrinks) from its stream."""
        cursor = "0-0"
        while True:
            try:
                raw = await redis_io.call(
                    ("XREAD", self.events_stream),
                    self.client.xread({self.events_stream: cursor}, count=512, block=500),
                )
            except RedisCallError as e:
                self.errors[f"slurm events: {str(e)[:80]}"] += 1
                await asyncio.sleep(0.2)
                continue
            reply = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]], raw or [])
            for _stream, entries in reply:
                for entry_id, fields in entries:
                    cursor = entry_id.decode()
                    self.on_slurm(SlurmEvent.from_dict(json.loads(fields[b"e"])))

    # --- the tick: heartbeats, iterations, answers, faults ------------------------------

    def _job_ready(self, job: Job) -> float:
        """When every node of the job trains (inf: a node has no live, training agent)."""
        ready = 0.0
        for node in job.nodes:
            agent = self.agents.get((job.job_id, node))
            if agent is None or not agent.alive:
                return math.inf
            ready = max(ready, agent.ready_mono)
        return ready if job.nodes else math.inf

    def _tick_messages(self, now: float, wall: float) -> list[tuple[str, Message]]:
        out: list[tuple[str, Message]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, _, agent = heapq.heappop(heap)
            if not agent.alive:
                continue
            job = self.jobs[agent.job_id]
            hb = Heartbeat(
                job_id=agent.job_id,
                node=agent.node,
                wall_time_s=wall,
                agent_pid=agent.pid,
                pids=[agent.pid + 1 + i for i in range(job.ranks_per_node)],
                iteration=job.iteration,
                seq=agent.seq,
                cpu_wait_s=0.0,
            )
            agent.seq += 1
            agent.last_beat_wall = wall
            out.append(("hb", hb))
            nxt = due + self.hb_interval_s
            heapq.heappush(heap, (nxt if nxt > now else now + self.hb_interval_s, next(self._order), agent))
        for job in self.jobs.values():
            ready = self._job_ready(job)
            if ready > now:
                continue
            if job.next_iter_mono < ready:
                job.next_iter_mono = ready + job.iter_s
            if now < job.next_iter_mono:
                continue
            job.iteration += 1
            reporter = self.agents[(job.job_id, job.nodes[-1])]
            out.append(
                (
                    self.keys.events(job.job_id),
                    IterationTiming(
                        job_id=job.job_id,
                        node=reporter.node,
                        wall_time_s=wall,
                        rank=len(job.nodes) * job.ranks_per_node - 1,
                        iteration=job.iteration,
                        duration_s=job.iter_s,
                        samples=job.samples,
                        loss=2.0 + 0.01 * self.rng.gauss(0.0, 1.0),
                        launch_id=reporter.launch_id,
                    ),
                )
            )
            job.next_iter_mono += job.iter_s
            if job.next_iter_mono < now:
                job.next_iter_mono = now + job.iter_s
        return out

    async def tick_loop(self) -> None:
        """Every :data:`TICK_S`: the due heartbeats, iterations, answers and faults, handed
        to :meth:`write_loop`. A tick never waits for Redis: real agents are separate
        processes, each with its report sent (or queued in its socket) when it is due; when
        Redis stalls (an AOF rewrite's fork and disk writes), theirs reach it in the order
        sent, all before a reader's next read. A tick that waited for the previous tick's
        write would instead make the reports of a stall's duration late."""
        next_at = time.monotonic()
        while True:
            now = time.monotonic()
            if now - next_at > TICK_S:
                self.counters.late_ticks += 1
                if now - next_at >= LATE_TICK_RECORD_S:
                    self.counters.late.append((time.time(), now - next_at))
            wall = time.time()
            batch = self._tick_messages(now, wall) + self._out
            marks, deletes = self._fault_marks, self._deletes
            self._out, self._fault_marks, self._deletes = [], [], []
            if batch or deletes:
                self._queued.append((now, batch, deletes, marks))
                self._queued_event.set()
            self.counters.ticks += 1
            next_at += TICK_S
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def write_loop(self) -> None:
        """Write the ticks' messages in tick order, everything queued in one pipeline."""
        while True:
            await self._queued_event.wait()
            self._queued_event.clear()
            queued, self._queued = self._queued, []
            if not queued:
                continue
            batch = [m for q in queued for m in q[1]]
            deletes = [k for q in queued for k in q[2]]
            marks = [m for q in queued for m in q[3]]
            await self._write(batch, deletes, marks)
            delay = time.monotonic() - queued[0][0]
            self.counters.write_delay_max_s = max(self.counters.write_delay_max_s, delay)

    async def _write(
        self,
        batch: list[tuple[str, Message]],
        deletes: list[str],
        marks: list[tuple[InjectedFault, Message]],
    ) -> None:
        pipe = self.client.pipeline(transaction=False)
        hb, it, events = 0, 0, 0
        for key in deletes:
            pipe.delete(key)
        where: dict[int, int] = {}
        for stream, msg in batch:
            where[id(msg)] = len(pipe) + (1 if stream == "hb" else 0)
            data = protocol.encode(msg)
            if stream == "hb":
                assert isinstance(msg, Heartbeat)
                pipe.set(self.keys.heartbeat(msg.job_id, msg.node), data, px=self.hb_ttl_ms)
                pipe.xadd(
                    self.keys.events(msg.job_id),
                    {PAYLOAD_FIELD: data},
                    maxlen=STREAM_MAXLEN,
                    approximate=True,
                )
                hb += 1
            else:
                pipe.xadd(stream, {PAYLOAD_FIELD: data}, maxlen=STREAM_MAXLEN, approximate=True)
                it += isinstance(msg, IterationTiming)
            events += 1
        try:
            results = await redis_io.call(("PIPELINE", "agents"), pipe.execute())
        except RedisCallError as e:
            self.errors[f"write: {str(e)[:80]}"] += 1
            return
        for rec, msg in marks:
            rec.entry_id = cast(bytes, results[where[id(msg)]]).decode()
            rec.evidence_wall = int(rec.entry_id.split("-", 1)[0]) / 1000.0
        self.counters.heartbeats += hb
        self.counters.iterations += it
        self.counters.events += events

    async def faults_loop(self, schedule: Sequence[Fault], t0_wall: float) -> None:
        """Inject each fault of ``schedule`` at ``t0_wall + at_s``."""
        for i, fault in enumerate(schedule):
            await asyncio.sleep(max(0.0, t0_wall + fault.at_s - time.time()))
            self.inject(fault, i)
