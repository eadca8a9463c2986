"""The one fake Slurm of the tests: :class:`FakeSlurm`, a scripted
:class:`~unicorn_core.slurm.backend.SlurmBackend` for code that must not need a cluster.

Nodes and jobs are scripted (names or full records at construction, :meth:`FakeSlurm.set_node`,
:meth:`FakeSlurm.add_job`, :meth:`FakeSlurm.start_job`), and every operation changes them
as Slurm would: ``drain`` sets DRAIN and the reason, ``resume`` clears both, ``requeue``
puts a job back to PENDING with one more restart, ``cancel`` ends it, ``shrink`` and
``grow`` change its nodes. Unknown names raise :class:`~unicorn_core.errors.UnknownNode`
and :class:`~unicorn_core.errors.UnknownJob`, as the real backends do.

What the code under test *did* to the cluster is recorded in :attr:`FakeSlurm.calls`, in
order, as ``(operation, *arguments)`` (sequences as tuples, keyword arguments left out);
queries (``version``, ``list_*``, ``get_*``) only go to :attr:`FakeSlurm.queries`, so an
empty ``calls`` means "changed nothing". :meth:`FakeSlurm.fail` makes an operation raise;
``check_exit_code``/``check_stdout``/``check_stderr`` are what ``run_on_nodes`` answers
(a node check reports "healthy" by default). ``launch_step`` runs the step here, as a
local process group, only for a fake built with ``local_steps=True``: a test that does
not expect unicornd to start agents must not start them by accident.

Kept apart on purpose: ``FakePyslurm`` in ``tests/unicorn_core/test_slurm_backend_select.py``
is not a SlurmBackend but a fake *pyslurm module* beneath
:class:`~unicorn_core.slurm.PyslurmBackend`. Those tests exercise the backend's own
translation of pyslurm's records, errors and hangs, which a FakeSlurm would replace.
Tests that need real Slurm behaviour (scontrol, srun, job expansion, plugins) run against
the dev cluster in ``tests/system``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from unicorn_core.errors import InvalidArgument, UnknownJob, UnknownNode
from unicorn_core.proc import CommandOutput
from unicorn_core.slurm.backend import ResizeUnsupported, StepHandle, UnknownReservation
from unicorn_core.slurm.types import GrowResult, JobInfo, JobLimits, JobState, NodeInfo, NodeState

__all__ = ["FakeSlurm", "idle_node", "running_job"]


def idle_node(
    name: str,
    *,
    cpus: int = 4,
    gpus: int = 2,
    partitions: tuple[str, ...] = ("debug",),
    features: tuple[str, ...] = (),
) -> NodeInfo:
    """An idle, responding, undrained node with ``gpus`` GPUs and 1 GiB of memory."""
    return NodeInfo(name, NodeState.IDLE, frozenset(), "", cpus, gpus, 0, 1024, partitions, features)


def running_job(job_id: int, nodes: Sequence[str], *, name: str = "unicorn", user: str = "root") -> JobInfo:
    """A running batch job on ``nodes``."""
    return JobInfo(job_id, name, JobState.RUNNING, "RUNNING", "None", tuple(nodes), len(nodes), True, 0, user)


class FakeSlurm:
    """A scripted cluster implementing :class:`~unicorn_core.slurm.backend.SlurmBackend`."""

    name = "fake"

    def __init__(
        self,
        nodes: Iterable[str | NodeInfo] = (),
        jobs: Iterable[JobInfo] = (),
        *,
        version: str = "22.05.8",
        local_steps: bool = False,
        reservations: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.nodes: dict[str, NodeInfo] = {}
        for node in nodes:
            info = node if isinstance(node, NodeInfo) else idle_node(node)
            self.nodes[info.name] = info
        self.jobs: dict[int, JobInfo] = {j.job_id: j for j in jobs}
        self.reservations: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in (reservations or {}).items()}
        """Reservation name -> its nodes (``reservation_nodes`` answers from it)."""
        self.version_string = version
        self.local_steps = local_steps
        self.calls: list[tuple[object, ...]] = []
        self.queries: list[str] = []
        self.failures: dict[str, Exception] = {}
        self.check_exit_code = 0
        self.check_stdout = "healthy"
        self.check_stderr = ""
        self.scripts: dict[int, str] = {}
        self.steps: list[StepHandle] = []
        self.limits: dict[int, JobLimits] = {}
        """Job id -> Slurm's policy limits for it (``job_limits``; default: none)."""
        self.requeue_start_s = 0.0
        """How long ``requeue`` waits after placing the job (the CLI adapter's wait for its
        start: about 2.5 s on the dev cluster)."""

    # ------------------------------------------------------------------ scripting

    def fail(self, operation: str, error: Exception | None) -> None:
        """Make ``operation`` (a method name) raise ``error`` from now on; None: succeed again."""
        if error is None:
            self.failures.pop(operation, None)
        else:
            self.failures[operation] = error

    def set_node(self, name: str, **changes: object) -> NodeInfo:
        """Replace fields of a node's record (state, flags, reason, gpus_used, ...)."""
        self.nodes[name] = dataclasses.replace(self._node(name), **changes)  # type: ignore[arg-type]
        return self.nodes[name]

    def add_job(self, job: JobInfo) -> JobInfo:
        self.jobs[job.job_id] = job
        return job

    def start_job(self, job_id: int, nodes: Sequence[str]) -> JobInfo:
        """The scheduler starts a (pending) job on ``nodes``."""
        for n in nodes:
            self._node(n)
        job = dataclasses.replace(
            self._job(job_id),
            state=JobState.RUNNING,
            state_raw="RUNNING",
            reason="None",
            nodes=tuple(nodes),
            num_nodes=len(nodes),
        )
        self.jobs[job_id] = job
        return job

    # ------------------------------------------------------------------ bookkeeping

    def _query(self, operation: str) -> None:
        self.queries.append(operation)
        if operation in self.failures:
            raise self.failures[operation]

    def _act(self, operation: str, *args: object) -> None:
        self.calls.append((operation, *args))
        if operation in self.failures:
            raise self.failures[operation]

    def _node(self, name: str) -> NodeInfo:
        try:
            return self.nodes[name]
        except KeyError:
            raise UnknownNode(name, sorted(self.nodes)) from None

    def _job(self, job_id: int) -> JobInfo:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise UnknownJob(job_id) from None

    def _set_job(self, job_id: int, **changes: object) -> None:
        self.jobs[job_id] = dataclasses.replace(self._job(job_id), **changes)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ queries

    async def version(self) -> str:
        self._query("version")
        return self.version_string

    async def list_nodes(self) -> list[NodeInfo]:
        self._query("list_nodes")
        return [self.nodes[n] for n in sorted(self.nodes)]

    async def get_node(self, name: str) -> NodeInfo:
        self._query("get_node")
        return self._node(name)

    async def list_partitions(self) -> list[str]:
        """Every partition some node is in (a fake has no partition without nodes)."""
        self._query("list_partitions")
        return sorted({p for n in self.nodes.values() for p in n.partitions})

    async def reservation_nodes(self, name: str) -> tuple[str, ...]:
        self._query("reservation_nodes")
        if name not in self.reservations:
            raise UnknownReservation(name)
        return self.reservations[name]

    async def list_jobs(self) -> list[JobInfo]:
        self._query("list_jobs")
        return [self.jobs[j] for j in sorted(self.jobs)]

    async def get_job(self, job_id: int) -> JobInfo:
        self._query("get_job")
        return self._job(job_id)

    async def job_limits(self, job_id: int) -> JobLimits:
        self._query("job_limits")
        self._job(job_id)
        return self.limits.get(job_id, JobLimits())

    # ------------------------------------------------------------------ nodes

    async def drain(self, node: str, reason: str) -> None:
        self._act("drain", node, reason)
        info = self._node(node)
        self.nodes[node] = dataclasses.replace(info, flags=info.flags | {"DRAIN"}, reason=reason)

    async def drain_nodes(self, nodes: Sequence[str], reason: str) -> None:
        self._act("drain_nodes", tuple(nodes), reason)
        for n in nodes:  # node by node, as slurmctld: the known ones before an unknown one change
            info = self._node(n)
            self.nodes[n] = dataclasses.replace(info, flags=info.flags | {"DRAIN"}, reason=reason)

    async def down_nodes(self, nodes: Sequence[str], reason: str) -> None:
        self._act("down_nodes", tuple(nodes), reason)
        for n in nodes:
            self.nodes[n] = dataclasses.replace(self._node(n), state=NodeState.DOWN, reason=reason)

    async def down(self, node: str, reason: str) -> None:
        self._act("down", node, reason)
        self.nodes[node] = dataclasses.replace(self._node(node), state=NodeState.DOWN, reason=reason)

    async def resume(self, node: str) -> None:
        self._act("resume", node)
        info = self._node(node)
        state = NodeState.IDLE if info.state is NodeState.DOWN else info.state
        self.nodes[node] = dataclasses.replace(info, state=state, flags=info.flags - {"DRAIN"}, reason="")

    async def run_on_nodes(
        self,
        nodes: Sequence[str],
        argv: Sequence[str],
        *,
        timeout_s: float,
        job_id: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandOutput:
        self._act("run_on_nodes", tuple(nodes), tuple(argv))
        for n in nodes:
            self._node(n)
        return CommandOutput(tuple(argv), self.check_exit_code, self.check_stdout, self.check_stderr, 0.01)

    # ------------------------------------------------------------------ jobs

    async def submit_batch(self, script: str, options: Sequence[str] = ()) -> int:
        self._act("submit_batch", script, tuple(options))
        job_id = max([1000, *self.jobs]) + 1
        self.scripts[job_id] = script
        pending = JobInfo(job_id, "batch", JobState.PENDING, "PENDING", "None", (), 1, True, 0, "root")
        self.jobs[job_id] = pending
        return job_id

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
        self._act("launch_step", job_id, tuple(nodes), tuple(argv))
        if self._job(job_id).state is not JobState.RUNNING:
            raise InvalidArgument(f"job {job_id} is not running")
        if not self.local_steps:
            raise NotImplementedError("FakeSlurm(local_steps=True) runs steps as local processes")
        out = asyncio.subprocess.PIPE if capture else None
        process = await asyncio.create_subprocess_exec(
            *argv, env={**os.environ, **(env or {})}, stdout=out, stderr=out, start_new_session=True
        )
        step = StepHandle(job_id, tuple(nodes), tuple(argv), process)
        self.steps.append(step)
        return step

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        self._act("shrink", job_id, tuple(keep_nodes))
        job = self._job(job_id)
        if not keep_nodes or not set(keep_nodes) <= set(job.nodes):
            raise InvalidArgument(f"job {job_id} runs on {','.join(job.nodes)}, cannot keep {keep_nodes}")
        self._set_job(job_id, nodes=tuple(keep_nodes), num_nodes=len(keep_nodes))

    async def grow(self, job_id: int, add_nodes: int, *, exclude: Sequence[str] = ()) -> GrowResult:
        """Job expansion onto the first usable nodes no running job holds (by name)."""
        self._act("grow", job_id, add_nodes, tuple(exclude))
        job = self._job(job_id)
        if job.state is not JobState.RUNNING:
            raise InvalidArgument(f"job {job_id} is {job.state_raw}, not RUNNING")
        busy = {n for j in self.jobs.values() if j.state is JobState.RUNNING for n in j.nodes}
        free = [n for n in sorted(self.nodes) if self.nodes[n].usable and n not in busy and n not in exclude]
        if len(free) < add_nodes:
            raise ResizeUnsupported(f"job {job_id} cannot grow: {len(free)} free nodes, {add_nodes} asked")
        added = tuple(free[:add_nodes])
        self._set_job(job_id, nodes=job.nodes + added, num_nodes=job.num_nodes + add_nodes)
        return GrowResult(job_id, "expand", added)

    async def requeue(
        self, job_id: int, nodes: Sequence[str] = (), *, placed: Callable[[], None] | None = None
    ) -> None:
        """Back to PENDING (``start_job`` runs it again). A job already pending (Slurm
        requeued it itself) stays pending and gets the new node count, as the CLI adapter
        then still sets it. ``placed`` is called at the end, then ``requeue_start_s``
        (default 0) is waited, as the CLI adapter waits for the job's start."""
        self._act("requeue", job_id, tuple(nodes))
        job = self._job(job_id)
        if job.state is JobState.PENDING:
            self._set_job(job_id, num_nodes=len(nodes) or job.num_nodes)
        else:
            self._set_job(
                job_id,
                state=JobState.PENDING,
                state_raw="PENDING",
                reason="BeginTime",
                nodes=(),
                num_nodes=len(nodes) or job.num_nodes,
                restarts=job.restarts + 1,
            )
        if placed is not None:
            placed()
        if self.requeue_start_s:
            await asyncio.sleep(self.requeue_start_s)

    async def cancel(self, job_id: int, *, signal: str | None = None) -> None:
        """With ``signal`` only recorded (the job's processes are the test's business)."""
        self._act("cancel", job_id, signal)
        self._job(job_id)
        if signal is None:
            self._set_job(job_id, state=JobState.CANCELLED, state_raw="CANCELLED", nodes=())
