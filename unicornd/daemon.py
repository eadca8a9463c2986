"""unicornd: the coordinator's closed loop on real Slurm and Redis.

    inputs ──> decide (pure) ──> resolve ──> commit ──> executor ──> outcome ─┐
      ^  agents' events, command results; control requests; Slurm; the clock │
      └──────────────────────────────────────────────────────────────────────┘

Root tasks, each named, under one guard (the first to end or fail takes the rest down
and the process exits non-zero, so systemd restarts it):

- ``events``: each job's events and command results (:class:`unicornd.inputs.AgentInputs`);
- ``control``: requests (:class:`unicornd.requests.Requests`);
- ``ticker``: silence, deadlines, lazy progress commits (:class:`unicornd.inputs.Ticker`);
- ``slurm``: nodes and jobs (:class:`unicornd.inputs.SlurmWatch`);
- ``executor``: performs the owed actions (:class:`unicornd.executor.Executor`), the only
  code that changes Slurm or writes agent commands; their outcomes are inputs;
- ``liveness``: the TTL key ``unicornctl status --check`` looks at;
- ``alerts``: delivers alerts that follow commits;
- ``lease``: renews the leader's lease; ends (and with it this unicornd) once it is lost;
- ``lookup``: solves the plans of single-node failures ahead, in a worker process, on
  large clusters (:mod:`unicornd.lookup`).

Every decision is a pure function of the snapshot, an input and the clock; its records
and actions are committed together (:class:`unicornd.core.Core`) before the input is
acknowledged, so kill -9 loses no event and performs no action twice.

Leadership: any number of unicornd may run; one holds the lease in Redis and runs the
root tasks, the others stand by (:mod:`unicornd.leader`). A deposed leader's commits are
refused (fencing), so it exits non-zero and comes back as a standby.

Signals: SIGTERM drains (stop taking inputs, finish the actions in flight, exit 0);
SIGINT and SIGQUIT stop now (exit 0; owed actions stay owed and run after a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import os
import signal
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, Final

import redis.asyncio as aioredis

from detect import Classifier, load_classifier
from plan.hardware import gpu_spec
from unicorn_core import acl, redis_io
from unicorn_core.aio import cancel_all, stacks
from unicorn_core.config import Config
from unicorn_core.errors import ProtocolError, UnicornError
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import get_logger
from unicorn_core.protocol import Heartbeat
from unicorn_core.slurm.backend import SlurmBackend
from unicorn_core.slurm.scope import Scope, resolve_scope
from unicornd import decide, seed
from unicornd.actions import Decision, LaunchAgents
from unicornd.agentusers import AgentUsers
from unicornd.alerts import AlertSink, alerts_for
from unicornd.core import Core
from unicornd.detector import Detector
from unicornd.executor import Executor
from unicornd.goodput import new_ledger
from unicornd.ingest import StreamIngest
from unicornd.inputs import AgentInputs, SlurmWatch, Ticker, observe
from unicornd.leader import Lease
from unicornd.ledgerstore import read_ledger
from unicornd.lookup import Lookup
from unicornd.metrics import SnapshotMetrics, start_metrics_server
from unicornd.replan import PlanContext
from unicornd.requests import Requests
from unicornd.state import NodeHealth, NodeRecord, Policy, Snapshot
from unicornd.store import Store, prune

log = get_logger(__name__)

LIVENESS_TTL_S: Final = 5.0
M_ARENA_MAX: Final = -8
"""glibc's ``mallopt`` parameter for the most malloc arenas (``<malloc.h>``)."""
TRIM_EVERY_S: Final = 60.0
"""How often unicornd hands the free pages of its malloc heap back (:func:`trim_malloc`)."""
SHUTDOWN_S: Final = 10.0
"""How long the root tasks may take to end once cancelled; a failed unicornd commits
nothing more on its way out (what it held is delivered again to its successor)."""


def one_malloc_arena() -> bool:
    """Make every thread of this process allocate from glibc's main malloc arena; False
    where that cannot be set (not glibc).

    unicornd solves plans in worker threads (``asyncio.to_thread``), and glibc gives each
    thread its own arena, which keeps what a solve freed. Measured at 4,096 nodes
    (``scripts/bench/malloc_arena.py``): each solve in a thread left 13-20 MiB behind; with
    one arena, 0.0 MiB. The scale bench's hour runs showed RSS steps of 43-56 MiB at the
    same moment of their fault schedule. unicornd's few threads contend little for it.
    """
    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False


def trim_malloc() -> bool:
    """Hand the free pages inside glibc's heap back to the kernel (``malloc_trim(0)``); False
    where that cannot be done (not glibc) or nothing was released.

    A plain ``free`` returns memory only from the top of the heap; a page in the middle
    stays resident while any chunk above it lives. unicornd's heap churns in large blocks
    (replies of a few hundred KB, commit documents, large dicts and lists): ``malloc_trim``
    madvises the free pages away (glibc >= 2.8). It holds the arena's lock while it walks
    the heap; with one arena (:func:`one_malloc_arena`) any thread's allocation larger than
    pymalloc's 512 bytes waits for it, the event loop's too, so it runs in a worker thread
    and its durations are kept (:attr:`Daemon.trims`; the scale bench reports them).
    """
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


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
        ident: str | None = None,
        freeze_gc: bool = False,
        trim_every_s: float = TRIM_EVERY_S,
    ) -> None:
        """``freeze_gc``: the process is this daemon's (the ``unicornd`` command): once the
        state is loaded, what exists then leaves Python's full collections, its threads
        share one malloc arena (:meth:`run`, :func:`one_malloc_arena`), and every
        ``trim_every_s`` (0: never) the heap's free pages go back (:func:`trim_malloc`)."""
        self.cfg = cfg
        self.freeze_gc = freeze_gc
        self.trim_every_s = trim_every_s
        self.trims: deque[float] = deque(maxlen=1000)
        """Seconds each :func:`trim_malloc` took, the newest 1,000."""
        self.slurm = slurm
        self.client = client
        self.keys = RedisKeys(cfg.redis.key_prefix)
        self.store = Store(client, self.keys, policy or cfg.recovery, replication=cfg.redis)
        self.detector = Detector(
            cfg.detect,
            cfg.agent,
            classifier or load_classifier(cfg.detect.rules_file or None, nearest=cfg.detect.nearest_lines),
        )
        self.consumer = consumer
        self.alerts = AlertSink(cfg.alerts)
        self.metrics = SnapshotMetrics(gpu=gpu_spec(cfg.plan.gpu))
        self.core = Core(self.store, PlanContext.from_config(cfg), followers=[self._follow])
        self.lease = Lease(client, self.keys, cfg.leader, ident)
        self.agent_users = AgentUsers(client, self.keys, cfg.redis)
        self.agents = AgentInputs(cfg, self.core, self.detector)
        self.requests = Requests(cfg, self.core, slurm, client)
        self.executor = Executor(
            cfg,
            self.core,
            slurm,
            client,
            self.agent_users,
            config_path=config_path,
            lease=self.lease,
            on_failed=self.detector.command_failed,
            on_launching=self._launching,
        )
        self.lookup = Lookup(self.core, min_nodes=cfg.plan.lookup_min_nodes, workers=cfg.plan.lookup_workers)
        self.scope = Scope()
        self._stop = asyncio.Event()
        self._drain_only = False

    @property
    def snapshot(self) -> Snapshot | None:
        return self.core.snapshot

    @property
    def snap(self) -> Snapshot:
        return self.core.snap

    @property
    def actions_run(self) -> int:
        return self.executor.actions_run

    def _launching(self, action: LaunchAgents) -> None:
        self.detector.launching(action.job_id, action.nodes, action.action_id, time.monotonic())

    def _follow(self, before: Snapshot, after: Snapshot, decision: Decision) -> None:
        """A commit happened: the detector, alerts and metrics follow it."""
        self.detector.follow(before, after, decision, time.monotonic())
        self.alerts.submit(alerts_for(before, after, time.time()))
        self.metrics.update(after)
        self.metrics.update_ledger(self.core.ledger)
        self.lookup.follow(before, after, decision)

    async def _load_ledger(self) -> None:
        """The stored goodput ledger, or a new one; one that does not decode is left as it is
        (unicornd keeps none, recovery goes on; ``unicornctl goodput`` says why)."""
        try:
            ledger = await read_ledger(self.client, self.keys)
        except ProtocolError as e:
            log.error("goodput_ledger_unreadable", error=str(e), key=self.keys.goodput())
            return
        self.core.ledger = ledger if ledger is not None else new_ledger(time.time())

    async def _load(self) -> None:
        view, self.scope = await observe(self.slurm, self.scope)
        nodes = view.nodes
        gpus = max((n.gpus for n in nodes), default=1) or 1
        snap = await self.store.load(gpus)
        moved = await self.store.move_untimed_done()
        if moved:
            log.info("done_ids_timed", moved=moved)
        if snap.gpus_per_node != gpus:
            snap = replace(snap, gpus_per_node=gpus)
        snap = _without(snap, {n.name for n in view.outside})
        added = [
            NodeRecord(
                n.name,
                health=NodeHealth.HEALTHY if n.usable else NodeHealth.DRAINED,
                reason="" if n.usable else n.reason,
                jobs=view.held.get(n.name, ()),
                gpus=n.gpus,
                gpu_type=n.gpu_type,
            )
            for n in nodes
            if n.name not in snap.nodes
        ]
        # GPUs as Slurm's GRES says now (a site may retype nodes between runs); the first
        # replan plans with them (the decision's own Replan is not needed at start).
        facts = {n.name: (n.gpus, n.gpu_type) for n in nodes}
        retyped = decide.on_node_gpus(snap, facts, time.time()).nodes
        snap = prune(snap.apply(nodes=[*added, *retyped]), time.time())
        await self._load_ledger()
        await self.core.start(snap)
        self.detector.expect_running(snap, time.monotonic())
        await self._seed_liveness(snap)
        restored = await self.agent_users.restore(snap)
        log.info(
            "state_loaded",
            tasks=len(snap.tasks),
            nodes=len(snap.nodes),
            slurm_nodes=len(nodes) + len(view.outside),
            scope=self.scope.describe(),
            open_incidents=sum(i.is_open for i in snap.incidents.values()),
            owed_actions=len(await self.store.owed()),
            agent_users_restored=restored,
        )

    async def _seed_liveness(self, snap: Snapshot) -> None:
        """Seed the agents' silence from their heartbeat keys (:mod:`unicornd.seed`): one
        MGET; unreadable keys leave the new agents' grace."""
        agents = seed.expected_agents(snap)
        if not agents:
            return
        keys = [self.keys.heartbeat(job, node) for job, node in agents]
        try:
            raw = await redis_io.call(("MGET", f"{len(keys)} heartbeat keys"), self.client.mget(keys))
        except UnicornError as e:
            log.warning("liveness_not_seeded", error=str(e))
            return
        beats: dict[seed.Agent, Heartbeat | None] = {}
        for agent, value in zip(agents, raw, strict=True):
            if value is None:
                beats[agent] = None  # expired: silent since at least its TTL, if settled
                continue
            try:
                beat = seed.decode_beat(value, agent)
            except ProtocolError:
                continue  # garbage in a key: no seed for it
            if beat is not None:
                beats[agent] = beat
        found = seed.silences(
            snap,
            beats,
            time.time(),
            self.detector.liveness.initial_timeout_s,
            self.cfg.agent.heartbeat_ttl_s,
        )
        now = time.monotonic()
        for (job, node), silent in found.items():
            self.detector.seed_silence(job, node, silent, now)
        if found:
            log.info("liveness_seeded", agents=len(found), silent_max_s=round(max(found.values()), 3))

    async def run(self) -> int:
        if self.freeze_gc:  # before any worker thread allocates
            log.info("malloc_arenas", one=one_malloc_arena())
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._drain)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGQUIT, self._stop.set)
        # A bad scope (unknown partition or reservation) is an error at start, standby or not.
        self.scope = await resolve_scope(self.slurm, self.cfg.slurm)
        self.requests.scope = self.scope
        if not await self._lead():
            return 0
        # Roles first: the committed state is what clients wait for, and a client that
        # sees it must be able to log in as its role (a job's wrapper registering at once).
        if self.cfg.redis.operator_password_file or self.cfg.redis.user_password_file:
            log.info("redis_roles", users=await acl.apply_roles(self.client, self.cfg.redis))
        await self._load()
        if self.freeze_gc:
            # What exists now lives as long as the process (modules, configuration, the
            # loaded state): out of the full collections, which otherwise walk all of it
            # every time. Refcounting still frees whatever of it is dropped.
            gc.freeze()
        events = StreamIngest(
            self.client,
            lambda: self.agents.streams(self.agent_users.forgotten),
            self.consumer,
            self.agents.on_message,
            acks=self.core,
            on_caught_up=self.detector.heard_until,
            retention_s=self.cfg.redis.stream_retention_s,
        )
        control = StreamIngest(
            self.client,
            self.requests.streams,
            self.consumer,
            raw_handler=self.requests.on_entry,
            acks=self.core,
        )
        roots: dict[str, Coroutine[Any, Any, None]] = {
            "events": events.run(),
            "control": control.run(),
            "ticker": Ticker(self.core, self.detector, self.agents.on_finding).run(),
            "slurm": SlurmWatch(self.core, self.slurm, self.agent_users, self.detector, self.scope).run(),
            "executor": self._execute(),
            "liveness": self._liveness(),
            "alerts": self.alerts.run(),
            "lease": self.lease.keep(),
            "lookup": self.lookup.run(),
        }
        if self.freeze_gc and self.trim_every_s > 0:
            roots["trim"] = self._trim()
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
            others = [*self.agents.probes.values(), *self.executor.in_flight()]
            if server is not None:
                server.close()
            stuck = await cancel_all([*tasks, stopper, *others], SHUTDOWN_S)
            if stuck:  # never hang on the way out: systemd restarts a unicornd that exits
                log.error("shutdown_stuck", tasks=sorted(t.get_name() for t in stuck), where=stacks(stuck))
                status = status or 1
            if status == 0:  # a clean stop commits what it holds and hands over at once
                with contextlib.suppress(UnicornError):
                    await asyncio.wait_for(self.core.flush(), SHUTDOWN_S)
                    await redis_io.call(("DEL",), self.client.delete(self.keys.daemon_liveness()))
                    await self.lease.release()
        log.info("unicornd_stopped", status=status, actions_run=self.actions_run)
        return status

    async def _trim(self) -> None:
        while True:
            await asyncio.sleep(self.trim_every_s)
            t = time.perf_counter()
            await asyncio.to_thread(trim_malloc)
            self.trims.append(time.perf_counter() - t)

    async def _lead(self) -> bool:
        """Stand by until this unicornd holds the lease (True), or until it is told to stop
        while standing by (False)."""
        acquiring = asyncio.create_task(self.lease.acquire(), name="acquire")
        stopping = asyncio.create_task(self._stop.wait(), name="stop")
        done, _ = await asyncio.wait([acquiring, stopping], return_when=asyncio.FIRST_COMPLETED)
        for t in (acquiring, stopping):
            t.cancel()
        if acquiring in done and not acquiring.cancelled():
            acquiring.result()  # a Redis error ends the standby (systemd restarts it)
            self.store.token = self.lease.token
            self.store.holder = self.lease.holder
            return True
        log.info("unicornd_stopped", status=0, why="stopped while standing by")
        return False

    async def _execute(self) -> None:
        await self.executor.run(lambda: self._drain_only)
        self._stop.set()

    def _drain(self) -> None:
        log.info("draining: finishing the actions in flight, then exiting")
        self._drain_only = True
        self.core.wake.set()

    async def _liveness(self) -> None:
        """Mark this unicornd alive; and notice a Redis server that lost its users (a
        restart, or a Sentinel failover to the replica): Redis keeps users in its config,
        which neither its data files nor replication carry. A disabled marker user that
        unicornd makes tells: when it is gone, the roles and the running jobs' agent users
        are made again."""
        users_matter = bool(
            self.cfg.redis.agent_acl
            or self.cfg.redis.operator_password_file
            or self.cfg.redis.user_password_file
        )
        marker = f"{self.keys.prefix}-unicornd-marker"
        if users_matter:
            await acl.set_user(self.client, marker, ["reset", "off"])
        while True:
            await redis_io.call(
                ("SET", self.keys.daemon_liveness()),
                self.client.set(
                    self.keys.daemon_liveness(),
                    json.dumps({"pid": os.getpid(), "t": time.time()}),
                    px=int(LIVENESS_TTL_S * 1000),
                ),
            )
            if users_matter and marker not in await acl.users(self.client):
                roles = await acl.apply_roles(self.client, self.cfg.redis)
                jobs = await self.agent_users.restore(self.snap)
                await acl.set_user(self.client, marker, ["reset", "off"])
                log.warning("redis_users_lost", roles=roles, agent_users_restored=jobs)
            await asyncio.sleep(LIVENESS_TTL_S / 3)


def _without(snap: Snapshot, outside: set[str]) -> Snapshot:
    """``snap`` without the records of nodes outside the scope (a scope narrowed since they
    were recorded); a node a task still uses keeps its record (and is logged)."""
    used = {n for t in snap.tasks.values() for n in t.nodes}
    gone = sorted(n for n in snap.nodes if n in outside and n not in used)
    kept = sorted(n for n in snap.nodes if n in outside and n in used)
    if kept:
        log.warning("out_of_scope_nodes_in_use", nodes=kept)
    if not gone:
        return snap
    log.info("out_of_scope_nodes_forgotten", nodes=gone)
    return replace(snap, nodes={k: v for k, v in snap.nodes.items() if k not in gone})


async def run_daemon(cfg: Config, *, config_path: str | None = None) -> int:
    from unicorn_core.slurm import make_backend

    slurm = await make_backend(cfg.slurm)
    client = redis_io.connect(cfg.redis, client_name="unicornd")
    try:
        return await Daemon(cfg, slurm, client, config_path=config_path, freeze_gc=True).run()
    finally:
        await client.aclose()
