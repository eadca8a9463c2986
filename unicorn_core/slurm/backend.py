"""The Slurm operations unicorn needs, as one interface with interchangeable backends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from unicorn_core.errors import InvalidArgument, UnicornError
from unicorn_core.proc import CommandOutput, terminate_group
from unicorn_core.slurm.types import GrowResult, JobInfo, JobLimits, NodeInfo


class ResizeUnsupported(UnicornError):
    """This job cannot be resized in place (no expansion, or already resized this run).

    Slurm without slurmdbd allows one resize per job run, and Slurm 22.05 refuses to
    change the node count of a requeued job; the caller resubmits the task instead.
    """


class UnknownReservation(InvalidArgument):
    """A Slurm reservation that does not exist (``[slurm] reservation``)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"unknown Slurm reservation {name!r} (scontrol show reservation has none by that name)"
        )
        self.name = name


@dataclass(slots=True)
class StepHandle:
    """A running ``srun`` step. The caller owns it: ``stop()`` ends the whole group."""

    job_id: int
    nodes: tuple[str, ...]
    command: tuple[str, ...]
    process: asyncio.subprocess.Process

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait(self) -> int:
        return await self.process.wait()

    async def stop(self, grace_s: float = 2.0) -> int:
        return await terminate_group(self.process, grace_s)


class SlurmBackend(Protocol):
    """Every Slurm operation the coordinator, CLI and tests perform.

    Node names are validated before any command runs; a name the cluster lacks raises
    :class:`~unicorn_core.errors.UnknownNode` and changes nothing.
    """

    name: str

    async def version(self) -> str: ...

    async def list_nodes(self) -> list[NodeInfo]: ...

    async def get_node(self, name: str) -> NodeInfo: ...

    async def list_partitions(self) -> list[str]: ...

    async def reservation_nodes(self, name: str) -> tuple[str, ...]:
        """The nodes of reservation ``name``; :class:`UnknownReservation` if it does not exist."""
        ...

    async def job_limits(self, job_id: int) -> JobLimits:
        """The most nodes and GPUs Slurm's own policy (partition, QoS, association) lets
        the job hold; None where nothing limits it."""
        ...

    async def drain(self, node: str, reason: str) -> None: ...

    async def drain_nodes(self, nodes: Sequence[str], reason: str) -> None:
        """Drain every node of ``nodes`` with one reason in one call (a rack: one slurmctld
        RPC, not one per node). An unknown node: :class:`UnknownNode` naming it; the known
        ones may be drained all the same (slurmctld updates node by node)."""
        ...

    async def down(self, node: str, reason: str) -> None: ...

    async def down_nodes(self, nodes: Sequence[str], reason: str) -> None:
        """Set every node of ``nodes`` DOWN with one reason in one call (as :meth:`drain_nodes`)."""
        ...

    async def resume(self, node: str) -> None: ...

    async def list_jobs(self) -> list[JobInfo]: ...

    async def get_job(self, job_id: int) -> JobInfo: ...

    async def submit_batch(self, script: str, options: Sequence[str] = ()) -> int: ...

    async def launch_step(
        self,
        job_id: int,
        nodes: Sequence[str],
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        options: Sequence[str] = (),
        capture: bool = True,
    ) -> StepHandle: ...

    async def run_on_nodes(
        self,
        nodes: Sequence[str],
        argv: Sequence[str],
        *,
        timeout_s: float,
        job_id: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandOutput: ...

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None: ...

    async def grow(self, job_id: int, add_nodes: int, *, exclude: Sequence[str] = ()) -> GrowResult: ...

    async def requeue(
        self, job_id: int, nodes: Sequence[str] = (), *, placed: Callable[[], None] | None = None
    ) -> None:
        """Requeue batch job ``job_id`` onto ``nodes`` and return once it runs again (or
        once Slurm will start it on its own). ``placed`` is called, at most once, as soon as
        the job is pending with its nodes set, before the wait for its start: from then on
        nothing of this call changes the allocation (the executor lets other allocation
        changes run meanwhile)."""
        ...

    async def cancel(self, job_id: int, *, signal: str | None = None) -> None: ...
