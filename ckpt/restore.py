"""Restore, nearest first: own shared memory, this node's peer backups, peers, local disk, remote.

Every copy is opened sealed and has *every* checksum verified before it is used, in
every tier, own memory included: a silently corrupt copy is never loaded. A copy that
fails is skipped with a logged reason (``ShardUnavailable.reason``) and recorded in the
:class:`RestoreReport`; the next tier is tried. A peer copy is fetched into this
node's shm first (so a second restart finds it locally), then opened from there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckpt.errors import RestoreFailed, ShardUnavailable
from ckpt.peer import fetch_shard
from ckpt.shard import OpenShard
from ckpt.tier import Tier, TierDir
from unicorn_core.logs import get_logger


@dataclass(frozen=True)
class PeerAddress:
    """An agent's replication endpoint: its node name (for reports) and TCP address."""

    node: str
    host: str
    port: int


@dataclass(frozen=True)
class Attempt:
    """One tier tried: ``reason`` is ``ok`` or a ``ShardUnavailable`` label."""

    tier: Tier
    source: str
    reason: str
    detail: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


@dataclass(frozen=True)
class RestoreReport:
    """Where a shard was restored from and why each nearer tier was skipped."""

    job_id: str
    iteration: int
    rank: int
    tier: Tier | None
    source: str
    attempts: tuple[Attempt, ...]
    elapsed_s: float

    @property
    def skipped(self) -> tuple[Attempt, ...]:
        return tuple(a for a in self.attempts if not a.ok)


class Restorer:
    """Finds a verified copy of one rank's shard, nearest tier first."""

    def __init__(
        self,
        shm: TierDir,
        *,
        backups: Sequence[TierDir] = (),
        peers: Sequence[PeerAddress] = (),
        local: TierDir | None = None,
        remote: TierDir | None = None,
        fetch_timeout_s: float = 300.0,
    ) -> None:
        """``backups``: folders on this node holding other nodes' copies (the agent's ring
        backups), read in place before any peer is asked over the network."""
        self.shm = shm
        self.backups = tuple(backups)
        self.peers = tuple(peers)
        self.local = local
        self.remote = remote
        self.fetch_timeout_s = fetch_timeout_s
        self._log = get_logger("ckpt.restore", job_id=shm.job_id)

    def open(self, iteration: int, rank: int) -> tuple[OpenShard, RestoreReport]:
        """A verified, open copy (close it when done) and the report; ``RestoreFailed`` if none."""
        start = time.perf_counter()
        attempts: list[Attempt] = []

        def attempt(tier: Tier, source: str, fn: Any) -> OpenShard | None:
            t0 = time.perf_counter()
            try:
                shard: OpenShard = fn()
            except ShardUnavailable as exc:
                attempts.append(Attempt(tier, source, exc.reason, exc.detail, time.perf_counter() - t0))
                self._log.warning(
                    "restore tier skipped",
                    tier=str(tier),
                    source=source,
                    iteration=iteration,
                    rank=rank,
                    reason=exc.reason,
                    detail=exc.detail,
                )
                return None
            attempts.append(Attempt(tier, source, "ok", "", time.perf_counter() - t0))
            return shard

        candidates: list[tuple[Tier, str, Any]] = [
            (Tier.SHM, str(self.shm.root), lambda: _open_verified(self.shm, iteration, rank))
        ]
        for backup in self.backups:
            candidates.append(
                (Tier.PEER, f"backup {backup.root}", lambda d=backup: _open_verified(d, iteration, rank))
            )
        for peer in self.peers:
            candidates.append(
                (
                    Tier.PEER,
                    f"{peer.node} ({peer.host}:{peer.port})",
                    lambda p=peer: self._from_peer(p, iteration, rank),
                )
            )
        for tier_dir in (self.local, self.remote):
            if tier_dir is not None:
                candidates.append(
                    (tier_dir.tier, str(tier_dir.root), lambda d=tier_dir: _open_verified(d, iteration, rank))
                )
        for tier, source, fn in candidates:
            shard = attempt(tier, source, fn)
            if shard is not None:
                report = RestoreReport(
                    self.shm.job_id,
                    iteration,
                    rank,
                    tier,
                    source,
                    tuple(attempts),
                    time.perf_counter() - start,
                )
                self._log.info(
                    "shard restored",
                    tier=str(tier),
                    source=source,
                    iteration=iteration,
                    rank=rank,
                    skipped=[f"{a.tier}: {a.reason}" for a in report.skipped],
                )
                return shard, report
        report = RestoreReport(
            self.shm.job_id, iteration, rank, None, "", tuple(attempts), time.perf_counter() - start
        )
        reasons = "; ".join(f"{a.tier} {a.source}: {a.reason} ({a.detail})" for a in attempts)
        raise RestoreFailed(f"no usable copy of rank {rank} iteration {iteration}: {reasons}", report)

    def restore(self, iteration: int, rank: int) -> tuple[dict[Any, Any], RestoreReport]:
        """The rank's state as snapshot (owned tensors, the copy closed) and the report."""
        shard, report = self.open(iteration, rank)
        with shard:
            return shard.state_dict(copy=True, verify=False), report

    def _from_peer(self, peer: PeerAddress, iteration: int, rank: int) -> OpenShard:
        asyncio.run(
            fetch_shard(
                peer.host,
                peer.port,
                self.shm.job_id,
                iteration,
                rank,
                target=self.shm,
                timeout_s=self.fetch_timeout_s,
            )
        )
        return _open_verified(self.shm, iteration, rank)


def _open_verified(tier: TierDir, iteration: int, rank: int) -> OpenShard:
    shard = OpenShard(tier.shard(iteration, rank))
    try:
        shard.verify()
    except BaseException:
        shard.close()
        raise
    return shard
