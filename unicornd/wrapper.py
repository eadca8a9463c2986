"""The sbatch wrapper's side of ``unicornctl task``: register a job's task, follow it, stop it.

``etc/unicorn-job.sbatch`` runs inside the Slurm job, on its first node::

    unicornctl task register --job-id $SLURM_JOB_ID --nodes $SLURM_JOB_NODELIST [options] -- CMD
    exec unicornctl task wait TASK --job-id $SLURM_JOB_ID

``register`` validates everything before anything is sent (exit 2 and nothing changed on
bad input), then asks unicornd through the control stream and waits for its verdict.
``wait`` follows the task in unicornd's persisted snapshot, prints progress lines to the
job's output, and exits with the training's result (:data:`EXIT_FINISHED`, ...). A
SIGTERM (scancel) or SIGUSR1 (``--signal=B:USR1@120``: the time limit is near) makes it
ask unicornd to stop the task (agents stop, ranks save and exit) and wait until the
agents are gone; a SIGTERM that comes from a requeue (unicorn resizes jobs that way)
leaves the task alone, and the job's next run attaches to it again.

The training command runs under unicorn-agent on every node, started by unicornd
(``srun --overlap``). ``register`` resolves the program to an absolute path here, and
sends the job's exported variables and working directory along
(:mod:`unicorn_core.jobenv`): the agents start the training with them, as ``srun``'s
default ``--export=ALL`` would.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import redis.asyncio as aioredis

from unicorn_core import acl, redis_io
from unicorn_core.config import Config, read_toml
from unicorn_core.errors import ConfigError, InvalidArgument, UnicornError
from unicorn_core.jobenv import JobEnvironment
from unicorn_core.keys import RedisKeys
from unicorn_core.model import ModelSpec
from unicorn_core.paths import agent_run_dir
from unicorn_core.slurm import JobInfo, make_backend
from unicorn_core.slurm.hostlist import compress
from unicorn_core.slurm.types import JobState
from unicornd.control import ControlClient, NoDaemon, RequestRefused
from unicornd.replan import PLANNED_STATES
from unicornd.state import Snapshot, TaskRecord, TaskState
from unicornd.store import read_snapshot

EXIT_FINISHED: Final = 0
"""``wait``: the training finished (every node's training command exited 0)."""
EXIT_FAILED: Final = 1
"""``wait``: the task failed (or is unknown to unicornd); ``register``: refused or unreachable."""
EXIT_USAGE: Final = 2
"""Bad options: nothing was registered (click's usage-error status)."""
EXIT_STOPPED: Final = 3
"""``wait``: the task was stopped (scancel, time limit, or unicorn's breaker)."""


_MODEL_REQUIRED: Final = ("layers", "hidden", "heads", "sequence", "vocabulary", "global_batch")
_MODEL_OPTIONAL: Final = ("ffn_hidden", "num_query_groups")
_NAME_OK = re.compile(r"[A-Za-z0-9_.-]+")


# --- register: validation, pure -----------------------------------------------------------


def load_model_file(path: Path) -> ModelSpec:
    """A model description: JSON (``*.json``) or TOML, with :class:`ModelSpec`'s fields at the
    top level or in a ``model`` table (so ``etc/tasks/*.toml`` task files work as they are).

    Raises :class:`ConfigError` naming the file and the bad field.
    """
    return load_model_and_gpu_types(path)[0]


def load_model_and_gpu_types(path: Path) -> tuple[ModelSpec, tuple[str, ...]]:
    """:func:`load_model_file`, and the GPU types the file says the task accepts: a
    top-level ``gpu_types`` list of Slurm GRES type names (``["h100"]``); () for any."""
    doc = _read_model_doc(path)
    gpu_types: tuple[str, ...] = ()
    if isinstance(doc, dict) and "gpu_types" in doc:
        doc = dict(doc)
        gpu_types = _gpu_types(doc.pop("gpu_types"), path)
    if isinstance(doc, dict) and "model" in doc:
        doc = doc["model"]
    if not isinstance(doc, dict):
        raise ConfigError(f"model file {str(path)!r}: expected a table of model fields, got {doc!r}")
    valid = _MODEL_REQUIRED + _MODEL_OPTIONAL
    unknown = sorted(str(k) for k in doc if k not in valid)
    if unknown:
        raise ConfigError(
            f"model file {str(path)!r}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(valid)}"
        )
    missing = [k for k in _MODEL_REQUIRED if k not in doc]
    if missing:
        raise ConfigError(f"model file {str(path)!r}: missing field(s) {', '.join(missing)}")
    for key, value in doc.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"model file {str(path)!r}: {key} must be a positive integer, got {value!r}")
    try:
        return ModelSpec(**doc), gpu_types
    except InvalidArgument as e:
        raise ConfigError(f"model file {str(path)!r}: {e}") from None


def _read_model_doc(path: Path) -> object:
    if path.suffix.lower() != ".json":
        return read_toml(path, "model file")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model file {str(path)!r}: not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"model file {str(path)!r}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model file {str(path)!r}: invalid JSON: {e}") from None


def _gpu_types(raw: object, path: Path) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(t, str) and _NAME_OK.fullmatch(t) for t in raw):
        raise ConfigError(
            f"model file {str(path)!r}: gpu_types must be a list of GPU type names "
            f'(Slurm GRES types, [A-Za-z0-9_.-]+), e.g. ["h100"]; got {raw!r}'
        )
    return tuple(dict.fromkeys(raw))


def task_id_for(name: str, job_id: int | None) -> str:
    """``<name>.<job id>``: unique on the cluster (job ids are), readable in ``unicornctl tasks``.

    ``name`` must match ``[A-Za-z0-9_.-]+`` (it becomes part of Redis keys).
    """
    if not _NAME_OK.fullmatch(name):
        raise InvalidArgument(f"task name {name!r} must match [A-Za-z0-9_.-]+")
    return name if job_id is None else f"{name}.{job_id}"


def default_name(job_name: str) -> str:
    """A task name from Slurm's job name: unusable characters become ``_`` (empty: ``task``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", job_name) or "task"


def resolve_command(argv: Sequence[str], *, cwd: Path, path: str) -> tuple[str, ...]:
    """``argv`` with its program made absolute, as unicorn-agent will run it elsewhere.

    A bare name is looked up on ``path`` (the job's PATH); a relative path is taken from
    ``cwd``. The program must exist, and be executable unless it is a ``*.py`` file
    (torchrun runs those with python). Raises :class:`InvalidArgument`.
    """
    if not argv or not argv[0]:
        raise InvalidArgument("no training command: put it after '--' (e.g. -- python train.py ...)")
    prog = argv[0]
    if "/" not in prog:
        found = shutil.which(prog, path=path)
        if found is None:
            raise InvalidArgument(f"training command {prog!r} not found on PATH")
        resolved = Path(found)
    else:
        resolved = Path(prog) if Path(prog).is_absolute() else cwd / prog
        if not resolved.is_file():
            raise InvalidArgument(f"training command {prog!r}: no such file ({resolved})")
        if resolved.suffix != ".py" and not os.access(resolved, os.X_OK):
            raise InvalidArgument(f"training command {prog!r}: not executable ({resolved})")
    return (str(resolved.absolute()), *argv[1:])


def log_location(prefix: str, job_id: int, nodes: Sequence[str]) -> str:
    """One line naming every node's training log, e.g. ``/tmp/unicorn/p/7/<node>/train.log on n[1-2]``."""
    pattern = agent_run_dir(prefix, job_id, "<node>") / "train.log"
    return f"training output (every rank of a node): {pattern} on node(s) {compress(list(nodes))}"


# --- wait: what the job's output shows, pure ------------------------------------------------


@dataclass(frozen=True)
class TaskView:
    """What ``wait`` shows of a task; :func:`progress_lines` compares two of them."""

    state: TaskState
    layout: str | None
    nodes: tuple[str, ...]
    iteration: int | None
    incident: str | None

    @classmethod
    def of(cls, task: TaskRecord, snap: Snapshot) -> TaskView:
        inc = snap.open_incident(task.task_id)
        return cls(
            state=task.state,
            layout=task.layout.describe() if task.layout else None,
            nodes=task.nodes,
            iteration=task.last_iteration,
            incident=None
            if inc is None
            else f"{inc.incident_id} {inc.status.value} on {inc.node}: {inc.stage.value}",
        )


def progress_lines(before: TaskView | None, now: TaskView) -> list[str]:
    """Lines for what changed between two views (the first view is shown whole).

    Iterations are not here: :class:`ProgressMeter` rate-limits them.
    """
    lines = []
    if before is None or now.state is not before.state:
        lines.append(f"state {now.state.value}")
    if now.nodes and (before is None or (now.layout, now.nodes) != (before.layout, before.nodes)):
        lines.append(f"layout {now.layout or '-'} on {compress(list(now.nodes))}")
    if now.incident != (before.incident if before else None):
        if now.incident is not None:
            lines.append(f"incident {now.incident}")
        else:
            lines.append("incident closed")
    return lines


@dataclass
class ProgressMeter:
    """At most one iteration line per ``interval_s``, with the rate since the last one."""

    interval_s: float
    _last: tuple[float, int] | None = None

    def line(self, iteration: int | None, now_s: float) -> str | None:
        if iteration is None:
            return None
        if self._last is None:
            self._last = (now_s, iteration)
            return f"iteration {iteration}"
        t0, i0 = self._last
        if now_s - t0 < self.interval_s or iteration == i0:
            return None
        self._last = (now_s, iteration)
        rate = (iteration - i0) / (now_s - t0)
        return f"iteration {iteration} ({iteration - i0:+d} in {now_s - t0:.0f} s, {rate:.2f} it/s)"


EXIT_OF_STATE: Final[Mapping[TaskState, int]] = {
    TaskState.FINISHED: EXIT_FINISHED,
    TaskState.FAILED: EXIT_FAILED,
    TaskState.STOPPED: EXIT_STOPPED,
}
"""``wait``'s exit status once the task reached one of these states."""


class WaitPhase(enum.StrEnum):
    """``wait``'s own states. ``watching``: following the task. ``stopping``: a stop was
    requested; waiting for the agents to be gone (or the stop deadline). ``done``: exit."""

    WATCHING = "watching"
    STOPPING = "stopping"
    DONE = "done"


WAIT_TRANSITIONS: Final[Mapping[WaitPhase, frozenset[WaitPhase]]] = {
    WaitPhase.WATCHING: frozenset({WaitPhase.STOPPING, WaitPhase.DONE}),
    WaitPhase.STOPPING: frozenset({WaitPhase.DONE}),
    WaitPhase.DONE: frozenset(),
}


def next_phase(old: WaitPhase, new: WaitPhase) -> WaitPhase:
    """``new`` if :data:`WAIT_TRANSITIONS` allows it, else :class:`InvalidArgument`."""
    if new not in WAIT_TRANSITIONS[old]:
        raise InvalidArgument(f"wait: {old.value} -> {new.value} is not allowed")
    return new


REQUEUE_STATES: Final = frozenset({JobState.PENDING, JobState.REQUEUED})
"""Job states that mean a requeue. While the batch script is being killed both a requeue
and a cancel show ``COMPLETING`` (measured on 22.05): the restart count tells them apart."""


def signal_means_stop(sig: int, job: JobInfo | None, run_restarts: int) -> bool:
    """Whether a signal to the batch script asks for the task to stop.

    SIGUSR1 (the time-limit warning) and SIGINT always do. SIGTERM does unless the job
    is being requeued (unicorn requeues jobs to resize them; the next run reattaches):
    Slurm counts the restart before it kills this run (``job.restarts`` above
    ``run_restarts``, this run's ``$SLURM_RESTART_COUNT``). A job that cannot be read
    (``None``) is left alone too: unicornd sees it end and stops the task itself.
    """
    if sig != signal.SIGTERM:
        return True
    return job is not None and job.state not in REQUEUE_STATES and job.restarts <= run_restarts


# --- wait: the loop -----------------------------------------------------------------------


@dataclass(frozen=True)
class WaitOptions:
    """``poll_s``: snapshot reads; ``progress_interval_s``: between iteration lines;
    ``stop_timeout_s``: how long to wait for the agents after a stop request (below the
    ``--signal`` lead time, 120 s in the wrapper); ``request_timeout_s``: for unicornd's reply;
    ``run_restarts``: this run's ``$SLURM_RESTART_COUNT`` (see :func:`signal_means_stop`)."""

    poll_s: float = 1.0
    progress_interval_s: float = 30.0
    stop_timeout_s: float = 100.0
    request_timeout_s: float = 10.0
    run_restarts: int = 0


async def _agents_alive(client: aioredis.Redis, keys: RedisKeys, job_id: int, nodes: Sequence[str]) -> int:
    if not nodes:
        return 0
    names = [keys.heartbeat(job_id, n) for n in nodes]
    return int(await redis_io.call(("EXISTS",), client.exists(*names)))


class _Waiter:
    """One ``wait``: the follow loop's state (see :class:`WaitPhase`) and its steps."""

    def __init__(
        self, cfg: Config, task_id: str, job_id: int | None, opts: WaitOptions, say: Callable[[str], None]
    ) -> None:
        self.cfg = cfg
        self.task_id = task_id
        self.job_id = job_id
        self.opts = opts
        self.say = say
        self.keys = RedisKeys(cfg.redis.key_prefix)
        self.client = acl.connect_caller(cfg.redis, client_name=f"unicornctl-wait-{task_id}")
        self.phase = WaitPhase.WATCHING
        self.view: TaskView | None = None
        self.meter = ProgressMeter(opts.progress_interval_s)
        self.nodes_seen: tuple[str, ...] = ()
        self.logs_shown: tuple[str, ...] = ()
        self.stop_deadline = 0.0
        self.unreadable_since: float | None = None

    def _move(self, new: WaitPhase) -> None:
        self.phase = next_phase(self.phase, new)

    async def _read(self) -> Snapshot | None:
        try:
            snap = await read_snapshot(self.client, self.keys, self.cfg.recovery)
        except UnicornError as e:
            if self.unreadable_since is None or time.monotonic() - self.unreadable_since > 60:
                self.say(f"cannot read unicornd's state ({e}); the agents keep training; still waiting")
                self.unreadable_since = time.monotonic()
            return None
        self.unreadable_since = None
        return snap

    def _show(self, task: TaskRecord, snap: Snapshot) -> None:
        if self.job_id is None:
            self.job_id = task.job_id
        view = TaskView.of(task, snap)
        for line in progress_lines(self.view, view):
            self.say(line)
        self.view = view
        if task.nodes:
            self.nodes_seen = task.nodes
            if task.nodes != self.logs_shown and self.job_id is not None:
                self.say(log_location(self.keys.prefix, self.job_id, task.nodes))
                self.logs_shown = task.nodes
        it_line = self.meter.line(task.last_iteration, time.monotonic())
        if it_line is not None and task.state in PLANNED_STATES:
            self.say(it_line)

    async def step(self) -> int | None:
        """Read and show the task once; the exit status when waiting is over."""
        snap = await self._read()
        task = snap.tasks.get(self.task_id) if snap is not None else None
        if snap is not None and task is None:
            self.say(f"task {self.task_id} is unknown to unicornd (key prefix {self.keys.prefix!r})")
            return EXIT_FAILED
        if task is not None and snap is not None:
            self._show(task, snap)
            if self.phase is WaitPhase.WATCHING and task.state in EXIT_OF_STATE:
                self._move(WaitPhase.DONE)
                at = "" if task.last_iteration is None else f" at iteration {task.last_iteration}"
                self.say(f"task {task.state.value}{at}")
                return EXIT_OF_STATE[task.state]
        if self.phase is WaitPhase.STOPPING:
            alive = await _agents_alive(self.client, self.keys, self.job_id or 0, self.nodes_seen)
            if not alive or time.monotonic() > self.stop_deadline:
                self._move(WaitPhase.DONE)
                self.say(
                    "stopped; the agents are gone"
                    if not alive
                    else f"{alive} agent(s) still alive {self.opts.stop_timeout_s:g} s after the stop "
                    "request; leaving them to Slurm"
                )
                return EXIT_STOPPED
        return None

    async def on_signal(self, sig: int) -> int | None:
        """React to a signal to the batch script; the exit status when leaving now."""
        name = signal.Signals(sig).name
        if self.phase is WaitPhase.STOPPING:
            self.say(f"{name} again: leaving now")
            return EXIT_STOPPED
        job = await _job(self.cfg, self.job_id) if sig == signal.SIGTERM else None
        if not signal_means_stop(sig, job, self.opts.run_restarts):
            why = "the job is being requeued" if job is not None else "the job cannot be read from Slurm"
            self.say(f"{name}: {why}; the task stays with unicornd (a requeued job attaches again)")
            return EXIT_STOPPED
        why = {signal.SIGUSR1: "time limit near (SIGUSR1)", signal.SIGINT: "interrupted (SIGINT)"}.get(
            signal.Signals(sig), f"job {job.state.value.lower() if job else 'signalled'} (SIGTERM)"
        )
        self.say(f"{name}: asking unicornd to stop the task: {why}")
        try:
            control = ControlClient(self.client, self.keys, timeout_s=self.opts.request_timeout_s)
            await control.stop(self.task_id, why)
        except (NoDaemon, RequestRefused) as e:
            self.say(f"stop not confirmed ({e}); Slurm stops the agents with the job")
            return EXIT_STOPPED
        self._move(WaitPhase.STOPPING)
        self.stop_deadline = time.monotonic() + self.opts.stop_timeout_s
        return None


async def wait_task(
    cfg: Config, task_id: str, job_id: int | None, opts: WaitOptions, say: Callable[[str], None]
) -> int:
    """Follow ``task_id`` until it ends; returns the exit status (:data:`EXIT_OF_STATE`).

    Redis or unicornd being away is not an end: agents outlive the coordinator, so this
    keeps waiting and says so. Signals: see :func:`signal_means_stop`; a second one while
    stopping exits at once.
    """
    waiter = _Waiter(cfg, task_id, job_id, opts, say)
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    for sig in handled:
        loop.add_signal_handler(sig, signals.put_nowait, int(sig))
    try:
        while True:
            status = await waiter.step()
            if status is not None:
                return status
            try:
                got = await asyncio.wait_for(signals.get(), opts.poll_s)
            except TimeoutError:
                continue
            status = await waiter.on_signal(got)
            if status is not None:
                return status
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await waiter.client.aclose()


async def _job(cfg: Config, job_id: int | None) -> JobInfo | None:
    """The job as Slurm sees it now, None when it cannot be read (reported by the caller)."""
    if job_id is None:
        return None
    try:
        slurm = await make_backend(cfg.slurm)
        return await slurm.get_job(job_id)
    except UnicornError:
        return None


# --- register: the request ------------------------------------------------------------------


class AlreadyEnded(UnicornError):
    """The task of this job already ended; a rerun of the job cannot continue it."""


async def register_or_attach(
    cfg: Config, task: TaskRecord, *, timeout_s: float, environment: JobEnvironment | None = None
) -> bool:
    """Register ``task``; True when it was already registered for this job (a requeued job's
    rerun), in which case nothing is sent. Raises AlreadyEnded, RequestRefused, NoDaemon,
    RedisCallError."""
    keys = RedisKeys(cfg.redis.key_prefix)
    client = acl.connect_caller(cfg.redis, client_name=f"unicornctl-register-{task.task_id}")
    try:
        snap = await read_snapshot(client, keys, cfg.recovery)
        known = snap.tasks.get(task.task_id) if snap is not None else None
        if known is not None and known.job_id == task.job_id:
            if known.state not in PLANNED_STATES:
                raise AlreadyEnded(f"task {task.task_id} of job {task.job_id} already {known.state.value}")
            return True
        await ControlClient(client, keys, timeout_s=timeout_s).register(
            task, environment=environment, munge_socket=cfg.slurm.munge_socket
        )
        return False
    finally:
        await client.aclose()
