"""The scale bench's Slurm: a scripted :class:`~unicorn_core.slurm.backend.SlurmBackend`.

4,096 slurmd do not fit on one 2-core machine, so ``scripts/bench/scale.py`` gives unicornd
this backend instead of the CLI one. It keeps the cluster's nodes and jobs in memory and
answers every operation as slurmctld would, after the latency measured on the dev cluster
(:class:`SlurmTimings` cites each one). What unicornd does with the answers is its own
code, and the answers cost it what the CLI backend's cost it: ``list_nodes`` and
``list_jobs`` hand the real parser (:mod:`unicorn_core.slurm.parse`) the JSON that
``sinfo --json`` / ``squeue --json`` of Slurm 22.05.8 print, each record shaped after the
recorded samples in ``tests/unicorn_core/data`` (about 1.3 KiB a node, 3 KiB a job), and
``launch_step`` starts a real process per step through :func:`unicorn_core.proc.start`,
as ``srun`` is one.

Scripted, not simulated: nodes die at the wall times of the fault schedule
(:meth:`ScriptedSlurm.schedule_deaths`; the emulated agents fall silent then), and
slurmctld marks a dead node ``NOT_RESPONDING``/``DOWN`` :attr:`SlurmTimings.not_responding_s`
later. Jobs run with ``--no-kill`` (``etc/unicorn-job.sbatch``): a dead node stays in its
job until ``down`` removes it. What changed the cluster is handed to ``on_event``
(requeues, shrinks, cancels, steps started), so the emulated agents start and die with
their Slurm steps. Pure apart from the awaited latencies and the step processes; the
clock is injected, so the unit tests drive it with fake time.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shlex
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from unicorn_core import proc
from unicorn_core.errors import InvalidArgument, UnknownJob, UnknownNode
from unicorn_core.proc import CommandOutput
from unicorn_core.slurm.backend import ResizeUnsupported, StepHandle, UnknownReservation
from unicorn_core.slurm.hostlist import compress
from unicorn_core.slurm.parse import jobs_from_squeue_json, nodes_from_sinfo_json
from unicorn_core.slurm.types import GrowResult, JobInfo, JobState, NodeInfo, check_job_id, check_reason

SAMPLES: Final = Path(__file__).resolve().parents[2] / "tests" / "unicorn_core" / "data"
"""``sinfo --json`` and ``squeue --json`` recorded on the dev cluster (Slurm 22.05.8)."""
PARTITION: Final = "gpu"
STEP_PROGRAM: Final = ("true",)
"""What a scripted step runs: a real process (srun is one), which ends at once."""


@dataclass(frozen=True)
class SlurmTimings:
    """How long slurmctld takes to answer, in seconds, and where each figure comes from.

    Measured on the dev cluster (Slurm 22.05.8, this machine kind), in
    ``/work/shared/notes/slurm-on-one-machine.md`` ("notes"), ``BENCHMARKS.md`` and
    :mod:`unicorn_core.slurm.cli`'s docstrings; :attr:`query_per_record_s` is assumed.
    """

    command_s: float = 0.006
    """``scontrol update nodename=X state=drain``: 6 ms (notes, "drain 6 ms"). Used for every
    node update, requeue and cancel command."""
    query_base_s: float = 0.006
    """One ``sinfo``/``squeue``/``scontrol show`` round trip through slurmctld, as a drain."""
    query_per_record_s: float = 10e-6
    """Assumed, not measured (the dev cluster has 4-8 nodes): slurmctld's cost per node or
    job record in a query, 10 us (4,096 nodes: +41 ms)."""
    step_s: float = 0.027
    """``srun --jobid=J -w nX -N1 --overlap CMD``: 27 ms (notes)."""
    resize_s: float = 0.010
    """``scontrol update jobid=J NumNodes=N`` (shrink) and job expansion: ~10 ms (notes)."""
    requeue_running_s: float = 2.6
    """``scontrol requeue`` to RUNNING again with the adapter's StartTime poke: 2.5-2.8 s
    (:meth:`unicorn_core.slurm.cli.CliSlurm.requeue`)."""
    not_responding_s: float = 5.5
    """A dead node to NOT_RESPONDING in slurmctld with SlurmdTimeout=3: 4.9-6.3 s
    (BENCHMARKS.md, the recovery bench; a production SlurmdTimeout of 300 s is far slower)."""
    node_check_s: float = 1.0
    """Assumed: ``unicorn-node-check`` on a healthy node (srun + the check itself)."""

    def query_s(self, records: int) -> float:
        return self.query_base_s + self.query_per_record_s * records


@dataclass(frozen=True)
class SlurmEvent:
    """Something Slurm did to jobs or nodes that the emulated agents must follow.

    ``op``: ``launch`` (a step started ``nodes``' agents, ``launch_id`` from the argv),
    ``requeue``, ``shrink`` (``nodes`` kept), ``grow`` (``nodes`` added), ``cancel``,
    ``drain``, ``down``, ``resume``, ``node_check``. ``t`` is wall time."""

    t: float
    op: str
    job_id: int | None = None
    nodes: tuple[str, ...] = ()
    launch_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "op": self.op,
            "job": self.job_id,
            "nodes": list(self.nodes),
            "launch": self.launch_id,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SlurmEvent:
        job = d.get("job")
        return cls(
            float(d["t"]),
            str(d["op"]),
            None if job is None else int(job),
            tuple(d["nodes"]),
            str(d["launch"]),
        )


Sink = Callable[[SlurmEvent], Awaitable[None]]


@dataclass
class _Node:
    name: str
    gpus: int
    dies_at: float | None = None
    drained: bool = False
    down: bool = False
    reason: str = ""


@dataclass
class _Job:
    job_id: int
    name: str
    nodes: tuple[str, ...]
    state: JobState = JobState.RUNNING
    restarts: int = 0
    runs_at: float | None = None
    """While PENDING after a requeue: when the scheduler starts it (on ``nodes``)."""


@dataclass
class _Templates:
    node: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls) -> _Templates:
        sinfo = json.loads((SAMPLES / "sinfo-22.05.json").read_text())
        squeue = json.loads((SAMPLES / "squeue-22.05.json").read_text())
        running = next(j for j in squeue["jobs"] if j["job_state"] == "RUNNING")
        return cls(node=sinfo["nodes"][0], job=running, meta=sinfo["meta"])


def step_launch_id(argv: Sequence[str]) -> str:
    """The ``--launch-id`` of a ``unicorn-agent`` argv (:func:`unicornd.launch.agent_argv`),
    also inside the ``/bin/sh -c`` that logs its output (:func:`unicornd.launch.logged`)."""
    if len(argv) == 3 and argv[1] == "-c" and argv[0].endswith("sh"):
        argv = shlex.split(argv[2])
    for i, word in enumerate(argv[:-1]):
        if word == "--":
            break
        if word == "--launch-id":
            return argv[i + 1]
    return ""


class ScriptedSlurm:
    """Slurm for the scale bench (see the module docstring)."""

    name = "scripted"

    def __init__(
        self,
        nodes: Iterable[str],
        jobs: Mapping[int, Sequence[str]],
        *,
        gpus_per_node: int = 8,
        deaths: Mapping[str, float] | None = None,
        timings: SlurmTimings | None = None,
        on_event: Sink | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.timings = timings or SlurmTimings()
        self.clock = clock
        self.sleep = sleep
        self.on_event = on_event
        self.nodes = {n: _Node(n, gpus_per_node) for n in nodes}
        self.jobs = {j: _Job(j, f"unicorn-{j}", tuple(ns)) for j, ns in jobs.items()}
        self.calls: list[SlurmEvent] = []
        """Every change asked of this Slurm (and every node check), in order."""
        self._templates = _Templates.load()
        self._version = 0
        self._cache: dict[str, tuple[object, str]] = {}
        self._rendered: dict[str, tuple[object, str]] = {}
        self.schedule_deaths(deaths or {})

    def schedule_deaths(self, deaths: Mapping[str, float]) -> None:
        """Node -> the wall time its slurmd dies (the fault schedule's node losses)."""
        for node, t in deaths.items():
            self._node(node).dies_at = t
        self._version += 1

    # ------------------------------------------------------------------ the clock's view

    def not_responding(self, node: str, now: float | None = None) -> bool:
        """slurmctld has marked ``node`` NOT_RESPONDING (its slurmd died long enough ago)."""
        dies = self._node(node).dies_at
        t = self.clock() if now is None else now
        return dies is not None and t >= dies + self.timings.not_responding_s

    def _advance(self, now: float) -> None:
        """Start the requeued jobs whose start time passed (the scheduler's pass)."""
        for job in self.jobs.values():
            if job.state is JobState.PENDING and job.runs_at is not None and now >= job.runs_at:
                job.state, job.runs_at = JobState.RUNNING, None
                self._version += 1

    def _node(self, name: str) -> _Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise UnknownNode(name) from None

    def _job(self, job_id: int) -> _Job:
        check_job_id(job_id)
        try:
            return self.jobs[job_id]
        except KeyError:
            raise UnknownJob(job_id) from None

    def _held(self) -> dict[str, int]:
        return {n: j.job_id for j in self.jobs.values() if j.state is JobState.RUNNING for n in j.nodes}

    async def _emit(
        self, op: str, job_id: int | None, nodes: Sequence[str] = (), launch_id: str = ""
    ) -> None:
        self._version += 1
        event = SlurmEvent(self.clock(), op, job_id, tuple(nodes), launch_id)
        self.calls.append(event)
        if self.on_event is not None:
            await self.on_event(event)

    # ------------------------------------------------------------------ rendering

    def sinfo_json(self) -> str:
        """What ``sinfo --json`` prints now (Slurm 22.05.8's shape), cached between changes."""
        now = self.clock()
        self._advance(now)
        silent = frozenset(
            n for n, rec in self.nodes.items() if rec.dies_at is not None and self.not_responding(n, now)
        )
        key = (self._version, silent)
        cached = self._cache.get("sinfo")
        if cached is not None and cached[0] == key:
            return cached[1]
        held = self._held()
        records = []
        for name in sorted(self.nodes):
            rec = self.nodes[name]
            base = "down" if rec.down or name in silent else "allocated" if name in held else "idle"
            flags = [f for f, on in (("DRAIN", rec.drained), ("NOT_RESPONDING", name in silent)) if on]
            # Each node's record is rendered once per state it is in (slurmctld's work, not
            # unicornd's: rendering all 4,096 afresh on each change took 55 ms of its loop).
            state = (base, tuple(flags), rec.reason, rec.gpus, name in held)
            done = self._rendered.get(name)
            if done is not None and done[0] == state:
                records.append(done[1])
                continue
            d = copy.copy(self._templates.node)
            d.update(
                name=name,
                hostname=name,
                state=base,
                state_flags=flags,
                reason=rec.reason,
                gres=f"gpu:{rec.gpus}",
                gres_used=f"gpu:{rec.gpus if name in held else 0}",
                partitions=[PARTITION],
            )
            self._rendered[name] = (state, json.dumps(d))
            records.append(self._rendered[name][1])
        meta = json.dumps(self._templates.meta)
        text = f'{{"meta": {meta}, "errors": [], "nodes": [{", ".join(records)}]}}'
        self._cache["sinfo"] = (key, text)
        return text

    def squeue_json(self) -> str:
        """What ``squeue --json`` prints now, cached between changes."""
        self._advance(self.clock())
        key = self._version
        cached = self._cache.get("squeue")
        if cached is not None and cached[0] == key:
            return cached[1]
        records = []
        for job in sorted(self.jobs.values(), key=lambda j: j.job_id):
            d = copy.copy(self._templates.job)
            running = job.state is JobState.RUNNING
            hosts = compress(list(job.nodes)) if running and job.nodes else ""
            allocated = [
                {
                    "sockets": {"0": {"cores": {"0": "allocated"}}},
                    "nodename": n,
                    "cpus_used": 0,
                    "memory_used": 0,
                    "memory_allocated": 0,
                }
                for n in (job.nodes if running else ())
            ]
            d.update(
                job_id=job.job_id,
                name=job.name,
                job_state=job.state.value,
                state_reason="None" if running else "BeginTime",
                nodes=hosts,
                node_count=len(job.nodes),
                restart_cnt=job.restarts,
                job_resources={
                    "nodes": hosts,
                    "allocated_hosts": len(allocated),
                    "allocated_nodes": allocated,
                },
            )
            records.append(d)
        text = json.dumps({"meta": self._templates.meta, "errors": [], "jobs": records})
        self._cache["squeue"] = (key, text)
        return text

    # ------------------------------------------------------------------ queries

    async def version(self) -> str:
        return "22.05.8"

    async def list_nodes(self) -> list[NodeInfo]:
        # Parsed off the event loop, as the real adapter does (unicorn_core.slurm.cli).
        text = self.sinfo_json()
        await self.sleep(self.timings.query_s(len(self.nodes)))
        return await asyncio.to_thread(nodes_from_sinfo_json, text)

    async def get_node(self, name: str) -> NodeInfo:
        self._node(name)
        for info in await self.list_nodes():
            if info.name == name:
                return info
        raise UnknownNode(name)

    async def list_partitions(self) -> list[str]:
        await self.sleep(self.timings.query_base_s)
        return [PARTITION]

    async def reservation_nodes(self, name: str) -> tuple[str, ...]:
        await self.sleep(self.timings.query_base_s)
        raise UnknownReservation(name)

    async def list_jobs(self) -> list[JobInfo]:
        text = self.squeue_json()
        await self.sleep(self.timings.query_s(len(self.jobs)))
        return await asyncio.to_thread(jobs_from_squeue_json, text)

    async def get_job(self, job_id: int) -> JobInfo:
        self._job(job_id)
        await self.sleep(self.timings.query_base_s)
        for info in jobs_from_squeue_json(self.squeue_json()):
            if info.job_id == job_id:
                return info
        raise UnknownJob(job_id)

    # ------------------------------------------------------------------ nodes

    async def drain(self, node: str, reason: str) -> None:
        await self.drain_nodes([node], reason)

    async def drain_nodes(self, nodes: Sequence[str], reason: str) -> None:
        """One command for all of ``nodes`` (scontrol takes a hostlist): one latency."""
        recs = [self._node(n) for n in nodes]
        await self.sleep(self.timings.command_s)
        for rec in recs:
            rec.drained, rec.reason = True, check_reason(reason)
        await self._emit("drain", None, tuple(nodes))

    async def down(self, node: str, reason: str) -> None:
        await self.down_nodes([node], reason)

    async def down_nodes(self, nodes: Sequence[str], reason: str) -> None:
        """DOWN; a ``--no-kill`` job that held a node loses it (its step there dies)."""
        recs = [self._node(n) for n in nodes]
        await self.sleep(self.timings.command_s)
        for rec in recs:
            rec.down, rec.reason = True, check_reason(reason)
        gone = set(nodes)
        for job in self.jobs.values():
            if gone & set(job.nodes) and job.state is JobState.RUNNING:
                job.nodes = tuple(n for n in job.nodes if n not in gone)
        await self._emit("down", None, tuple(nodes))

    async def resume(self, node: str) -> None:
        rec = self._node(node)
        await self.sleep(self.timings.command_s)
        rec.drained = rec.down = False
        rec.reason = ""
        await self._emit("resume", None, (node,))

    # ------------------------------------------------------------------ jobs

    async def submit_batch(self, script: str, options: Sequence[str] = ()) -> int:
        raise InvalidArgument("the scale bench's Slurm runs only the jobs it was given")

    async def launch_step(
        self,
        job_id: int,
        nodes: Sequence[str],
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        options: Sequence[str] = (),
        capture: bool = True,
    ) -> StepHandle:
        """A step on ``nodes`` of running ``job_id``: the agents there start (``launch``)."""
        job = self._job(job_id)
        self._advance(self.clock())
        if not nodes or not argv:
            raise InvalidArgument("launch_step needs nodes and a command")
        if job.state is not JobState.RUNNING:
            raise InvalidArgument(f"job {job_id} is {job.state.value}, not RUNNING")
        missing = [n for n in nodes if n not in job.nodes]
        if missing:
            raise InvalidArgument(f"nodes {missing} are not in job {job_id}")
        await self.sleep(self.timings.step_s)
        process = await proc.start(STEP_PROGRAM, capture=False)
        await self._emit("launch", job_id, nodes, step_launch_id(argv))
        return StepHandle(job_id, tuple(nodes), tuple(argv), process)

    async def run_on_nodes(
        self,
        nodes: Sequence[str],
        argv: Sequence[str],
        *,
        timeout_s: float,
        job_id: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandOutput:
        """The node check: healthy nodes pass after :attr:`SlurmTimings.node_check_s`; on a
        dead node srun fails once slurmctld knows (no verdict of the check: it never ran)."""
        for n in nodes:
            self._node(n)
        await self._emit("node_check", job_id, nodes)
        now = self.clock()
        dead = [n for n in nodes if self.nodes[n].dies_at is not None and now >= (self.nodes[n].dies_at or 0)]
        if not dead:
            await self.sleep(min(timeout_s, self.timings.node_check_s))
            return CommandOutput(tuple(argv), 0, "healthy", "", self.timings.node_check_s)
        known = max((self.nodes[n].dies_at or now) + self.timings.not_responding_s for n in dead)
        wait = min(timeout_s, max(0.0, known - now))
        await self.sleep(wait)
        why = f"srun: error: Unable to create step: Required node not available (down): {','.join(dead)}"
        return CommandOutput(tuple(argv), 1, "", why, wait)

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        job = self._job(job_id)
        if not keep_nodes or not set(keep_nodes) <= set(job.nodes):
            raise InvalidArgument(
                f"job {job_id} runs on {compress(list(job.nodes))}, cannot keep {list(keep_nodes)}"
            )
        await self.sleep(self.timings.resize_s)
        job.nodes = tuple(keep_nodes)
        await self._emit("shrink", job_id, keep_nodes)

    async def grow(self, job_id: int, add_nodes: int, *, exclude: Sequence[str] = ()) -> GrowResult:
        """Job expansion onto the first free, usable nodes (by name) not in ``exclude``."""
        job = self._job(job_id)
        if job.state is not JobState.RUNNING:
            raise InvalidArgument(f"job {job_id} is {job.state.value}, not RUNNING")
        await self.sleep(self.timings.resize_s)
        held, avoid, now = self._held(), set(exclude), self.clock()
        free = [
            n
            for n, rec in sorted(self.nodes.items())
            if n not in held
            and n not in avoid
            and not rec.drained
            and not rec.down
            and not self.not_responding(n, now)
        ]
        if len(free) < add_nodes:
            raise ResizeUnsupported(f"job {job_id} cannot grow: {len(free)} free nodes, {add_nodes} asked")
        added = tuple(free[:add_nodes])
        job.nodes = job.nodes + added
        await self._emit("grow", job_id, added)
        return GrowResult(job_id, "expand", added)

    async def requeue(
        self, job_id: int, nodes: Sequence[str] = (), *, placed: Callable[[], None] | None = None
    ) -> None:
        """PENDING now (its steps die), RUNNING on ``nodes`` :attr:`SlurmTimings.requeue_running_s`
        later; returns when the CLI adapter's requeue would (after its StartTime poke)."""
        job = self._job(job_id)
        for n in nodes:
            self._node(n)
        await self.sleep(self.timings.command_s)
        start = self.clock()
        if job.state is not JobState.PENDING:
            job.restarts += 1
        job.state = JobState.PENDING
        job.nodes = tuple(nodes) or job.nodes
        job.runs_at = start + self.timings.requeue_running_s
        await self._emit("requeue", job_id, job.nodes)
        if placed is not None:
            placed()
        await self.sleep(max(0.0, self.timings.requeue_running_s - 0.1))

    async def cancel(self, job_id: int, *, signal: str | None = None) -> None:
        job = self._job(job_id)
        await self.sleep(self.timings.command_s)
        if signal is None:
            job.state, job.runs_at = JobState.CANCELLED, None
            await self._emit("cancel", job_id, job.nodes)
