"""The executor: the only code that changes Slurm or writes agent commands.

It performs owed actions and reports each one's :class:`~unicornd.actions.Outcome` to
:meth:`unicornd.core.Core.finish`; it never decides and never waits on Slurm for
anything but the action at hand. Actions that share a resource
(:func:`unicornd.actions.resources`) run in commit order, one at a time; actions that
share none run at the same time, so a node check or one job's requeue never holds up
another job's recovery.

Errors become outcomes: a temporary error (a timeout, Redis or Slurm briefly away) is
retried with backoff for up to :data:`RETRY_FOR_S`, then ``timed_out``; Slurm refusing
a resize is ``unsupported``; any other :class:`~unicorn_core.errors.UnicornError` is
``failed`` with its command, exit code and output. Anything else is a bug and ends the
executor (and with it unicornd, so systemd restarts it; the action stays owed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Final, cast

import redis.asyncio as aioredis

from launcher.paircheck import paired_check
from unicorn_core import protocol, redis_io
from unicorn_core.config import Config
from unicorn_core.errors import CommandFailed, CommandTimeout, InvalidArgument, UnicornError
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.logs import get_logger
from unicorn_core.paths import CKPT_RING_ENV, agent_run_dir, agent_runs_root
from unicorn_core.protocol import AgentAction
from unicorn_core.slurm.backend import ResizeUnsupported, SlurmBackend, StepHandle
from unicorn_core.slurm.types import NodeState
from unicornd import decide
from unicornd.actions import (
    ALLOCATION,
    Action,
    CheckNode,
    CloseIncident,
    Decision,
    DrainNode,
    Grow,
    LaunchAgents,
    NodeArgv,
    NotifyOperator,
    Outcome,
    OutcomeStatus,
    Replan,
    Requeue,
    RestartAgent,
    ResumeNode,
    RollBack,
    SendCommand,
    Shrink,
    resources,
)
from unicornd.agentusers import AgentUsers
from unicornd.core import Core
from unicornd.launch import agent_argv, bin_dir, logged, logged_on_each_node
from unicornd.leader import Lease
from unicornd.store import Owed

log = get_logger(__name__)

RETRY_FOR_S: Final = 60.0
NODE_CHECK_TIMEOUT_S: Final = 120.0
IDLE_WAIT_S: Final = 1.0
MAX_ACTIONS_IN_FLIGHT: Final = 32
"""Actions performed at once; the others wait their turn, in order. Each holds at most one
Redis connection at a time, and redis-py's pool (100 connections by default, shared with
the readers, the lease, the probes) fails a call beyond it at once (MaxConnectionsError).
Found by the 4,096-node scale bench's hour: a burst of commands to the nodes of several
jobs ran out of connections, and a failed lease check ended unicornd."""
NODE_CHECK_VERDICT: Final = "unhealthy:"
"""How ``unicorn-node-check`` starts the line that names what failed (its verdict)."""
PAIRED_CHECK_TIMEOUT_S: Final = 60.0
"""Per test of the paired check (each test: an all-gather and a matmul on 2-3 nodes)."""
LAUNCH_WATCH_S: Final = 5.0
"""How long after its start an agent's srun step that exits non-zero fails its launch. srun
exits at once when it cannot create the step (the allocation changed under it, or Slurm
broke it: 22.05 after a requeue, "Invalid generic resource (gres) specification"); the rung
then fails at once, instead of after a heartbeat timeout of silence (30 s by default)."""
LAUNCH_COMMAND_DEADLINE_S: Final = 60.0
"""What an agent of a whole-job step is given to start its stored training command."""
LAUNCH_KEY_TTL_S: Final = 3600
"""How long a stored training command is kept: an agent reads it within seconds of its
srun step's start; the key is not needed after that, and no job's keys pile up."""


class CheckFailed(UnicornError):
    """A node check (or the paired check) found ``nodes`` at fault (none: it could not
    tell which); ``detail`` says what failed. Final: the check ran and answered."""

    def __init__(self, nodes: tuple[str, ...], detail: str) -> None:
        super().__init__(detail)
        self.nodes = nodes


def _drain_group(owed: Sequence[Owed], i: int, running: Mapping[str, object], busy: set[str]) -> list[Owed]:
    """``owed[i]`` and, if it is a drain, the drains of the same reason and kind committed
    right after it, on other nodes free now and none of them running: they may go to Slurm
    in one call. Only adjacent ones, so commit order between a drain and any other change
    of the allocation holds."""
    first = owed[i].action
    group = [owed[i]]
    if not isinstance(first, DrainNode) or first.action_id in running:
        return group
    nodes = {first.node}
    for nxt in owed[i + 1 :]:
        a = nxt.action
        if (
            not isinstance(a, DrainNode)
            or (a.reason, a.down) != (first.reason, first.down)
            or a.action_id in running
            or a.node in nodes
            or (resources(a) - {ALLOCATION}) & busy
        ):
            break
        group.append(nxt)
        nodes.add(a.node)
    return group


def _raise_if_cancelled() -> None:
    """End the calling task if it was asked to stop and the request was lost on the way: on
    Python 3.11 ``asyncio.wait_for`` hides a cancellation that lands in the tick its inner
    future completes (python/cpython#86296, fixed in 3.12), and a library awaited here may
    do the same; the executor's loop would then go on. Its task still counts the request
    (:meth:`asyncio.Task.cancelling`). Seen once at stop in the 4,096-node hour:
    ``shutdown_stuck: ['executor']``, waiting in the loop's next ``asyncio.wait``; which
    call lost the request there was not found."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Executor:
    """Performs owed actions (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        core: Core,
        slurm: SlurmBackend,
        client: aioredis.Redis,
        agent_users: AgentUsers,
        *,
        config_path: str | None = None,
        lease: Lease | None = None,
        on_failed: Callable[[str], None] | None = None,
        on_launching: Callable[[LaunchAgents], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.lease = lease
        self.on_failed = on_failed
        """Told the id of every action that did not succeed (the detector: a launch or
        command that never happened replaced no ranks)."""
        self.on_launching = on_launching
        """Told of every launch of agents as it starts (the detector: their grace for a
        first beat starts now, not at the commit)."""
        self.core = core
        self.slurm = slurm
        self.client = client
        self.keys = RedisKeys(cfg.redis.key_prefix)
        self.agent_users = agent_users
        self.config_path = config_path
        self.steps: dict[tuple[int, str], StepHandle] = {}
        self._watches: set[asyncio.Task[None]] = set()
        self.actions_run = 0
        self._running: dict[str, asyncio.Task[None]] = {}
        self._released: dict[str, frozenset[str]] = {}
        """Per running action: resources it no longer holds (:meth:`_release`)."""
        self._handlers: dict[type[Any], Callable[[Any], Awaitable[str]]] = {
            DrainNode: self._drain_node,
            ResumeNode: self._resume_node,
            SendCommand: self._send,
            LaunchAgents: self._launch,
            Shrink: self._shrink,
            Grow: self._grow,
            Requeue: self._requeue,
            CheckNode: self._check_node,
            NotifyOperator: self._notify,
            CloseIncident: self._close,
            Replan: self._request,
            RestartAgent: self._request,
            RollBack: self._request,
        }

    async def run(self, draining: Callable[[], bool]) -> None:
        """Start every owed action whose resources are free, forever; with ``draining()``
        start nothing new and return once the actions in flight are done."""
        while True:
            _raise_if_cancelled()
            if draining():
                if self._running:
                    await asyncio.wait(list(self._running.values()))
                return
            self.core.wake.clear()
            busy: set[str] = set()
            owed_now = await self.core.store.owed()
            _raise_if_cancelled()
            i = 0
            while i < len(owed_now):
                group = _drain_group(owed_now, i, self._running, busy)
                needs = frozenset().union(*(resources(o.action) for o in group))
                if group[0].action.action_id not in self._running and not needs & busy:
                    if len(set(self._running.values())) >= MAX_ACTIONS_IN_FLIGHT:
                        break  # the rest once one ends (the wait below wakes on it)
                    self._start(group)
                busy |= needs - self._released.get(group[0].action.action_id, frozenset())
                i += len(group)
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.core.wake.wait())]
            waits += self._running.values()
            done, _ = await asyncio.wait(waits, timeout=IDLE_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
            waits[0].cancel()
            failed = [t for t in done if t is not waits[0] and t.exception() is not None]
            for t in failed[1:]:  # retrieved and logged: only the first ends unicornd
                name = t.get_name() if isinstance(t, asyncio.Task) else "?"
                log.error("action_task_failed", task=name, error=repr(t.exception()))
            if failed:
                raise failed[0].exception()  # type: ignore[misc]  # a bug: end unicornd

    def in_flight(self) -> list[asyncio.Task[None]]:
        """The actions being performed now, and the launches being watched (cancelled when
        unicornd stops)."""
        return [*self._running.values(), *self._watches]

    def _start(self, group: list[Owed]) -> None:
        """Perform ``group``: one action, or drains done in one Slurm call (:func:`_drain_group`)."""
        ids = [o.action.action_id for o in group]
        coro = self._perform(group[0]) if len(group) == 1 else self._perform_drains(group)
        task = asyncio.create_task(coro, name=f"action:{ids[0]}")
        for aid in ids:
            self._running[aid] = task
        task.add_done_callback(
            lambda _t: [(self._running.pop(aid, None), self._released.pop(aid, None)) for aid in ids]
        )

    def _release(self, action_id: str, resource: str) -> None:
        """Running action ``action_id`` no longer needs ``resource``: the actions committed
        after it that wait only for that resource may start (the loop looks again now)."""
        self._released[action_id] = self._released.get(action_id, frozenset()) | {resource}
        self.core.wake.set()

    async def _perform_drains(self, group: list[Owed]) -> None:
        """Drains of one reason, committed one after the other, in one ``scontrol`` call
        (a rack's drains: one slurmctld RPC instead of one each); each action's outcome
        is the call's. If the call fails for good, each drain is performed alone, so each
        gets its own outcome (slurmctld updates a list node by node, so some of it may
        have been done; a drain done twice is harmless)."""
        if self.lease is not None:
            await self.lease.check()
        todo: list[Owed] = []
        for owed in group:
            if await self.core.store.done(owed.action.action_id):
                await self._perform(owed)  # reported as run before a restart
            else:
                todo.append(owed)
        if not todo:
            return
        drains = [cast(DrainNode, o.action) for o in todo]
        if len(todo) == 1:
            await self._perform(todo[0])
            return
        t0 = time.monotonic()
        outcome = await self._attempt(drains[0], run=lambda: self._drain_nodes(drains))
        self.actions_run += 1
        if outcome.status is OutcomeStatus.FAILED:
            log.warning("drains_one_by_one", actions=[d.action_id for d in drains], error=outcome.detail)
            for owed in todo:
                await self._perform(owed)
            return
        for owed, drain in zip(todo, drains, strict=True):
            await self._report(owed, replace(outcome, action_id=drain.action_id, node=drain.node), t0)

    async def _perform(self, owed: Owed) -> None:
        action = owed.action
        t0 = time.monotonic()
        if self.lease is not None:
            await self.lease.check()  # a fenced-off leader performs nothing more (LeaseLost ends it)
        if await self.core.store.done(action.action_id):
            outcome = Outcome(action.action_id, action.kind, OutcomeStatus.DONE, "ran before a restart")
        else:
            outcome = await self._attempt(action)
            self.actions_run += 1
        await self._report(owed, outcome, t0)

    async def _report(self, owed: Owed, outcome: Outcome, t0: float) -> None:
        action = owed.action
        if not outcome.ok:
            if self.on_failed is not None:
                self.on_failed(action.action_id)
            await self._incident_log(
                {
                    "kind": "action_failed",
                    "action": action.action_id,
                    "status": outcome.status.value,
                    "error": outcome.detail,
                }
            )
        await self.core.finish(owed, outcome, time.time())
        log.info(
            "action_done",
            action=action.action_id,
            kind=action.kind,
            status=outcome.status.value,
            detail=outcome.detail[:300],
            s=round(time.monotonic() - t0, 3),
        )

    async def _attempt(self, action: Action, run: Callable[[], Awaitable[str]] | None = None) -> Outcome:
        """Perform ``action`` (``run``: what performs it, default its handler), retrying
        temporary errors, and say how it ended."""
        backoff, deadline = 0.2, time.monotonic() + RETRY_FOR_S
        node = getattr(action, "node", "")
        while True:
            try:
                detail = await (run() if run is not None else self._execute(action))
                return Outcome(action.action_id, action.kind, OutcomeStatus.DONE, detail, node)
            except ResizeUnsupported as e:
                return Outcome(action.action_id, action.kind, OutcomeStatus.UNSUPPORTED, str(e), node)
            except CheckFailed as e:
                log.warning("check_failed", action=action.action_id, nodes=list(e.nodes), detail=str(e))
                return Outcome(action.action_id, action.kind, OutcomeStatus.FAILED, str(e), node, e.nodes)
            except UnicornError as e:
                if not e.temporary or time.monotonic() + backoff > deadline:
                    status = (
                        OutcomeStatus.TIMED_OUT if isinstance(e, CommandTimeout) else OutcomeStatus.FAILED
                    )
                    log.error("action_failed", action=action.action_id, kind=action.kind, error=str(e))
                    return Outcome(action.action_id, action.kind, status, str(e), node)
                log.warning("action_retry", action=action.action_id, error=str(e), backoff_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def _execute(self, action: Action) -> str:
        return await self._handlers[type(action)](action)

    # --- one handler per kind: act, return a detail, raise UnicornError on failure ------

    def _managed(self, node: str, what: str) -> None:
        """Never act on a node outside the scope: only the nodes in scope enter the snapshot
        (:func:`unicornd.inputs.observe`), so this refuses only a decision that broke that."""
        if node not in self.core.snap.nodes:
            raise InvalidArgument(
                f"node {node} is not one unicorn manages (outside [slurm] scope): not {what}"
            )

    async def _drain_node(self, action: DrainNode) -> str:
        self._managed(action.node, "drained")
        if action.down:
            await self.slurm.down(action.node, action.reason)
        await self.slurm.drain(action.node, action.reason)
        return "down+drain" if action.down else "drain"

    async def _drain_nodes(self, drains: Sequence[DrainNode]) -> str:
        """Drains of one reason and kind (:func:`_drain_group`) in one call."""
        nodes = [d.node for d in drains]
        for node in nodes:
            self._managed(node, "drained")
        if drains[0].down:
            await self.slurm.down_nodes(nodes, drains[0].reason)
        await self.slurm.drain_nodes(nodes, drains[0].reason)
        return f"{'down+drain' if drains[0].down else 'drain'} ({len(nodes)} nodes in one call)"

    async def _resume_node(self, action: ResumeNode) -> str:
        self._managed(action.node, "resumed")
        await self.slurm.resume(action.node)
        return "resumed"

    async def _shrink(self, action: Shrink) -> str:
        await self.slurm.shrink(action.job_id, action.nodes)
        return f"job {action.job_id} on {','.join(action.nodes)}"

    async def _grow(self, action: Grow) -> str:
        exclude = sorted(set(self.core.snap.nodes) - set(action.add))
        await self.slurm.grow(action.job_id, len(action.add), exclude=exclude)
        return f"job {action.job_id} + {','.join(action.add)}"

    async def _requeue(self, action: Requeue) -> str:
        """The requeue holds the allocation (:data:`ALLOCATION`) only until the job is
        pending on its new nodes; its wait for the job's start (~2.5 s on the dev cluster)
        holds only the job. Found by the 4,096-node hour: a replan's 102 requeues, one at a
        time, kept every drain and resize after them waiting 7 minutes. Later allocation
        changes cannot take those nodes: a plan gives each node to one task, and a grow
        takes only the nodes its plan named. A requeue that holds its job (no nodes) keeps
        the allocation to the end: nothing names where that job may start."""
        placed = (lambda: self._release(action.action_id, ALLOCATION)) if action.nodes else None
        try:
            await self.slurm.requeue(action.job_id, action.nodes, placed=placed)
        except CommandFailed as e:
            # Already requeued (e.g. by the action's first run before a crash): idempotent.
            if "pending" not in f"{e.stdout} {e.stderr}".lower():
                raise
        return f"job {action.job_id} requeued onto {','.join(action.nodes) or '(held)'}"

    async def _check_node(self, action: CheckNode) -> str:
        if action.paired:
            return await self._paired_check(action)
        argv = [str(bin_dir(self.cfg.agent) / "unicorn-node-check")]
        # An incident's suspect is still allocated to its job: the check runs as an
        # --overlap step of that job (a new allocation would wait for the node).
        try:
            out = await self.slurm.run_on_nodes(
                [action.node], argv, timeout_s=NODE_CHECK_TIMEOUT_S, job_id=action.job_id
            )
        except CommandTimeout as e:  # no verdict: Slurm's or SSH's view says whether it is dead
            raise await self._unrun(action.node, f"node check on {action.node} did not finish: {e}") from e
        detail = (out.stderr or out.stdout).strip()[-300:]
        log.info("node_check", node=action.node, passed=out.exit_code == 0, detail=detail)
        if out.exit_code != 0:
            why = f"node check failed (exit {out.exit_code}): {detail or 'unhealthy'}"
            # The check's own verdict convicts; srun failing to run it convicts only when
            # slurmctld itself holds the node down (_unrun).
            if NODE_CHECK_VERDICT in out.stderr:
                raise CheckFailed((action.node,), why)
            raise await self._unrun(action.node, why)
        return detail or "passed"

    async def _unrun(self, node: str, why: str) -> CheckFailed:
        """The node check did not run (or finish) on ``node``: it convicts the node only
        when slurmctld marks it NOT_RESPONDING or DOWN now, Slurm's own view that the node
        is lost (else no verdict: nothing convicted). A check runs on
        an incident's suspect, whose agent is silent (or whose fault is node-level), so this
        is the confirmation :meth:`unicornd.inputs.SlurmWatch` accepts (silent agent and
        NOT_RESPONDING node). Found by the 4,096-node hour: a dead node's restarted agent
        was "never heard from", its check failed with srun's "Required node not available
        (down)", and the incident went to the operator with nothing drained (80 times in
        the hour). Slurm unreadable: no conviction."""
        try:
            info = await self.slurm.get_node(node)
        except UnicornError as e:
            log.warning("node_state_unreadable", node=node, error=str(e), after=why)
            return CheckFailed((), why)
        if info.responding and info.state is not NodeState.DOWN:
            return CheckFailed((), why)
        flags = ",".join(sorted(info.flags)) or "-"
        return CheckFailed((node,), f"{why}; slurmctld: {node} {info.state} ({flags})")

    async def _paired_check(self, action: CheckNode) -> str:
        report = await paired_check(
            self.slurm,
            list(action.paired),
            master_addr=self.cfg.agent.rendezvous_host or None,
            timeout_s=PAIRED_CHECK_TIMEOUT_S,
            job_id=action.job_id,
            python=str(bin_dir(self.cfg.agent) / "python"),
        )
        d = report.diagnosis
        tests = "; ".join(f"{','.join(r.nodes)} {'ok' if r.ok else 'FAILED'}" for r in report.results)
        log.info(
            "paired_check",
            nodes=list(action.paired),
            bad=list(d.bad),
            unresolved=list(d.unresolved),
            tests=[f"{','.join(r.nodes)}: {r.detail}" for r in report.results],
        )
        if d.bad or d.unresolved:
            bad, unresolved = ",".join(d.bad) or "-", ",".join(d.unresolved) or "-"
            why = f"paired check: bad {bad}, unresolved {unresolved} ({tests})"
            raise CheckFailed(tuple(d.bad), why)
        return f"paired check passed ({tests})"

    async def _send(self, action: SendCommand) -> str:
        stream = self.keys.agent_commands(action.job_id, action.node)
        payload = {PAYLOAD_FIELD: protocol.encode(action.message(time.time(), fence=self._fence()))}
        await redis_io.call(("XADD", stream), self.client.xadd(stream, payload))  # type: ignore[arg-type]
        return f"{action.action.value} sent"

    def _fence(self) -> int:
        """This unicornd's fencing token for the commands it writes (0: no lease)."""
        return self.lease.token if self.lease is not None else 0

    async def _launch(self, action: LaunchAgents) -> str:
        """The agents of ``action``: one srun step for all its nodes
        (:meth:`_launch_job_step`), or for its one node (:meth:`_launch_node`)."""
        if self.on_launching is not None:
            self.on_launching(action)
        credentials = await self.agent_users.env(action.job_id)
        # The checkpoint ring: the task's nodes as committed with this launch (an agent
        # restarted alone joins its task's ring, not a ring of one).
        task = self.core.snap.tasks.get(action.task_id)
        ring = task.nodes if task is not None and set(action.nodes) <= set(task.nodes) else action.nodes
        env = {**action.env, **credentials, CKPT_RING_ENV: ",".join(ring)}
        if len(action.commands) > 1:
            await self._launch_job_step(action, env)
            return f"agents on {','.join(action.nodes)} (one step)"
        (cmd,) = action.commands
        await self._launch_node(action, cmd, env)
        return f"agent on {cmd.node}"

    async def _launch_node(self, action: LaunchAgents, cmd: NodeArgv, env: Mapping[str, str]) -> None:
        # A new agent reads its command stream from the start: whatever is queued there
        # was written for an agent before it (one that died before reading it, e.g. a
        # restart sent to a node that was being killed) and must never run now. Found by
        # the soak bench: a requeue back onto a revived node restarted the new ranks
        # with a restart written for that node three cycles earlier.
        stream = self.keys.agent_commands(action.job_id, cmd.node)
        await redis_io.call(("DEL", stream), self.client.delete(stream))
        await self._stop_replaced(action.job_id, (cmd.node,))
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
            logged(argv, agent_run_dir(self.keys.prefix, action.job_id, cmd.node)),
            env=env,
            capture=False,
        )
        self.steps[(action.job_id, cmd.node)] = step
        self._watch(action, (cmd.node,), step)

    async def _launch_job_step(self, action: LaunchAgents, env: Mapping[str, str]) -> None:
        """One srun step starts the agents of all of ``action``'s nodes: one slurmctld RPC and
        two head-node processes for the whole job, where a step per node costs one RPC and
        two processes (~3.8 MiB) per node for as long as the agents run (BENCHMARKS.md).

        Each node's training command differs (node rank, rendezvous), and one step runs one
        command line: each node's is stored in Redis first, as a ``relaunch`` command under
        the launch's id (:meth:`RedisKeys.agent_launch`), together with clearing what the
        node's command stream holds for an agent before it (one round trip for all). The
        agents learn their node from ``$SLURMD_NODENAME`` and read their command
        (``--await-launch``). The step is ``--no-kill``: a node that fails ends only its
        own agent (Slurm otherwise signals every task of a step with a failed node)."""
        fence = self._fence()
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        for cmd in action.commands:
            # The relaunch this agent would be sent, under the launch's id (not sent: stored).
            relaunch = SendCommand(
                action.action_id,
                action.job_id,
                cmd.node,
                AgentAction.RELAUNCH,
                deadline_s=LAUNCH_COMMAND_DEADLINE_S,
                argv=tuple(cmd.argv),
            )
            message = relaunch.message(now, fence=fence)
            launch_key = self.keys.agent_launch(action.job_id, cmd.node)
            pipe.delete(self.keys.agent_commands(action.job_id, cmd.node))
            pipe.set(launch_key, protocol.encode(message), ex=LAUNCH_KEY_TTL_S)
        await redis_io.call(("DEL+SET", f"launch of job {action.job_id}"), pipe.execute())
        await self._stop_replaced(action.job_id, action.nodes)
        argv = agent_argv(
            self.cfg.agent, action.job_id, None, (), config_path=self.config_path, launch_id=action.action_id
        )
        step = await self.slurm.launch_step(
            action.job_id,
            action.nodes,
            logged_on_each_node(argv, agent_runs_root(self.keys.prefix, action.job_id)),
            env=env,
            options=("--no-kill", "--wait=0"),
            capture=False,
        )
        for node in action.nodes:
            self.steps[(action.job_id, node)] = step
        self._watch(action, action.nodes, step)

    async def _stop_replaced(self, job_id: int, nodes: Sequence[str]) -> None:
        """Stop the steps of the agents that new ones on ``nodes`` replace, where a step runs
        on none but those nodes. An older step that also runs elsewhere is left running: the
        new agent ends its predecessor on its own node (:mod:`launcher.supersede`)."""
        olds = {id(old): old for n in nodes if (old := self.steps.pop((job_id, n), None)) is not None}

        async def stop(old: StepHandle) -> None:
            with contextlib.suppress(UnicornError, ProcessLookupError):
                await old.stop(grace_s=5.0)

        await asyncio.gather(*(stop(old) for old in olds.values() if set(old.nodes) <= set(nodes)))

    def _watch(self, action: LaunchAgents, nodes: tuple[str, ...], step: StepHandle) -> None:
        watch = asyncio.create_task(self._watch_launch(action, nodes, step), name=f"watch:{','.join(nodes)}")
        self._watches.add(watch)
        watch.add_done_callback(self._watch_done)

    def _watch_done(self, watch: asyncio.Task[None]) -> None:
        self._watches.discard(watch)
        if not watch.cancelled() and watch.exception() is not None:  # a bug: say so loudly
            log.error("launch_watch_crashed", task=watch.get_name(), error=repr(watch.exception()))

    async def _watch_launch(self, action: LaunchAgents, nodes: tuple[str, ...], step: StepHandle) -> None:
        """Fail ``action`` on ``nodes`` if their srun exits non-zero within
        :data:`LAUNCH_WATCH_S` (the launch itself was done once srun started). A step this
        executor stopped or replaced meanwhile is not a failure; a stale outcome is only
        noted by the decision. (One agent of a whole-job step that fails alone does not end
        the step: it answers its launch as failed itself, ``launcher.agent``.) Once the step
        has ended, :attr:`steps` forgets it (:meth:`_forget_step`)."""
        try:
            code = await asyncio.wait_for(step.wait(), LAUNCH_WATCH_S)
        except TimeoutError:
            await step.wait()  # the agents run; the step ends with the job, a stop or a requeue
            self._forget_step(action.job_id, nodes, step)
            return
        try:
            await self._launch_exited(action, nodes, step, code)
        finally:
            self._forget_step(action.job_id, nodes, step)

    def _forget_step(self, job_id: int, nodes: tuple[str, ...], step: StepHandle) -> None:
        """Drop the ended ``step`` from :attr:`steps` where a later launch has not replaced it:
        kept, every (job, node) a job ever ran an agent on stayed for the daemon's life."""
        for node in nodes:
            if self.steps.get((job_id, node)) is step:
                del self.steps[(job_id, node)]

    async def _launch_exited(
        self, action: LaunchAgents, nodes: tuple[str, ...], step: StepHandle, code: int
    ) -> None:
        """The launch's step exited ``code`` within the watch: a failure unless it was 0 or stopped."""
        if code == 0 or any(self.steps.get((action.job_id, n)) is not step for n in nodes):
            return
        task = self.core.snap.tasks.get(action.task_id)
        if (
            task is None
            or task.job_id != action.job_id
            or task.requeue is not None
            or not set(nodes) <= set(task.nodes)
        ):
            return  # the job was requeued or moved meanwhile: Slurm ended the step on purpose
        where = ",".join(nodes)
        detail = (
            f"the agents' srun step on {where} exited {code} within {LAUNCH_WATCH_S:g} s of its start "
            "(Slurm did not create the step, or the agent could not start; slurmctld's log says why)"
        )
        log.warning("agent_launch_exited", action=action.action_id, nodes=where, exit_code=code)
        node = nodes[0] if len(nodes) == 1 else ""
        outcome = Outcome(action.action_id, action.kind, OutcomeStatus.FAILED, detail, node)
        now = time.time()
        try:
            await self.core.decide(now, partial(decide.on_outcome, outcome=outcome, now_s=now))
        except UnicornError as e:  # Redis away: the silence that follows still finds it
            log.error("launch_watch_failed", action=action.action_id, nodes=where, error=str(e))

    async def _notify(self, action: NotifyOperator) -> str:
        log.error("operator_needed", incident=action.incident_id, why=action.why)
        await self._incident_log({"kind": "operator", "incident": action.incident_id, "why": action.why})
        return "logged"

    async def _close(self, action: CloseIncident) -> str:
        inc = self.core.snap.incidents.get(action.incident_id)
        await self._incident_log({"kind": "closed", "incident": inc.to_dict() if inc else action.incident_id})
        return "logged"

    async def _request(self, action: Replan | RestartAgent | RollBack) -> str:
        """Owed by an older unicornd, which executed these: resolve them now instead."""
        await self.core.decide(time.time(), lambda _snap: Decision(actions=(action,)))
        return "resolved"

    async def _incident_log(self, doc: dict[str, Any]) -> None:
        await redis_io.call(
            ("XADD", self.keys.incidents()),
            self.client.xadd(
                self.keys.incidents(), {PAYLOAD_FIELD: json.dumps({"t": time.time(), **doc})}, maxlen=10_000
            ),
        )
