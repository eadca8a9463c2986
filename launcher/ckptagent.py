"""The node agent's half of the checkpoint engine: seal, persist and replicate snapshots.

Ranks copy their state into shared memory and go on (:mod:`launcher.trainer.snapshots`);
everything after the copy is done here, in the agent, so it survives a rank's crash:
a rank killed the instant its snapshot returned still gets that snapshot sealed,
written to local disk (and the remote folder) and sent to the next nodes of the task.

Per shard the agent finds in ``<shm_dir>/snap/<job>/it-*/`` (it polls: the rank need
not be alive to be served), in order, each step off the event loop where it blocks:

1. seal it (checksums and done marker, :func:`ckpt.shard.seal_shard`);
2. persist it to every persistence tier (:class:`ckpt.persist.Persister`: commit
   protocol, publish once every rank is there, retention), unless that tier already
   holds this exact copy (an agent restarted mid-job does not redo its work);
3. push it to the next ``peer_factor`` nodes of the ring (:func:`ckpt.peer.push_shard`,
   paced by a token bucket), whose agents keep it in ``<shm_dir>/peer``.

Peers: the ring is the task's node list (:data:`ENV_RING`, set by unicornd; else the
job's, ``$SLURM_NODELIST``, Slurm's order), and
the agent of node ``i`` of job ``J`` listens on ``peer_port_base + (97*J + i) % 1000``,
so every agent and rank computes every endpoint without asking anyone. The engine is
imported in a worker thread when :meth:`CkptAgent.run` starts, and imports no torch: it
seals, persists and copies bytes (:func:`ckpt.format.is_tensor`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import importlib
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from unicorn_core.aio import cancel_all, stacks
from unicorn_core.config import CkptConfig, DetectConfig
from unicorn_core.errors import InvalidArgument
from unicorn_core.logs import configure_logging, get_logger
from unicorn_core.paths import CKPT_RING_ENV
from unicorn_core.slurm.hostlist import expand

if TYPE_CHECKING:
    from ckpt.format import ShardMeta
    from ckpt.peer import PeerServer, TokenBucket
    from ckpt.persist import Persister
    from ckpt.tier import TierDir

PORT_SPAN: Final = 1000
_JOB_STRIDE: Final = 97
DEFAULT_LOSS_STOP_WINDOW: Final = DetectConfig().loss_stop_window
SNAP_SUBDIR: Final = "snap"
PEER_SUBDIR: Final = "peer"
_SCAN_INTERVAL_S: Final = 0.1
_PUSH_TIMEOUT_S: Final = 300.0

# Environment the agent gives the training processes (see ``CkptPlan.rank_env``).
ENV_SNAP_DIR: Final = "UNICORN_CKPT_SNAP_DIR"
ENV_BACKUP_DIR: Final = "UNICORN_CKPT_BACKUP_DIR"
ENV_LOCAL_DIR: Final = "UNICORN_CKPT_LOCAL_DIR"
ENV_REMOTE_DIR: Final = "UNICORN_CKPT_REMOTE_DIR"
ENV_JOB: Final = "UNICORN_CKPT_JOB"
ENV_EVERY: Final = "UNICORN_CKPT_EVERY"
ENV_PEERS: Final = "UNICORN_CKPT_PEERS"
ENV_SLOTS: Final = "UNICORN_CKPT_SLOTS"
ENV_RING: Final = CKPT_RING_ENV

log = get_logger(__name__)

ShardKey = tuple[Path, int, int]
"""A shard copy in shm: its metadata file's (path, inode, mtime_ns); a rewrite changes it."""


@dataclass(frozen=True)
class PeerEndpoint:
    """Where the agent of ``node`` serves and receives shard copies."""

    node: str
    host: str
    port: int

    def spec(self) -> str:
        """``node=host:port``, the form ``--snapshot-peers`` parses."""
        return f"{self.node}={self.host}:{self.port}"


def peer_port(base: int, job_id: int, index: int) -> int:
    """The replication port of node ``index`` (in the job's node list) of job ``job_id``."""
    return base + (_JOB_STRIDE * job_id + index) % PORT_SPAN


@dataclass(frozen=True)
class CkptPlan:
    """Where one job's checkpoint tiers are on this node, and who its peers are.

    ``ring``: every node of the job in ring order, this one included. ``successors``
    receive this node's copies; restoring ranks ask ``others`` (every other node, nearest
    in the ring first) because any of them may hold a shard (a backup or a DP replica).
    """

    job: str
    node: str
    snap_root: Path
    backup_root: Path
    local_root: Path | None
    remote_root: Path | None
    ring: tuple[PeerEndpoint, ...]
    factor: int
    rate_bytes_s: float
    keep_versions: int
    every: int
    bind_host: str
    memory_versions: int = 2
    """Versions kept in the memory tier: each rank's snapshot slots and the peer backups
    (:meth:`unicorn_core.config.CkptConfig.memory_keep`)."""

    def __post_init__(self) -> None:
        names = [p.node for p in self.ring]
        if self.node not in names or len(set(names)) != len(names):
            raise InvalidArgument(f"ring {names} must name node {self.node!r} once, and every node once")

    @property
    def me(self) -> PeerEndpoint:
        return next(p for p in self.ring if p.node == self.node)

    @property
    def others(self) -> tuple[PeerEndpoint, ...]:
        i = self.ring.index(self.me)
        return self.ring[i + 1 :] + self.ring[:i]

    @property
    def successors(self) -> tuple[PeerEndpoint, ...]:
        return self.others[: min(self.factor, len(self.others))]

    @classmethod
    def from_config(
        cls,
        cfg: CkptConfig,
        *,
        job_id: int,
        node: str,
        env: Mapping[str, str],
        scope: str = "",
        loss_stop_window: int = DEFAULT_LOSS_STOP_WINDOW,
    ) -> CkptPlan | None:
        """The plan for ``job_id`` on ``node``; None when the memory tier is off (``shm_dir`` empty).

        ``scope`` (the installation's Redis key prefix) goes into the tiers' job folder name
        (``<scope>.<job>``): Slurm job ids repeat across clusters and after a controller
        reset, and a rank must never restore another installation's job 2.

        The ring is :data:`ENV_RING` (the task's nodes, from unicornd), else the job's node
        list in Slurm's order: ``$SLURM_NODELIST``, then ``$SLURM_JOB_NODELIST`` (a step that
        srun starts from outside the allocation, as unicornd starts agents, has its own
        nodes in ``SLURM_JOB_NODELIST``: measured on Slurm 22.05, one node, so nothing was
        replicated). Just this node without one, or when it does not name this node: then
        nothing is replicated. ``{node}`` in
        ``shm_dir`` or ``local_dir`` stands for the node's name: nodes that share one
        machine (the dev cluster) keep their memory and disk tiers apart, as real nodes do.
        ``loss_stop_window``: iterations from a loss spike to its ranks stopping
        (``detect.loss_stop_window``), from which the
        memory tier's versions derive (:meth:`CkptConfig.memory_keep`).
        """
        if not cfg.shm_dir:
            return None
        listed = env.get(ENV_RING) or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        nodes = [n for n in listed.split(",") if n] if env.get(ENV_RING) else expand(listed)
        nodes = nodes or [node]
        if node not in nodes:
            log.warning("ckpt_ring_without_this_node", node=node, nodes=nodes)
            nodes = [node]
        ring = tuple(
            PeerEndpoint(name, cfg.peer_host or name, peer_port(cfg.peer_port_base, job_id, i))
            for i, name in enumerate(nodes)
        )
        shm = Path(cfg.shm_dir.replace("{node}", node))
        memory_versions = cfg.memory_keep(loss_stop_window)
        return cls(
            job=f"{scope}.{job_id}" if scope else str(job_id),
            node=node,
            snap_root=shm / SNAP_SUBDIR,
            backup_root=shm / PEER_SUBDIR,
            local_root=Path(cfg.local_dir.replace("{node}", node)) if cfg.local_dir else None,
            remote_root=Path(cfg.remote_dir) if cfg.remote_dir else None,
            ring=ring,
            factor=cfg.peer_factor,
            rate_bytes_s=cfg.peer_rate_mib_s * (1 << 20),
            keep_versions=cfg.keep_versions,
            every=cfg.snapshot_every,
            bind_host=cfg.peer_host or "0.0.0.0",  # noqa: S104 - peers on other nodes connect
            memory_versions=memory_versions,
        )

    def rank_env(self) -> dict[str, str]:
        """Variables for the training processes (``unicorn-train`` reads them as option defaults)."""
        env = {
            ENV_SNAP_DIR: str(self.snap_root),
            ENV_BACKUP_DIR: str(self.backup_root),
            ENV_JOB: self.job,
            ENV_EVERY: str(self.every),
            ENV_SLOTS: str(self.memory_versions),
            ENV_PEERS: ",".join(p.spec() for p in self.others),
        }
        if self.local_root is not None:
            env[ENV_LOCAL_DIR] = str(self.local_root)
        if self.remote_root is not None:
            env[ENV_REMOTE_DIR] = str(self.remote_root)
        return env


class ShardStage(enum.StrEnum):
    """What the agent has done with one shard copy it found in shm.

    ``found`` -> ``sealed`` -> ``persisted`` -> ``replicated``; any step may end in
    ``failed`` (reason logged; a later snapshot supersedes it) and ``found``/``sealed``
    in ``gone`` (the rank reused the slot before the agent got to it).
    """

    FOUND = "found"
    SEALED = "sealed"
    PERSISTED = "persisted"
    REPLICATED = "replicated"
    FAILED = "failed"
    GONE = "gone"


TRANSITIONS: Final[Mapping[ShardStage, frozenset[ShardStage]]] = {
    ShardStage.FOUND: frozenset({ShardStage.SEALED, ShardStage.FAILED, ShardStage.GONE}),
    ShardStage.SEALED: frozenset({ShardStage.PERSISTED, ShardStage.FAILED, ShardStage.GONE}),
    ShardStage.PERSISTED: frozenset({ShardStage.REPLICATED, ShardStage.FAILED}),
    ShardStage.REPLICATED: frozenset(),
    ShardStage.FAILED: frozenset(),
    ShardStage.GONE: frozenset(),
}


@dataclass
class ShardWork:
    """One shard copy the agent is handling (identified by its metadata file's inode and mtime)."""

    iteration: int
    rank: int
    stage: ShardStage = ShardStage.FOUND
    detail: str = ""
    history: list[ShardStage] = field(default_factory=lambda: [ShardStage.FOUND])

    def move(self, stage: ShardStage, detail: str = "") -> None:
        if stage not in TRANSITIONS[self.stage]:
            raise InvalidArgument(f"shard stage {self.stage} -> {stage} is not allowed")
        self.stage, self.detail = stage, detail
        self.history.append(stage)


@dataclass
class CkptCounters:
    sealed: int = 0
    persisted: int = 0
    replicated: int = 0
    failed: int = 0
    gone: int = 0


class CkptAgent:
    """Serves one job's checkpoint tiers on one node; :meth:`run` until cancelled."""

    def __init__(self, plan: CkptPlan, *, scan_interval_s: float = _SCAN_INTERVAL_S) -> None:
        if scan_interval_s <= 0:
            raise InvalidArgument(f"scan_interval_s must be > 0, got {scan_interval_s}")
        self.plan = plan
        self.scan_interval_s = scan_interval_s
        self.counters = CkptCounters()
        self.handled: dict[ShardKey, ShardWork] = {}
        self.ready = asyncio.Event()
        self.endpoint: tuple[str, int] | None = None
        self._server: PeerServer | None = None
        self._snap: TierDir | None = None
        self._backup: TierDir | None = None
        self._persister: Persister | None = None
        self._bucket: TokenBucket | None = None
        self._log = get_logger("launcher.ckptagent", job=plan.job, node=plan.node)

    async def run(self) -> None:
        """Import the engine (in a thread), listen for peers, then scan shm forever."""
        await asyncio.to_thread(_import_engine)
        await self.start()
        try:
            while True:
                try:
                    await self.scan_once()
                except OSError as exc:  # the shm tier changed under the scan: the next one sees it
                    self._log.warning("ckpt_scan_failed", error=repr(exc))
                await asyncio.sleep(self.scan_interval_s)
        except Exception:  # a bug, not a shard's failure: say so before the agent's task dies
            self._log.exception("ckpt_agent_crashed")
            raise
        finally:
            await self.close()

    async def start(self) -> None:
        """Open the tiers and the replication server (``run`` does this first)."""
        from ckpt.peer import PeerServer, TokenBucket
        from ckpt.persist import Persister
        from ckpt.tier import Retention, Tier, TierDir

        plan = self.plan
        self._snap = TierDir(plan.snap_root, plan.job, Tier.SHM)
        self._backup = TierDir(plan.backup_root, plan.job, Tier.PEER)
        targets = [
            (TierDir(root, plan.job, tier), Retention(plan.keep_versions))
            for root, tier in ((plan.local_root, Tier.LOCAL), (plan.remote_root, Tier.REMOTE))
            if root is not None
        ]
        self._persister = Persister(self._snap, targets)
        self._bucket = TokenBucket(plan.rate_bytes_s, max(1, min(1 << 20, int(plan.rate_bytes_s))))
        if len(plan.ring) > 1:
            self._server = PeerServer(self._backup, [self._backup, self._snap])
            try:
                self.endpoint = await self._server.start(plan.bind_host, plan.me.port)
            except OSError as exc:  # the port is taken: restores fall back to other tiers
                self._log.error("ckpt_peer_server_failed", port=plan.me.port, error=str(exc))
                self._server = None
        self._log.info(
            "ckpt_agent_started",
            snap=str(plan.snap_root),
            endpoint=self.endpoint,
            successors=[p.node for p in plan.successors],
            tiers=[str(t.tier) for t, _ in targets],
        )
        self.ready.set()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None

    async def scan_once(self) -> list[ShardWork]:
        """Handle every shard copy not seen before, oldest iteration first; returns them."""
        from ckpt.tier import Retention

        assert self._snap is not None and self._backup is not None
        found = await asyncio.to_thread(_new_shards, self._snap, set(self.handled))
        done = []
        for key, iteration, rank in found:
            work = self.handled[key] = ShardWork(iteration, rank)
            await self._handle(work)
            done.append(work)
        current = await asyncio.to_thread(lambda: {key for key in self.handled if _meta_key(key[0]) == key})
        self.handled = {key: work for key, work in self.handled.items() if key in current}
        keep = max(self.plan.keep_versions, self.plan.memory_versions)
        await asyncio.to_thread(self._backup.apply_retention, Retention(keep))
        return done

    async def _handle(self, work: ShardWork) -> None:
        from ckpt.errors import ShardUnavailable
        from ckpt.shard import seal_shard

        assert self._snap is not None and self._persister is not None
        paths = self._snap.shard(work.iteration, work.rank)
        try:
            meta = await asyncio.to_thread(seal_shard, paths)
            sealed_key = _meta_key(paths.meta)  # sealing rewrote the metadata file: same copy
            if sealed_key is not None:
                self.handled[sealed_key] = work
            work.move(ShardStage.SEALED)
            self.counters.sealed += 1
            if not await asyncio.to_thread(self._persisted_already, meta):
                await asyncio.to_thread(self._persister.persist, work.iteration, work.rank)
            work.move(ShardStage.PERSISTED)
            self.counters.persisted += 1
        except ShardUnavailable as exc:
            stage = ShardStage.GONE if exc.reason in ("missing", "busy") else ShardStage.FAILED
            self._finish(work, stage, str(exc))
            return
        except OSError as exc:  # a full or failing disk: say so, the next snapshot retries
            self._finish(work, ShardStage.FAILED, f"persist: {exc}")
            return
        failures = await self._replicate(work)
        if failures:
            self._finish(work, ShardStage.FAILED, "; ".join(failures))
        else:
            work.move(ShardStage.REPLICATED)
            self.counters.replicated += 1 if self.plan.successors else 0
            self._log.info(
                "ckpt_shard_done",
                iteration=work.iteration,
                rank=work.rank,
                peers=[p.node for p in self.plan.successors],
            )

    def _finish(self, work: ShardWork, stage: ShardStage, detail: str) -> None:
        work.move(stage, detail)
        if stage is ShardStage.GONE:
            self.counters.gone += 1
            self._log.info("ckpt_shard_gone", iteration=work.iteration, rank=work.rank, detail=detail)
        else:
            self.counters.failed += 1
            self._log.warning("ckpt_shard_failed", iteration=work.iteration, rank=work.rank, detail=detail)

    def _persisted_already(self, meta: ShardMeta) -> bool:
        """Whether every persistence tier holds this exact copy (same digest) with its done marker."""
        import msgspec

        from ckpt.format import DoneMarker

        assert self._persister is not None
        digest = meta.shard_digest()
        for target, _ in self._persister.targets:
            try:
                done = msgspec.json.decode(
                    target.shard(meta.iteration, meta.rank).done.read_bytes(), type=DoneMarker
                )
            except (OSError, msgspec.MsgspecError):
                return False
            if done.digest != digest:
                return False
        return True

    async def _replicate(self, work: ShardWork) -> list[str]:
        """Push the sealed copy to each successor; the reasons of those that failed."""
        from ckpt.errors import ShardUnavailable
        from ckpt.peer import push_shard
        from ckpt.shard import OpenShard

        assert self._snap is not None
        failures = []
        for peer in self.plan.successors:
            try:
                shard = await asyncio.to_thread(OpenShard, self._snap.shard(work.iteration, work.rank))
                with shard:
                    await push_shard(
                        peer.host, peer.port, shard, bucket=self._bucket, timeout_s=_PUSH_TIMEOUT_S
                    )
            except ShardUnavailable as exc:
                failures.append(f"{peer.node}: {exc}")
        return failures


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.ckptagent``: the node agent's checkpoint child process."""
    parser = argparse.ArgumentParser(prog="launcher.ckptagent", description=main.__doc__)
    parser.add_argument("--ckpt-config", required=True, help="the [ckpt] section as a JSON object")
    parser.add_argument("--job-id", type=int, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--scope", default="", help="the installation's Redis key prefix")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this parent is gone")
    args = parser.parse_args(argv)
    configure_logging("info", "json", stream=sys.stderr)
    try:
        cfg = CkptConfig(**json.loads(args.ckpt_config))
    except (ValueError, TypeError) as e:
        parser.error(f"--ckpt-config: {e}")
    plan = CkptPlan.from_config(cfg, job_id=args.job_id, node=args.node, env=os.environ, scope=args.scope)
    if plan is None:
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        parent = os.getppid() if args.parent_pid is None else args.parent_pid
        asyncio.run(_run_while_parent_lives(CkptAgent(plan), parent))
    return 0


async def _run_while_parent_lives(agent: CkptAgent, parent: int) -> None:
    """Run ``agent`` until the node agent that started us is gone (a kill -9 of the node
    agent orphans this process; it must not outlive it)."""
    task = asyncio.create_task(agent.run(), name="ckpt-agent")
    while not task.done():
        if os.getppid() != parent:
            # re-cancelled until it ends, bounded: a lost cancellation must not keep this
            # process alive (the node agent's own stop, session 30)
            if await cancel_all({task}, _END_S):
                # asyncio.run would cancel it again and wait without bound (and for a worker
                # thread stuck in I/O): end the process here
                log.error("ckpt_agent_did_not_end", where=stacks({task}))
                sys.stderr.flush()
                os._exit(1)
            break
        await asyncio.wait({task}, timeout=1.0)
    with contextlib.suppress(asyncio.CancelledError):
        await task


_END_S: Final = 10.0
"""How long an orphaned checkpoint agent waits for its work to end after cancelling it."""


def _import_engine() -> None:
    """Import the engine (numpy, xxhash; no torch): run in a thread, off the agent's loop."""
    for name in ("ckpt.peer", "ckpt.persist", "ckpt.shard", "ckpt.tier"):
        importlib.import_module(name)


def _new_shards(snap: TierDir, seen: set[ShardKey]) -> list[tuple[ShardKey, int, int]]:
    """Shard metadata files under ``snap`` not in ``seen``: (key, iteration, rank), oldest first.

    The key is (path, inode, mtime): a slot reused for another snapshot gets a new
    metadata file (written by rename), hence a new key.
    """
    found = []
    for iteration in snap.iterations():
        for meta_path in snap.metas(iteration):
            stem = meta_path.stem.removeprefix("shard-")
            key = _meta_key(meta_path)
            if stem.isdigit() and key is not None and key not in seen:
                found.append((key, iteration, int(stem)))
    return found


def _meta_key(meta_path: Path) -> ShardKey | None:
    try:
        st = meta_path.stat()
    except FileNotFoundError:
        return None
    return (meta_path, st.st_ino, st.st_mtime_ns)


__all__: Sequence[str] = ("CkptAgent", "CkptPlan", "PeerEndpoint", "ShardStage", "peer_port")


if __name__ == "__main__":
    sys.exit(main())
