"""Which Slurm nodes unicorn manages (``[slurm] partitions``, ``node_feature``, ``reservation``).

A site shares its cluster: unicorn may own some partitions, the nodes with one feature,
or one reservation. :class:`Scope` says of one node whether it is in (pure);
:func:`resolve_scope` builds it from the configuration and checks it against the
cluster (an unknown partition or reservation raises :class:`ScopeError`, so a bad scope
stops unicornd at start instead of silently managing nothing). :func:`jobs_by_node` says
which jobs hold each node, so unicornd can tell the nodes other users' jobs run on.

unicornd filters nodes in one place, where they enter its snapshot
(:func:`unicornd.inputs.observe`); everything downstream (planner, executor, probes,
unicornctl's drain and resume) only ever sees the nodes in scope.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from unicorn_core.config import SlurmConfig
from unicorn_core.errors import ConfigError
from unicorn_core.slurm.backend import SlurmBackend, UnknownReservation
from unicorn_core.slurm.types import JobInfo, JobState, NodeInfo

HELPER_JOB_PREFIX = "unicorn-expand-"
"""Name prefix of the short-lived helper allocation a grow creates (:meth:`CliSlurm.grow`):
unicorn's own, never another user's job."""


class ScopeError(ConfigError):
    """``[slurm]`` names a partition or reservation the cluster does not have."""


@dataclass(frozen=True)
class Scope:
    """The nodes unicorn manages. Empty (the default): every node.

    ``reserved``: the nodes of ``reservation`` as Slurm listed them (None: no reservation);
    ``reserved_s``: when (``time.monotonic()``) they were read (None: not by a poll yet;
    :func:`unicornd.inputs.observe` reads them again every ``RESERVATION_REFRESH_S``).
    """

    partitions: tuple[str, ...] = ()
    feature: str = ""
    reservation: str = ""
    reserved: frozenset[str] | None = None
    reserved_s: float | None = None

    @property
    def everything(self) -> bool:
        return not (self.partitions or self.feature or self.reservation)

    def why_outside(self, node: NodeInfo) -> str | None:
        """Why ``node`` is outside the scope (naming the config key), or None when it is in."""
        if self.partitions and not set(node.partitions) & set(self.partitions):
            where = ",".join(node.partitions) or "no partition"
            return f"node {node.name} is in {where}, not in [slurm] partitions = {list(self.partitions)}"
        if self.feature and self.feature not in node.features:
            return f"node {node.name} lacks the feature [slurm] node_feature = {self.feature!r}"
        if self.reservation and node.name not in (self.reserved or frozenset()):
            return f"node {node.name} is not in the reservation [slurm] reservation = {self.reservation!r}"
        return None

    def admits(self, node: NodeInfo) -> bool:
        return self.why_outside(node) is None

    def split(self, nodes: Iterable[NodeInfo]) -> tuple[list[NodeInfo], list[NodeInfo]]:
        """(nodes in scope, nodes outside), each in the given order."""
        inside: list[NodeInfo] = []
        outside: list[NodeInfo] = []
        for n in nodes:
            (inside if self.admits(n) else outside).append(n)
        return inside, outside

    def describe(self) -> str:
        if self.everything:
            return "every node"
        parts = []
        if self.partitions:
            parts.append(f"partitions {','.join(self.partitions)}")
        if self.feature:
            parts.append(f"feature {self.feature}")
        if self.reservation:
            parts.append(f"reservation {self.reservation}")
        return " and ".join(parts)


async def resolve_scope(slurm: SlurmBackend, cfg: SlurmConfig) -> Scope:
    """The configured scope, checked against the cluster.

    Raises :class:`ScopeError` for a partition or reservation Slurm does not have (and the
    adapter's own errors when Slurm cannot be asked). Makes no Slurm call when no scope
    key is set.
    """
    if not cfg.scoped:
        return Scope()
    if cfg.partitions:
        known = await slurm.list_partitions()
        missing = [p for p in cfg.partitions if p not in known]
        if missing:
            raise ScopeError(
                f"[slurm] partitions names {missing}, which Slurm does not have; "
                f"its partitions: {', '.join(known) or 'none'}"
            )
    reserved: frozenset[str] | None = None
    if cfg.reservation:
        try:
            reserved = frozenset(await slurm.reservation_nodes(cfg.reservation))
        except UnknownReservation as e:
            raise ScopeError(f"[slurm] reservation: {e}") from None
    return Scope(cfg.partitions, cfg.node_feature, cfg.reservation, reserved)


def holds_nodes(job: JobInfo) -> bool:
    """The job has nodes allocated now (running, suspended, completing, resizing...)."""
    return bool(job.nodes) and job.state is not JobState.PENDING and not job.state.finished


def jobs_by_node(jobs: Sequence[JobInfo]) -> Mapping[str, tuple[int, ...]]:
    """Node -> the ids of the jobs that hold it now, ascending; unicorn's own grow helper
    allocations (:data:`HELPER_JOB_PREFIX`) are left out. Nodes no job holds are absent."""
    out: dict[str, set[int]] = {}
    for job in jobs:
        if not holds_nodes(job) or job.name.startswith(HELPER_JOB_PREFIX):
            continue
        for node in job.nodes:
            out.setdefault(node, set()).add(job.job_id)
    return {node: tuple(sorted(ids)) for node, ids in out.items()}
