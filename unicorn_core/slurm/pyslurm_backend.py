"""The pyslurm backend: reads nodes and jobs through libslurm, changes nothing through it.

Optional: it is used only when ``pyslurm`` imports and was built for the cluster's Slurm
(see :func:`unicorn_core.slurm.select.make_backend`). The API used is pyslurm's >= 23
object API (``pyslurm/core/node.pyx``, ``pyslurm/core/job/job.pyx``):

* ``pyslurm.Nodes.load()`` (every node, partitions filled in) and ``pyslurm.Node.load(name)``;
  a node has ``name``, ``state`` (base state and flags as Slurm's complete state string,
  e.g. ``"IDLE+DRAIN"``), ``reason``, ``total_cpus``, ``effective_cpus``, ``allocated_cpus``,
  ``configured_gres`` / ``allocated_gres`` (dicts such as ``{"gpu:a100": 8}``, or
  ``{"gpu": {"count": "2", "indexes": "0-1"}}`` for allocations), ``real_memory`` (MiB) and
  ``partitions``. ``next_state`` only says what a rebooting node becomes; NodeInfo has no
  place for it, like the CLI backend.
* ``pyslurm.Jobs.load()`` and ``pyslurm.Job.load(job_id)``; a job has ``id``, ``name``,
  ``state``, ``state_reason``, ``allocated_nodes`` (a hostlist, None while pending),
  ``num_nodes``, ``is_batch_job``, ``requeue_count`` and ``user_name``.
* Failures raise ``pyslurm.RPCError`` (``errno``, ``msg``); others may raise what they like.

Records are converted by the same parsers as ``sinfo --json`` / ``squeue --json`` output, so
both backends give equal :class:`NodeInfo` / :class:`JobInfo` for the same cluster state.

Every mutating operation (drain, down, resume, submit, shrink, grow, requeue, cancel) and
step launching (``srun``) is inherited unchanged from :class:`CliSlurm`: the commands stay
the single choke point for side effects, with their argument checks, environment
scrubbing and error mapping.

pyslurm calls block in C, so each runs in a worker thread under ``asyncio.wait_for``. A
call that times out is reported as :class:`~unicorn_core.errors.CommandTimeout`; its
thread cannot be killed and ends when libslurm gives up (its own MessageTimeout).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from unicorn_core.errors import CommandFailed, CommandTimeout, UnicornError, UnknownJob, UnknownNode
from unicorn_core.slurm.cli import CliSlurm
from unicorn_core.slurm.parse import SlurmParseError, job_from_squeue_json, node_from_sinfo_json
from unicorn_core.slurm.types import JobInfo, NodeInfo, check_job_id, check_node_name

T = TypeVar("T")

ESLURM_INVALID_JOB_ID = 2017  # slurm/slurm_errno.h


def import_pyslurm() -> ModuleType:
    """``import pyslurm``; any failure while loading it is reported as ``ImportError``.

    A pyslurm built against another libslurm can fail in its own initialisation (a
    missing symbol, ``slurm_init``), not only with ``ModuleNotFoundError``.
    """
    try:
        return importlib.import_module("pyslurm")
    except ImportError:
        raise
    except Exception as e:
        raise ImportError(f"pyslurm failed to load: {type(e).__name__}: {e}") from e


def pyslurm_version(module: ModuleType) -> str | None:
    """pyslurm's own version (``__version__``, else ``version()``), e.g. ``"25.11.0"``.

    Its first two numbers are the Slurm release it was built for (``pyslurm/version.py``:
    "SLURM_MAJOR.PYSLURM_PATCH"), written either ``24.05.0`` or ``25.5.0``.
    """
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        func = getattr(module, "version", None)
        version = func() if callable(func) else None
    return version if isinstance(version, str) and version.strip() else None


def gres_string(gres: Any) -> str:
    """pyslurm's GRES dict as a Slurm GRES string (``{"gpu:a100": 8}`` -> ``gpu:a100:8``).

    Allocated GRES with indexes come as ``{"gpu": {"count": "2", "indexes": "0-1"}}``.
    A string (older bindings) is returned as is.
    """
    if gres is None:
        return ""
    if isinstance(gres, str):
        return gres
    if not isinstance(gres, Mapping):
        raise SlurmParseError(f"pyslurm GRES of unexpected type: {gres!r}")
    parts = []
    for key, value in gres.items():
        count = value.get("count") if isinstance(value, Mapping) else value
        parts.append(f"{key}:{count}")
    return ",".join(parts)


def _node_state(node: Any) -> object:
    """Slurm's complete state string, with ALLOCATED made MIXED as sinfo and scontrol do.

    Older pyslurm report the controller's raw state, where a partly used node is
    ALLOCATED; the commands (and newer pyslurm) show it as MIXED.
    """
    state = node.state
    if not isinstance(state, str):
        return state  # not a string: the parser reports it
    alloc = getattr(node, "allocated_cpus", None)
    usable = getattr(node, "effective_cpus", None) or getattr(node, "total_cpus", None)
    base, sep, flags = state.partition("+")
    if (
        base.upper() == "ALLOCATED"
        and isinstance(alloc, int)
        and isinstance(usable, int)
        and 0 < alloc < usable
    ):
        return "MIXED" + sep + flags
    return state


def _feature_list(raw: Any) -> str | list[str]:
    """pyslurm's active features (a list, or a comma-separated string in older bindings)."""
    if raw is None or isinstance(raw, str):
        return raw or ""
    return [str(f) for f in raw]


def node_from_pyslurm(node: Any) -> NodeInfo:
    """A ``pyslurm.Node`` as :class:`NodeInfo`, through the ``sinfo --json`` parser."""
    return node_from_sinfo_json(
        {
            "name": node.name,
            "state": _node_state(node),
            "reason": node.reason or "",
            "cpus": node.total_cpus,
            "gres": gres_string(node.configured_gres),
            "gres_used": gres_string(node.allocated_gres),
            "real_memory": node.real_memory,
            "partitions": list(node.partitions or ()),
            "active_features": _feature_list(getattr(node, "active_features", None)),
        }
    )


def job_from_pyslurm(job: Any) -> JobInfo:
    """A ``pyslurm.Job`` as :class:`JobInfo`, through the ``squeue --json`` parser."""
    return job_from_squeue_json(
        {
            "job_id": job.id,
            "name": job.name or "",
            "job_state": job.state,
            "state_reason": job.state_reason or "",
            "nodes": job.allocated_nodes or "",
            "node_count": job.num_nodes,
            "batch_flag": job.is_batch_job,
            "restart_cnt": job.requeue_count,
            "user_name": job.user_name or "",
            "batch_host": getattr(job, "batch_host", None) or "",
        }
    )


def _records(collection: Any) -> list[Any]:
    """The records of a pyslurm collection: a dict, a list or a MultiClusterMap (all clusters)."""
    values = getattr(collection, "values", None)
    return list(values() if callable(values) else collection)


class PyslurmBackend(CliSlurm):
    """:class:`~unicorn_core.slurm.backend.SlurmBackend` reading through pyslurm.

    Reads (``list_nodes``, ``get_node``, ``list_jobs``, ``get_job``) call libslurm in a
    worker thread; everything with a side effect runs the Slurm commands of
    :class:`CliSlurm`, which stay the one choke point for changes. ``module`` is the
    imported pyslurm (imported here when not given).

    libslurm reads ``slurm.conf`` from the process's ``SLURM_CONF`` when pyslurm is
    imported; ``slurm_conf`` only reaches the commands, so the selector refuses pyslurm
    when the two differ.
    """

    name = "pyslurm"

    def __init__(
        self,
        *,
        timeout_s: float = 30.0,
        bin_dir: str | Path | None = None,
        slurm_conf: str | None = None,
        env: Mapping[str, str] | None = None,
        module: ModuleType | None = None,
    ) -> None:
        super().__init__(timeout_s=timeout_s, bin_dir=bin_dir, slurm_conf=slurm_conf, env=env)
        self.pyslurm = module if module is not None else import_pyslurm()

    async def _call(self, what: str, func: Callable[[], T]) -> T:
        """Run ``func`` (pyslurm calls and conversion) in a thread, bounded by ``timeout_s``.

        pyslurm's exceptions become :class:`CommandFailed` naming ``("pyslurm", what)``,
        with Slurm's errno as ``exit_code`` and its message as ``stderr``.
        """
        command = ("pyslurm", what)
        try:
            return await asyncio.wait_for(asyncio.to_thread(func), self.timeout_s)
        except TimeoutError:
            raise CommandTimeout(command, self.timeout_s) from None
        except UnicornError:
            raise
        except Exception as e:
            errno = getattr(e, "errno", None)
            code = errno if isinstance(errno, int) and not isinstance(errno, bool) else None
            label = type(e).__name__ + (f" (slurm errno {code})" if code is not None else "")
            raise CommandFailed(command, code, stderr=str(e) or label, message=label) from e

    # ------------------------------------------------------------------ nodes

    async def list_nodes(self) -> list[NodeInfo]:
        ps = self.pyslurm
        return await self._call(
            "Nodes.load", lambda: [node_from_pyslurm(n) for n in _records(ps.Nodes.load())]
        )

    async def get_node(self, name: str) -> NodeInfo:
        check_node_name(name)
        ps = self.pyslurm
        try:
            node = await self._call("Node.load", lambda: node_from_pyslurm(ps.Node.load(name)))
        except CommandFailed as e:
            known = [n.name for n in await self.list_nodes()]
            if name not in known:
                raise UnknownNode(name, known) from e
            raise
        if node.name != name:  # some pyslurm versions answer an unknown name with another node
            raise UnknownNode(name, [n.name for n in await self.list_nodes()])
        return node

    # ------------------------------------------------------------------ jobs

    async def list_jobs(self) -> list[JobInfo]:
        ps = self.pyslurm
        return await self._call("Jobs.load", lambda: [job_from_pyslurm(j) for j in _records(ps.Jobs.load())])

    async def get_job(self, job_id: int) -> JobInfo:
        check_job_id(job_id)
        ps = self.pyslurm
        try:
            return await self._call("Job.load", lambda: job_from_pyslurm(ps.Job.load(job_id)))
        except CommandFailed as e:
            if e.exit_code == ESLURM_INVALID_JOB_ID or "Invalid job id" in e.stderr:
                raise UnknownJob(job_id) from e
            raise
