"""The Slurm adapter: one asynchronous choke point for every Slurm operation.

``await make_backend(cfg)`` returns the backend to use: the CLI backend (works with every
Slurm >= 22.05) unless pyslurm imports *and* was built for the cluster's Slurm version
(see :mod:`unicorn_core.slurm.select` and :mod:`unicorn_core.slurm.pyslurm_backend`).
"""

from __future__ import annotations

from unicorn_core.slurm.backend import ResizeUnsupported, SlurmBackend, StepHandle
from unicorn_core.slurm.cli import CliSlurm
from unicorn_core.slurm.pyslurm_backend import PyslurmBackend
from unicorn_core.slurm.select import make_backend
from unicorn_core.slurm.types import GrowResult, JobInfo, JobLimits, JobState, NodeInfo, NodeState

__all__ = [
    "CliSlurm",
    "GrowResult",
    "JobInfo",
    "JobLimits",
    "JobState",
    "NodeInfo",
    "NodeState",
    "PyslurmBackend",
    "ResizeUnsupported",
    "SlurmBackend",
    "StepHandle",
    "make_backend",
]
