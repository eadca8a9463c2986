"""``unicorn-agent``: one per node of a training job; supervises, watches and reports.

Launched by unicornd with ``srun --jobid=J -w NODE --overlap unicorn-agent ... -- CMD``,
or, for a whole job's nodes, one ``srun`` step whose agents read each node's command from
Redis (``--await-launch``); or by hand. It ends the agent before it on its node first
(:mod:`launcher.supersede`), then

- writes a heartbeat every ``agent.heartbeat_interval_s`` (a TTL key and an ``hb``
  event carrying pids and the last iteration);
- starts the training command (torchrun or any command) in its own session and reports
  every rank's exit the moment it happens (:mod:`launcher.supervisor`);
- receives iteration timings and exceptions from the ranks over a Unix datagram socket
  (:mod:`launcher.hook`), scans their output for error signatures, and watches GPUs
  through NVML (:mod:`launcher.gpu`);
- executes coordinator commands from its command stream (stop, restart ranks, relaunch
  with a new command, checkpoint now) and reports a result for each.

Everything it learns goes through one :class:`~launcher.outbox.Outbox`, so losing
Redis never stops supervision, and buffered events are written when Redis returns.

Contract with the training command: SIGTERM means "save at the end of this iteration
and exit"; SIGUSR1 means "save a checkpoint now and keep training" (checkpoint_now).
Exit status: 0 after a stop (command or SIGTERM); with ``--exit-with-training`` the
training command's status (128+N for signal N); 2 for bad usage.

Why one module of ~700 lines: :class:`Agent` is one event loop whose sections (training
processes, heartbeats, hook socket, GPUs, commands, hang watch) all read and replace the
same running training (supervisor, argv, launch id, iteration monitor); the parts that
stand alone already live beside it (supervisor, hook, outbox, gpu, ckptagent, nodecheck).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import click
import msgspec
import redis.asyncio as aioredis

from detect import SLOW_STEP_TIMEOUT_S, Classifier, ErrorStatus, IterationMonitor, Severity, load_classifier
from detect.origin import node_report
from detect.unraisable import EXCEPTION_LINE_RULES, IgnoredBlocks, Tracebacks
from launcher import megatron, supersede
from launcher.ckptagent import CkptPlan
from launcher.gpu import FaultFile, GpuMonitor
from launcher.hook import ENV_JOB_ID, ENV_NODE, ENV_SOCKET, MAX_DATAGRAM
from launcher.outbox import Outbox
from launcher.render import restart_rendezvous
from launcher.supervisor import ExitInfo, Supervisor, process_state
from unicorn_core import protocol, redis_io
from unicorn_core.aio import cancel_all, stacks
from unicorn_core.config import Config, load_config
from unicorn_core.errors import ConfigError, InvalidArgument, RedisCallError, UnicornError
from unicorn_core.jobenv import JobEnvironment
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.logs import configure_logging, get_logger
from unicorn_core.paths import agent_run_dir
from unicorn_core.protocol import (
    AgentAction,
    AgentCommand,
    CommandResult,
    ExceptionReport,
    FaultReport,
    GpuFaultKind,
    GpuHealthEvent,
    Heartbeat,
    IterationPhase,
    IterationTiming,
    ProcessExit,
    SafeDecoder,
    SlowStep,
)

_REDIS_CREDENTIALS: Final = frozenset({"UNICORN_REDIS__URL", "UNICORN_REDIS__PASSWORD_FILE"})
"""Environment variables that carry the agent's Redis credentials; not passed to children."""
log = get_logger(__name__)

_RANK_PREFIX: Final = re.compile(r"^\[(?:rank|default)(\d+)\]:")
_FAULT_DEDUP_S: Final = 5.0
EXIT_LINE_WINDOW_S: Final = 30.0
"""A line reporting a process's exit this soon after the agent saw one corroborates that exit."""
_STDERR_TAIL_CHARS: Final = 8192
_SOCKET_PATH_MAX: Final = 100
_DATAGRAMS_PER_WAKEUP: Final = 256
_LAUNCHES_KEPT: Final = 8
"""Generations of ranks whose launch id the agent remembers (an exit is reported soon)."""
_COMMAND_BLOCK_MS: Final = 500
_ANSWERS_KEPT: Final = 256
_LAUNCH_READ_S: Final = 30.0
"""How long an agent of a whole-job step looks for its stored training command (unicornd
stores it before srun starts; a Redis failover in between takes seconds)."""
_SUPERSEDE_MARGIN_S: Final = 10.0
"""Beyond its ranks' grace, what an agent being replaced on its node is given to stop (its
events flushed, up to 5 s) before the new one SIGKILLs it."""
_HANG_CHECK_S: Final = 0.02
_CPU_WAIT_SAMPLE_S: Final = 0.1
"""How often the agent reads its ranks' run-queue wait (one small /proc read per rank);
every hang check once a rank's silence nears the deadline, because a verdict counts
silence only as far as the newest sample (sampling every 0.1 s alone made the bench's
SIGSTOP detection 2.65x the mean iteration at p95, against 1.97x before)."""
_NEAR_DEADLINE: Final = 0.75
_UNSETTLED_EXIT_S: Final = 5.0
"""How long a rank exit of unknown status waits for torchrun's exit (torchrun notices a
worker's end within its --monitor-interval, 0.1 s as unicornd renders it, then stops the
other workers and exits)."""
_TASKS_END_S: Final = 10.0
"""How long the agent's stop waits for its background tasks to end
(:func:`unicorn_core.aio.cancel_all`: a cancellation redis-py swallowed around the command
task's blocking XREAD once kept an agent alive 25 minutes after its training ended)."""


def _usable_here(job_env: JobEnvironment) -> JobEnvironment:
    """``job_env``, with this process's working directory when the job's does not exist on
    this node (no shared filesystem there): training still starts, and the log says so."""
    if Path(job_env.cwd).is_dir():
        return job_env
    log.warning("job_cwd_missing", cwd=job_env.cwd, using=str(Path.cwd()))
    return dataclasses.replace(job_env, cwd=str(Path.cwd()))


@dataclass
class AgentCounters:
    hook_rejected: int = 0
    hook_wrong_envelope: int = 0
    commands_done: int = 0
    commands_rejected: int = 0
    faults_suppressed: int = 0
    exit_lines_seen: int = 0
    """Lines that report a process's exit (see :meth:`Agent._on_line`)."""
    node_reports_copied: int = 0
    """Copies of kernel or node-tool lines in the ranks' output: logged, not sent (detect.origin)."""
    exception_lines_without_traceback: int = 0
    """Generic exception lines that end no traceback: sent at SEV3 (:meth:`Agent._on_line`)."""
    iterations_unattributed: int = 0
    """Megatron-LM log lines seen before this node's ranks were known (not reported)."""


class Agent:
    """The agent of ``job_id`` on ``node``; :meth:`run` returns the process exit status."""

    _last_exit_s: float = -math.inf
    """Monotonic time of the last exit of a supervised process that was a failure the agent
    did not cause: not exit code 0, not a rank of a launch it was stopping or had replaced
    (:meth:`_on_exit`)."""

    def __init__(
        self,
        cfg: Config,
        *,
        job_id: int,
        node: str,
        run_dir: Path,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        classifier: Classifier | None = None,
        inject_gpu_faults: Path | None = None,
        exit_with_training: bool = False,
        grace_s: float = 5.0,
        launch_id: str = "",
        await_launch: bool = False,
    ) -> None:
        self.cfg = cfg
        self.launch_id = launch_id
        self.job_id = job_id
        self.node = node
        self.run_dir = run_dir
        self.argv = list(argv)
        self.job_env: JobEnvironment | None = None
        # The training and checkpoint processes never talk to Redis: they do not get the
        # job's Redis credentials (which unicornd hands the agent in its environment).
        self.base_env = {
            k: v for k, v in (os.environ if env is None else env).items() if k not in _REDIS_CREDENTIALS
        }
        self.classifier = (
            classifier if classifier is not None else load_classifier(cfg.detect.rules_file or None)
        )
        self.inject_gpu_faults = inject_gpu_faults
        self.exit_with_training = exit_with_training
        self.await_launch = await_launch
        """No command line training: it is stored in Redis under this agent's launch id
        (:meth:`unicorn_core.keys.RedisKeys.agent_launch`; one srun step started the whole
        job's agents, each node's training command differs)."""
        self.grace_s = grace_s
        self.keys = RedisKeys(cfg.redis.key_prefix)
        self.counters = AgentCounters()
        self.fence = 0
        """The newest fencing token seen on a command (older ones come from a deposed unicornd)."""
        self._answered: dict[str, tuple[bool, str]] = {}
        """The latest commands run, by id, with their answers (a command sent again is not run again)."""
        self.iteration: int | None = None
        self.supervisor: Supervisor | None = None
        self._seq = 0
        self._decoder = SafeDecoder()
        self._cmd_decoder = SafeDecoder()
        self._recent_faults: dict[tuple[str, int | None, str], float] = {}
        self._ignored, self._tracebacks = IgnoredBlocks(), Tracebacks()
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        """Set once the job's environment is read and the first training started (or failed
        to): commands wait for it, so a command queued before this agent started runs in
        the job's environment, and none (a stop, a relaunch) interleaves with that start."""
        self._exit_status = 0
        self._client: aioredis.Redis | None = None
        self._outbox: Outbox | None = None
        self._sock: socket.socket | None = None
        self._sock_path: Path | None = None
        self._generation = 0
        self._launch_of: dict[int, str] = {}
        """The launch id each generation of ranks was started under: their exits and log
        lines are stamped with it, even when read after a restart moved ``launch_id`` on."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done_commands: set[str] = set()
        self.monitor = self._new_monitor()
        self._follow_log(())
        self._hang_reported: int | None = None
        """The stalled iteration of the local hang last reported (None: none in progress)."""
        self._unsettled: dict[int, tuple[ExitInfo, int]] = {}
        """Rank exits whose status is unknown, waiting for torchrun's (:meth:`_on_exit`)."""
        self.cpu_wait_s = 0.0
        """How long the most-starved rank waited for a CPU, summed over samples (heartbeats)."""
        self._rank_waits: dict[int, float] = {}
        self.ckpt = CkptPlan.from_config(
            cfg.ckpt,
            job_id=job_id,
            node=node,
            env=self.base_env,
            scope=cfg.redis.key_prefix,
            loss_stop_window=cfg.detect.loss_stop_window,
        )

    # --- envelope helpers -------------------------------------------------------------

    def _env(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "node": self.node, "wall_time_s": time.time()}

    def _emit(self, msg: protocol.Message) -> None:
        assert self._outbox is not None
        self._outbox.put(msg)

    # --- lifecycle --------------------------------------------------------------------

    async def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Before anything else: the agent this one replaces on the node is gone first.
        ended = await asyncio.to_thread(supersede.claim, self.run_dir, self.grace_s + _SUPERSEDE_MARGIN_S)
        if ended is not None:
            log.warning("agent_superseded", job_id=self.job_id, node=self.node, pid=ended)
        loop = self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self._client = redis_io.connect(self.cfg.redis, client_name=f"agent-{self.job_id}-{self.node}")
        self._outbox = Outbox(
            self._client,
            self.keys,
            job_id=self.job_id,
            node=self.node,
            heartbeat_ttl_s=self.cfg.agent.heartbeat_ttl_s,
        )
        self._open_hook_socket()
        gpus = GpuMonitor(self._gpu_event_threadsafe)
        gpus.start()
        faults = (
            FaultFile(self.inject_gpu_faults, self._gpu_event_threadsafe) if self.inject_gpu_faults else None
        )
        if faults is not None:
            faults.start()
        tasks = [
            asyncio.create_task(self._outbox.run(), name="outbox"),
            asyncio.create_task(self._heartbeats(), name="heartbeats"),
            asyncio.create_task(self._commands(), name="commands"),
            asyncio.create_task(self._watch_hangs(), name="hangs"),
        ]
        if self.ckpt is not None:  # seal, persist and replicate the ranks' memory snapshots
            tasks.append(asyncio.create_task(self._ckpt_process(), name="ckpt"))
        for t in tasks:
            t.add_done_callback(_log_task_end)
        log.info("agent_started", job_id=self.job_id, node=self.node, run_dir=str(self.run_dir))
        try:
            self.job_env = await self._job_environment()
            try:
                if self.argv:
                    await self._start_training(self.argv, {})
                elif self.await_launch:
                    await self._start_stored_training()
            finally:  # commands run only after the first start: a stop cannot come before it
                self._ready.set()
            await self._stop.wait()
        finally:
            if self.supervisor is not None:
                await self.supervisor.stop(self.grace_s)
            self._heartbeat_now()
            await self._outbox.flush(timeout_s=5.0)
            stuck = await cancel_all(tasks, _TASKS_END_S)
            if stuck:  # (a lost cancellation: never hang on the way out)
                log.error(
                    "agent_tasks_did_not_end", tasks=sorted(t.get_name() for t in stuck), where=stacks(stuck)
                )
            await self._outbox.clear_heartbeat()
            gpus.stop()
            if faults is not None:
                faults.stop()
            self._close_hook_socket()
            await self._client.aclose()
            supersede.release(self.run_dir)
            log.info(
                "agent_stopped",
                status=self._exit_status,
                written=self._outbox.stats.written,
                dropped=dict(self._outbox.stats.dropped),
                hook_rejected=self.counters.hook_rejected,
            )
        return self._exit_status

    async def _ckpt_process(self) -> None:
        """Run the checkpoint agent (:mod:`launcher.ckptagent`) as a child process.

        A process, not a task of this loop: it hashes and copies shards, which would hold
        the GIL for seconds and starve the heartbeats (measured when it still imported torch:
        every agent of a 4-node job went silent for 1.5 s while importing it in a thread). It
        runs until this agent stops; if it dies, checkpoints stay in memory only (logged).
        """
        argv = [
            sys.executable,
            "-m",
            "launcher.ckptagent",
            "--ckpt-config",
            # memory_versions resolved here: the child sees no [detect] section to derive it from
            json.dumps(
                dataclasses.asdict(
                    dataclasses.replace(
                        self.cfg.ckpt,
                        memory_versions=self.cfg.ckpt.memory_keep(self.cfg.detect.loss_stop_window),
                    )
                )
            ),
            "--job-id",
            str(self.job_id),
            "--node",
            self.node,
            "--scope",
            self.cfg.redis.key_prefix,
            "--parent-pid",
            str(os.getpid()),
        ]
        with (self.run_dir / "ckpt-agent.log").open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=self.base_env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out
            )
        try:
            code = await proc.wait()
            log.error("ckpt_agent_exited", exit_code=code, log=str(self.run_dir / "ckpt-agent.log"))
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), timeout=5.0)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()

    async def _start_stored_training(self, timeout_s: float = _LAUNCH_READ_S) -> None:
        """Start the training command unicornd stored for this agent's launch id. A start
        that fails, or a command that is not there within ``timeout_s``, is answered as the
        failed command of that launch (an agent of a whole-job step that fails alone does
        not end the step, so the step's exit cannot say so); a start that works is not
        answered (hundreds of answers for one launch would each be a decision)."""
        assert self._client is not None
        key = self.keys.agent_launch(self.job_id, self.node)
        deadline = time.monotonic() + timeout_s
        why = f"no training command for launch {self.launch_id!r} in {timeout_s:g} s"
        while time.monotonic() < deadline:
            try:
                raw = await redis_io.call(("GET", key), self._client.get(key))
            except RedisCallError as e:
                why = f"no training command for launch {self.launch_id!r} in {timeout_s:g} s (Redis: {e})"
                raw = None
            cmd = self._cmd_decoder.decode(cast(bytes, raw)) if raw is not None else None
            if (
                isinstance(cmd, AgentCommand)
                and cmd.command_id == self.launch_id
                and (cmd.job_id, cmd.node) == (self.job_id, self.node)
                and cmd.action == AgentAction.RELAUNCH
                and cmd.argv
            ):
                self.fence = max(self.fence, cmd.fence)  # a deposed unicornd's commands are refused
                try:
                    await self._start_training(cmd.argv, dict(cmd.env))
                except Exception as e:  # a command that cannot start: the launch failed here
                    why = f"{type(e).__name__}: {e}"
                    break
                return
            await asyncio.sleep(0.2)
        log.error("stored_launch_failed", launch_id=self.launch_id, why=why)
        self._emit(CommandResult(**self._env(), command_id=self.launch_id, ok=False, detail=why[:4096]))

    async def _job_environment(self, timeout_s: float = 10.0) -> JobEnvironment | None:
        """The job's exported variables and working directory, stored by unicornd at
        registration (None: none stored, e.g. a task registered without the wrapper).

        Retried while Redis does not answer, for at most ``timeout_s``: training started
        with the wrong environment is worse than a later start; after that it starts in
        this agent's own environment (logged).
        """
        assert self._client is not None
        key = self.keys.job_env(self.job_id)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                raw = await redis_io.call(("GET", key), self._client.get(key))
                return None if raw is None else _usable_here(JobEnvironment.from_json(cast(bytes, raw)))
            except InvalidArgument as e:
                log.error("job_environment_invalid", error=str(e))
                return None
            except RedisCallError as e:
                if time.monotonic() > deadline:
                    log.error("job_environment_unavailable", error=str(e))
                    return None
                await asyncio.sleep(0.5)

    # --- training processes -----------------------------------------------------------

    async def _start_training(self, argv: Sequence[str], extra_env: dict[str, str]) -> None:
        assert self._sock_path is not None
        self._generation += 1
        job_env = self.job_env
        env = {
            **self.base_env,
            **(job_env.env if job_env is not None else {}),
            **(self.ckpt.rank_env() if self.ckpt is not None else {}),
            **extra_env,
            ENV_SOCKET: str(self._sock_path),
            ENV_JOB_ID: str(self.job_id),
            ENV_NODE: self.node,
            "PYTHONUNBUFFERED": "1",
        }
        generation, launch = self._generation, self.launch_id
        self._launch_of[generation] = launch
        self._launch_of.pop(generation - _LAUNCHES_KEPT, None)  # their exits were reported long ago
        self.monitor = self._new_monitor()
        # a report or traceback the last run's ranks left unfinished ends here
        self._ignored, self._tracebacks = IgnoredBlocks(), Tracebacks()
        self._hang_reported = None
        self._follow_log(argv)
        sup = Supervisor(
            restart_rendezvous(argv, self.launch_id, self.cfg.agent.rendezvous_port_base),
            env,
            self.run_dir / "train.log",
            on_line=lambda line: self._on_line(line, launch),
            on_exit=lambda info: self._on_exit(info, generation),
            grace_s=self.grace_s,
            cwd=job_env.cwd if job_env is not None else None,
        )
        self.supervisor = sup
        await sup.start()
        self.argv = list(argv)

    def _follow_log(self, argv: Sequence[str]) -> None:
        """What the output of the training ``argv`` (just started) tells besides errors.

        ``_follow_megatron``: it is Megatron-LM under unicorn's runner, whose log lines are
        its iteration reports (:func:`launcher.megatron.runs_megatron`), on its
        ``_megatron_schedule``; ``_megatron_previous``/``_megatron_line_s``: the iteration
        of its last line and when it was read (reports are timed by the gaps);
        ``_final_seen``: it reported its final iteration, its ranks end next.
        """
        self._follow_megatron = megatron.runs_megatron(argv)
        self._megatron_schedule = megatron.Schedule.of(argv)
        self._megatron_previous: int | None = None
        self._megatron_line_s = 0.0
        self._final_seen = False

    def _on_exit(self, info: ExitInfo, generation: int) -> None:
        """Report an exit; at the end of a run, a rank whose status could not be read waits
        for torchrun's.

        A rank's status is read from its zombie; torchrun, polling its workers, may reap it
        first (the agent's loop is late under CPU load), and then it is unknown. After the
        run's ``final`` iteration such an exit is most likely the clean end, which reported
        at once would look like a failure. So it waits, at most :data:`_UNSETTLED_EXIT_S`,
        for torchrun's own exit: torchrun exits 0 only when every worker did, which settles
        it as 0; otherwise (or on time-out) it is reported unknown. Before the final
        iteration, or with an error file (an exception), it is reported at once: a failure
        must not wait for torchrun, which may take 30 s to stop the other workers.
        """
        sup = self.supervisor
        on_purpose = generation != self._generation or (sup is not None and sup.stopping)
        if info.exit_code != 0 and not on_purpose:
            # Only a failure the agent did not cause makes a launcher's exit line corroborating
            # (found by the safety bench: a restart's own SIGTERM of the old ranks made the
            # corpus lines the new ranks printed within 30 s SEV2 "corroborations")
            self._last_exit_s = time.monotonic()
        unknown = info.exit_code is None and info.signal is None and info.error_file_text is None
        if not info.is_main and unknown and self._final_seen:
            self._unsettled[info.pid] = (info, generation)
            assert self._loop is not None
            self._loop.call_later(_UNSETTLED_EXIT_S, self._settle_exit, info.pid, None)
            return
        if info.is_main:
            for pid in list(self._unsettled):
                self._settle_exit(pid, info)
        self._report_exit(info, generation)

    def _settle_exit(self, pid: int, main: ExitInfo | None) -> None:
        entry = self._unsettled.pop(pid, None)
        if entry is None:
            return  # settled already
        info, generation = entry
        if main is not None and main.exit_code == 0:
            info = dataclasses.replace(info, exit_code=0)
        self._report_exit(info, generation)

    def _report_exit(self, info: ExitInfo, generation: int) -> None:
        sup = self.supervisor
        tail = "\n".join(sup.pump.tail) if sup is not None and sup.pump is not None else ""
        self._emit(
            ProcessExit(
                **self._env(),
                rank=info.rank,
                local_rank=info.local_rank,
                pid=info.pid,
                exit_code=info.exit_code,
                signal=info.signal,
                error_file_text=info.error_file_text,
                stderr_tail=tail[-_STDERR_TAIL_CHARS:],
                launch_id=self._launch_of.get(generation, self.launch_id),
            )
        )
        log.info(
            "process_exit",
            pid=info.pid,
            rank=info.rank,
            exit_code=info.exit_code,
            signal=info.signal,
            main=info.is_main,
        )
        ours = info.is_main and generation == self._generation and sup is not None and not sup.stopping
        if ours and self.exit_with_training:
            self._exit_status = info.exit_code if info.exit_code is not None else 128 + (info.signal or 0)
            self._stop.set()

    def _on_line(self, line: str, launch_id: str | None = None) -> None:
        """One line of the ranks' output; ``launch_id``: the launch that started them
        (None: the current one)."""
        closes_traceback = self._tracebacks.closes(line)
        if self._follow_megatron and (it := megatron.parse_iteration_line(line)) is not None:
            self._on_megatron_iteration(it, self.launch_id if launch_id is None else launch_id)
            return
        if self._ignored.inside(line):  # Python's report of an exception it ignored
            return
        result = self.classifier.classify_line(line)
        if result.severity is None:
            return
        copied = node_report(line)
        if copied is not None:
            # A copy of the kernel's or a node tool's report (detect.origin): the training
            # code ran the tool or printed the text. Logged and counted, never sent: even a
            # SEV3 report opens an incident that climbs when no iteration follows.
            self.counters.node_reports_copied += 1
            log.info("node_report_copy", origin=copied, rule=result.rule, line=line[:300])
            return
        severity = str(result.severity)
        bare = result.rule in EXCEPTION_LINE_RULES and not closes_traceback
        if bare and result.severity is not Severity.SEV3:
            # An exception line that ends no traceback: text a program printed (a handler
            # logging str(e) and going on), not an exception that ended a rank; that one comes
            # with its traceback, and the rank's exit is classified on its own
            # (detect.unraisable.Tracebacks). Sent at SEV3: it waits in place.
            self.counters.exception_lines_without_traceback += 1
            severity = str(Severity.SEV3)
        if result.status is ErrorStatus.EXITED_ABNORMALLY:
            # A launcher's or shell's report of a process's exit ("failed (exitcode: 1)",
            # "srun: error: ...: Exited with exit code 1", "Killed"). Within
            # EXIT_LINE_WINDOW_S of an exit the agent saw (ProcessExit) it corroborates that
            # exit and is sent at its severity. Otherwise it reports an exit the agent did not
            # see (a worker torchrun restarted before the agent found it, a process the
            # training code started and outlived, or no process at all): sent at SEV3.
            self.counters.exit_lines_seen += 1
            if time.monotonic() - self._last_exit_s > EXIT_LINE_WINDOW_S:
                severity = str(Severity.SEV3)
        m = _RANK_PREFIX.match(line)
        rank = int(m.group(1)) if m else None
        key = (result.rule, rank, severity)  # a SEV3 copy never hides the SEV2 that follows it
        now = time.monotonic()
        last = self._recent_faults.get(key)
        if last is not None and now - last < _FAULT_DEDUP_S:
            self.counters.faults_suppressed += 1
            return
        self._recent_faults[key] = now
        self._emit(
            FaultReport(
                **self._env(),
                status=str(result.status),
                severity=severity,
                rule=result.rule,
                rank=rank,
                evidence=line[:2048],
                launch_id=self.launch_id if launch_id is None else launch_id,
            )
        )

    def _on_megatron_iteration(self, it: megatron.MegatronIteration, launch_id: str) -> None:
        """Megatron-LM's own log line, as the hook's report would be (an unmodified
        ``pretrain_gpt.py`` sends none): progress, hang monitor, loss, training state.

        Megatron prints it on the last rank only (``print_rank_last``), so the agent of
        the node that holds that rank reports it, as the node's highest rank. A line
        before this node's ranks are known cannot be attributed and is skipped (ranks
        are discovered within a second of start; the first line comes after start-up).
        """
        sup = self.supervisor
        ranks = [info.rank for info in sup.ranks.values() if info.rank is not None] if sup is not None else []
        if not ranks:
            self.counters.iterations_unattributed += 1
            return
        now = time.monotonic()
        previous, last_s = self._megatron_previous, self._megatron_line_s
        if previous is not None and it.iteration <= previous:
            previous = None  # the run went back (a relaunch resumed from a checkpoint)
        self._megatron_previous, self._megatron_line_s = it.iteration, now
        schedule = self._megatron_schedule
        rank = max(ranks)
        timing = megatron.to_timing(
            it,
            job_id=self.job_id,
            node=self.node,
            rank=rank,
            wall_time_s=time.time(),
            previous=previous,
            launch_id=launch_id,
            phase=schedule.phase_between(previous, it.iteration),
            gap_s=None if previous is None else now - last_s,
        )
        self._on_iteration(timing, now)
        self._emit(timing)
        slow = None if timing.final else schedule.next_slow(it.iteration)
        if slow is not None:  # hook contract: a slow step is announced before it starts
            nxt = it.iteration + 1
            self.monitor.expect_slow_step(slow, now, iteration=nxt, rank=rank)
            self._emit(SlowStep(**self._env(), rank=rank, iteration=nxt, phase=slow))

    def _on_iteration(self, msg: IterationTiming, now_s: float) -> None:
        """A rank finished ``msg.iteration``: progress and the local hang monitor (which
        forgets the run after its ``final`` iteration: the ranks end next)."""
        if self.iteration is None or msg.iteration > self.iteration:
            self.iteration = msg.iteration
        self.monitor.observe(msg.rank, msg.iteration, msg.interval_s, msg.phase, now_s=now_s)
        if msg.final:
            self.monitor = self._new_monitor()
            self._final_seen = True

    # --- heartbeats -------------------------------------------------------------------

    def _heartbeat_now(self) -> None:
        pids = self.supervisor.pids if self.supervisor is not None else []
        self._emit(
            Heartbeat(
                **self._env(),
                agent_pid=os.getpid(),
                pids=pids,
                iteration=self.iteration,
                seq=self._seq,
                cpu_wait_s=self.cpu_wait_s,
            )
        )
        self._seq += 1

    async def _heartbeats(self) -> None:
        interval = self.cfg.agent.heartbeat_interval_s
        next_at = time.monotonic()
        while True:
            self._heartbeat_now()
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    # --- hook socket ------------------------------------------------------------------

    def _open_hook_socket(self) -> None:
        path = self.run_dir / "hook.sock"
        if len(str(path)) > _SOCKET_PATH_MAX:
            path = Path(f"/tmp/unicorn-hook-{os.getpid()}.sock")  # noqa: S108 - sun_path is short
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.bind(str(path))
        sock.setblocking(False)
        self._sock, self._sock_path = sock, path
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_datagrams)

    def _close_hook_socket(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._sock_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._sock_path.unlink()

    def _on_datagrams(self, limit: int | None = _DATAGRAMS_PER_WAKEUP) -> None:
        """Handle the hook's datagrams waiting on the socket (at most ``limit``; None: all)."""
        if self._sock is None:
            return
        count = 0
        while limit is None or count < limit:
            try:
                data = self._sock.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            self._on_hook_message(data)
            count += 1

    def _replace_ranks(self, launch_id: str) -> None:
        """The ranks were stopped for ``launch_id``: what they sent before they ended is
        theirs (stamped with their launch), and only then is the agent's launch the new one."""
        self._on_datagrams(limit=None)
        self.launch_id = launch_id

    def _on_hook_message(self, data: bytes) -> None:
        msg = self._decoder.decode(data)
        if msg is None:
            self.counters.hook_rejected += 1
            return
        if not isinstance(msg, IterationTiming | ExceptionReport | SlowStep):
            self.counters.hook_rejected += 1
            return
        if msg.job_id != self.job_id or msg.node != self.node:
            self.counters.hook_wrong_envelope += 1
            return
        if isinstance(msg, IterationTiming):
            msg = msgspec.structs.replace(msg, launch_id=self.launch_id)
            self._on_iteration(msg, time.monotonic())
        elif isinstance(msg, SlowStep):
            if msg.rank in self.monitor.ranks:  # an unseen rank has no deadline to extend yet
                now = time.monotonic()
                self.monitor.expect_slow_step(msg.phase, now, iteration=msg.iteration, rank=msg.rank)
        else:
            log.info("rank_exception", rank=msg.rank, exc_type=msg.exc_type, message=msg.message[:200])
            msg = msgspec.structs.replace(msg, launch_id=self.launch_id)
        self._emit(msg)

    # --- GPUs -------------------------------------------------------------------------

    def _gpu_event_threadsafe(
        self, gpu: int, kind: GpuFaultKind, value: float, detail: str, injected: bool
    ) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._gpu_event, gpu, kind, value, detail, injected)

    def _gpu_event(self, gpu: int, kind: GpuFaultKind, value: float, detail: str, injected: bool) -> None:
        log.warning("gpu_event", gpu=gpu, kind=kind.value, value=value, injected=injected)
        self._emit(
            GpuHealthEvent(
                **self._env(), gpu_index=gpu, kind=kind, value=value, detail=detail[:1024], injected=injected
            )
        )

    # --- coordinator commands ---------------------------------------------------------

    async def _commands(self) -> None:
        assert self._client is not None
        stream = self.keys.agent_commands(self.job_id, self.node)
        await self._ready.wait()
        backoff = 0.1
        while not self._stop.is_set():  # (a cancellation redis-py swallowed must not keep it)
            try:
                raw = await redis_io.call(
                    ("XREAD", stream),
                    self._client.xread({stream: "0-0"}, count=16, block=_COMMAND_BLOCK_MS),
                )
            except RedisCallError:
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            backoff = 0.1
            reply = cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]], raw or [])
            for _stream, entries in reply:
                for entry_id, fields in entries:
                    await self._handle_command(fields.get(PAYLOAD_FIELD.encode(), b""))
                    with contextlib.suppress(RedisCallError):
                        await redis_io.call(("XDEL", stream), self._client.xdel(stream, entry_id))

    async def _handle_command(self, data: bytes) -> None:
        """Validate one command, run it, and answer it (:class:`CommandResult`), whatever
        happens: a command that cannot be decoded for this agent is answered when its id
        can be read, one that fails is answered with the error, and nothing a command does
        can end the command task (only cancellation does)."""
        msg = self._cmd_decoder.decode(data)
        if not isinstance(msg, AgentCommand) or msg.job_id != self.job_id or msg.node != self.node:
            self.counters.commands_rejected += 1
            why = str(self._cmd_decoder.last_error or "wrong type or envelope")
            if isinstance(msg, AgentCommand):
                mine = f"job {self.job_id} on {self.node}"
                why = f"command for job {msg.job_id} on {msg.node}; this agent is {mine}"
            log.warning("command_rejected", error=why)
            command_id = _command_id(data)
            if command_id:
                self._emit(
                    CommandResult(**self._env(), command_id=command_id, ok=False, detail=f"rejected: {why}")
                )
            return
        if msg.fence and msg.fence < self.fence:
            # From a deposed unicornd: not run, and not answered (the leader sends the same
            # command ids; an answer would read as the failure of its own command).
            self.counters.commands_rejected += 1
            log.warning(
                "command_from_deposed_leader", command_id=msg.command_id, fence=msg.fence, seen=self.fence
            )
            return
        self.fence = max(self.fence, msg.fence)
        earlier = self._answered.get(msg.command_id)
        if earlier is not None:
            # Sent again (unicornd died between sending it and recording that it did):
            # answered as before, not run twice.
            ok, detail = earlier
            self._emit(
                CommandResult(
                    **self._env(), command_id=msg.command_id, ok=ok, detail=f"again: {detail}"[:4096]
                )
            )
            return
        refusal = self._refusal(msg)
        if refusal is not None:
            ok, detail = False, f"rejected: {refusal}"
        else:
            try:
                ok, detail = await asyncio.wait_for(self._execute(msg), msg.deadline_s)
            except TimeoutError:
                ok, detail = False, f"deadline {msg.deadline_s:g}s exceeded"
            except asyncio.CancelledError:
                raise
            except Exception as e:
                ok, detail = False, f"{type(e).__name__}: {e}"
        self.counters.commands_done += 1
        self._answered[msg.command_id] = (ok, detail)
        while len(self._answered) > _ANSWERS_KEPT:
            self._answered.pop(next(iter(self._answered)))
        log.info("command_done", command_id=msg.command_id, action=msg.action.value, ok=ok, detail=detail)
        self._emit(CommandResult(**self._env(), command_id=msg.command_id, ok=ok, detail=detail[:4096]))
        if ok and msg.action == AgentAction.STOP:
            self._stop.set()

    def _refusal(self, cmd: AgentCommand) -> str | None:
        """Why ``cmd`` cannot run here (None: it can)."""
        if cmd.action == AgentAction.RELAUNCH and not cmd.argv:
            return "relaunch without a training command (argv is empty)"
        if cmd.action == AgentAction.RESTART_RANKS and not self.argv:
            return "no training command to restart"
        return None

    async def _execute(self, cmd: AgentCommand) -> tuple[bool, str]:
        sup = self.supervisor
        if cmd.action == AgentAction.STOP:
            info = await sup.stop(self.grace_s) if sup is not None else None
            return True, "stopped" if info is None else f"stopped ({_describe_exit(info)})"
        if cmd.action == AgentAction.CHECKPOINT_NOW:
            if sup is None:
                return False, "no training process"
            sent = sup.signal_ranks(signal.SIGUSR1)
            self.monitor.expect_slow_step(IterationPhase.CHECKPOINT, time.monotonic())
            return sent > 0, f"SIGUSR1 sent to {sent} process(es)"
        if cmd.action == AgentAction.RESTART_RANKS:
            if sup is not None:
                await sup.stop(self.grace_s)
            self._replace_ranks(cmd.command_id)  # only once the ranks it replaces are gone
            await self._start_training(self.argv, {})
            return True, "restarted"
        # RELAUNCH: the new command is the task's from now on, even if it fails to start
        # (a later restart_ranks restarts the new layout, never the old one).
        if sup is not None:
            await sup.stop(self.grace_s)
        self._replace_ranks(cmd.command_id)
        self.argv = list(cmd.argv)
        await self._start_training(cmd.argv, dict(cmd.env))
        return True, f"relaunched: {' '.join(cmd.argv[:6])}"

    # --- local hang detection ---------------------------------------------------------

    def _new_monitor(self) -> IterationMonitor:
        d = self.cfg.detect
        return IterationMonitor(
            hang_factor=d.hang_factor,
            warmup_iterations=d.warmup_iterations,
            max_hang_factor=d.max_hang_factor,
            slow_step_timeout_s=SLOW_STEP_TIMEOUT_S,
            # No lenient start: this monitor only reports a rank that is stopped (state T),
            # which is certain; the coordinator's judges silence alone and starts lenient.
            noise_iterations=0,
        )

    async def _watch_hangs(self) -> None:
        """Report a local stall once per stalled iteration when a rank of it is stopped (state T).

        Other stalls are the coordinator's to judge: a rank here asleep in a collective may
        wait for a rank on another node that is only starved of CPU, which only the
        coordinator hears of (every agent's ``cpu_wait_s``); a stopped rank is certain.
        """
        next_sample = 0.0
        failed: set[str] = set()
        while True:
            await asyncio.sleep(_HANG_CHECK_S)
            try:
                next_sample = self._check_hang(next_sample)
            except (
                Exception
            ) as exc:  # our bug: keep watching, and sampling the CPU waits every heartbeat carries
                if type(exc).__name__ not in failed:  # logged once per kind, not 50 times a second
                    failed.add(type(exc).__name__)
                    log.error("hang_check_failed", error=repr(exc), exc_info=exc)

    def _check_hang(self, next_sample: float) -> float:
        """One turn of :meth:`_watch_hangs`; returns when to sample CPU waits next."""
        now = time.monotonic()
        deadline = self.monitor.deadline_s()
        near = deadline is not None and self.monitor.silent_s(now) >= _NEAR_DEADLINE * deadline
        if near or now >= next_sample:
            next_sample = now + _CPU_WAIT_SAMPLE_S
            self._sample_cpu_wait(now)
        verdict = self.monitor.check(now)
        if verdict is None:
            self._hang_reported = None
            return next_sample
        if self._hang_reported == verdict.last_iteration:
            return next_sample
        stopped = self.stopped_ranks()
        if not stopped:
            return next_sample
        self._hang_reported = verdict.last_iteration
        c = verdict.classification()
        evidence = f"{c.evidence}; stopped (state T): rank(s) {stopped}"
        log.warning("hang_detected", ranks=verdict.ranks, stopped=stopped, waited_s=verdict.waited_s)
        self._emit(
            FaultReport(
                **self._env(),
                status=str(c.status),
                severity=str(c.severity),
                rule=c.rule,
                rank=stopped[0],
                evidence=evidence[:2048],
                launch_id=self.launch_id,
            )
        )
        return next_sample

    # --- diagnosis helpers ------------------------------------------------------------

    def _sample_cpu_wait(self, now_s: float) -> None:
        """Add the largest increase of any live rank's run-queue wait since the last sample to
        :attr:`cpu_wait_s`, and tell the local monitor."""
        sup = self.supervisor
        waits: dict[int, float] = {}
        if sup is not None:
            for pid in sup.ranks:
                if pid not in sup.exited and (wait := run_queue_wait_s(pid)) is not None:
                    waits[pid] = wait
        self.cpu_wait_s += cpu_wait_increase(self._rank_waits, waits)
        self._rank_waits = waits
        self.monitor.observe_cpu_wait(self.node, self.cpu_wait_s, now_s)

    def stopped_ranks(self) -> list[int]:
        """Ranks whose process is stopped (state T), e.g. by SIGSTOP or a debugger."""
        sup = self.supervisor
        if sup is None:
            return []
        return [
            info.rank
            for pid, info in sup.ranks.items()
            if info.rank is not None and pid not in sup.exited and process_state(pid) in ("T", "t")
        ]


def _log_task_end(task: asyncio.Task[None]) -> None:
    """Log a background task that ended with an exception, at once.

    These tasks run until the agent stops; before, one that raised was found only when the
    agent stopped (``gather(return_exceptions=True)`` dropped it): a ``ValueError`` in the
    local hang monitor silently ended the agent's stopped-rank reports in every run
    (``detection.py``, session 26). Training goes on: the coordinator still judges the
    task's heartbeats and iterations, and our own bug must not take a healthy job down."""
    if task.cancelled() or (exc := task.exception()) is None:
        return
    log.error("agent_task_failed", task=task.get_name(), error=repr(exc), exc_info=exc)


def run_queue_wait_s(pid: int) -> float | None:
    """Seconds ``pid``'s main thread has spent runnable but waiting for a CPU
    (``/proc/<pid>/schedstat``, field 2); None when it is gone or the kernel lacks schedstats."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def cpu_wait_increase(before: dict[int, float], after: dict[int, float]) -> float:
    """The largest increase of a pid's wait from ``before`` to ``after`` (pid -> seconds): the
    time the most-starved rank waited between two samples. New pids have no increase yet."""
    return max([0.0, *(after[pid] - before[pid] for pid in after.keys() & before.keys())])


def _command_id(data: bytes) -> str:
    """The ``command_id`` of a command that failed validation, if one can be read (so its
    sender still gets an answer); "" otherwise."""
    try:
        doc = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, ValueError):
        return ""
    value = doc.get("command_id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= 512 else ""


def _describe_exit(info: ExitInfo) -> str:
    if info.signal is not None:
        return f"signal {info.signal}"
    return f"exit {info.exit_code}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--job-id", type=int, default=None, help="Slurm job id (default: $SLURM_JOB_ID).")
@click.option("--node", default=None, help="Node name (default: $SLURMD_NODENAME, else the hostname).")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Logs and the hook socket (default: /tmp/unicorn/<redis key prefix>/<job>/<node>).",
)
@click.option(
    "--inject-gpu-faults",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TEST ONLY: JSON lines appended to this file become injected GPU faults.",
)
@click.option(
    "--exit-with-training",
    is_flag=True,
    help="Exit when the training command ends, with its status (default: wait for commands).",
)
@click.option(
    "--grace-s",
    type=click.FloatRange(min=0.0),
    default=5.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL when stopping training.",
)
@click.option(
    "--launch-id",
    default="",
    help="Id of the coordinator action that started this agent (tags its ranks' iterations).",
)
@click.option(
    "--await-launch",
    is_flag=True,
    help="Read the training command stored for --launch-id in Redis (one srun step started "
    "every agent of the job) instead of taking COMMAND.",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def cli(  # noqa: PLR0917 - click passes options positionally
    config_path: Path | None,
    job_id: int | None,
    node: str | None,
    run_dir: Path | None,
    inject_gpu_faults: Path | None,
    exit_with_training: bool,
    grace_s: float,
    launch_id: str,
    await_launch: bool,
    command: tuple[str, ...],
) -> None:
    """Supervise COMMAND (e.g. torchrun ...) on this node and report to unicornd through Redis."""
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    configure_logging(
        cfg.log.level, "json" if cfg.log.format == "auto" else cfg.log.format, stream=sys.stderr
    )
    if job_id is None:
        raw = os.environ.get("SLURM_JOB_ID", "")
        if not raw.isdigit():
            raise click.UsageError("no --job-id and no numeric $SLURM_JOB_ID")
        job_id = int(raw)
    if job_id < 0:
        raise click.UsageError(f"--job-id must be >= 0, got {job_id}")
    node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        RedisKeys(cfg.redis.key_prefix).heartbeat(job_id, node)
    except UnicornError as e:
        raise click.UsageError(str(e)) from None
    if exit_with_training and not command:
        raise click.UsageError("--exit-with-training needs a COMMAND")
    if await_launch and (command or not launch_id):
        raise click.UsageError("--await-launch takes no COMMAND and needs --launch-id")
    # Per installation (key prefix), job and node: job ids repeat across clusters.
    run_dir = run_dir or agent_run_dir(cfg.redis.key_prefix, job_id, node)
    agent = Agent(
        cfg,
        job_id=job_id,
        node=node,
        run_dir=run_dir,
        argv=command,
        inject_gpu_faults=inject_gpu_faults,
        exit_with_training=exit_with_training,
        grace_s=grace_s,
        launch_id=launch_id,
        await_launch=await_launch,
    )
    sys.exit(asyncio.run(agent.run()))


def main() -> None:
    cli()
