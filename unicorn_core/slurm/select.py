"""Which Slurm backend to use: ``[slurm] backend`` = ``cli`` | ``pyslurm`` | ``auto``.

pyslurm is bound to one Slurm release (its version's first two numbers, e.g. pyslurm
``25.11.0`` needs Slurm 25.11), and libslurm refuses to talk across releases, so it is used
only when it imports *and* matches the cluster's Slurm major.minor. ``auto`` falls back to
the CLI (which works with every Slurm >= 22.05) and logs why; ``pyslurm`` refuses with a
:class:`~unicorn_core.errors.ConfigError` that says why. ``cli`` never imports pyslurm.
"""

from __future__ import annotations

import os
import re
from types import ModuleType
from typing import TypedDict

from unicorn_core.config import SlurmConfig
from unicorn_core.errors import ConfigError, ExternalCallError
from unicorn_core.logs import get_logger
from unicorn_core.slurm.backend import SlurmBackend
from unicorn_core.slurm.cli import CliSlurm
from unicorn_core.slurm.pyslurm_backend import PyslurmBackend, import_pyslurm, pyslurm_version

_log = get_logger("unicorn_core.slurm")
_MAJOR_MINOR = re.compile(r"(\d+)\.(\d+)")


class _Settings(TypedDict):
    """The ``[slurm]`` settings both backends take, read from the config in one place."""

    timeout_s: float
    bin_dir: str | None
    slurm_conf: str | None


def major_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a Slurm or pyslurm version: ``22.05.8`` and ``22.5.0`` give (22, 5)."""
    m = _MAJOR_MINOR.search(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


async def make_backend(cfg: SlurmConfig, *, cluster_version: str | None = None) -> SlurmBackend:
    """The backend ``cfg.backend`` asks for, configured from ``[slurm]``.

    ``cluster_version`` is the cluster's Slurm version (e.g. ``"22.05.8"``); when None and
    pyslurm imports, it is asked with ``sinfo --version``. Raises ``ConfigError`` only for
    ``backend = "pyslurm"`` when pyslurm cannot be used.
    """
    settings = _Settings(
        timeout_s=cfg.command_timeout_s, bin_dir=cfg.bin_dir or None, slurm_conf=cfg.conf or None
    )
    cli = CliSlurm(**settings)
    if cfg.backend == "cli":
        return cli
    module, why = await _usable_pyslurm(cfg, cli, cluster_version)
    if module is None:
        if cfg.backend == "pyslurm":
            raise ConfigError(f'slurm.backend = "pyslurm": {why}; use "cli" or "auto" instead')
        _log.info("slurm_backend_cli", reason=why)
        return cli
    _log.info("slurm_backend_pyslurm", reason=why)
    return PyslurmBackend(**settings, module=module)


async def _usable_pyslurm(
    cfg: SlurmConfig, cli: CliSlurm, cluster_version: str | None
) -> tuple[ModuleType | None, str]:
    """The imported pyslurm if it can serve this cluster, else None; and why."""
    try:
        module = import_pyslurm()
    except ImportError as e:
        return None, f"pyslurm does not import ({e})"
    ps_version = pyslurm_version(module)
    built_for = major_minor(ps_version) if ps_version else None
    if ps_version is None or built_for is None:
        return None, f"pyslurm reports no usable version ({ps_version!r})"
    process_conf = os.environ.get("SLURM_CONF", "")
    if cfg.conf and cfg.conf != process_conf:
        return None, (
            f"slurm.conf = {cfg.conf!r} but pyslurm reads the process's SLURM_CONF "
            f"({process_conf or 'unset'}); set SLURM_CONF to the same file before starting"
        )
    if cluster_version is None:
        try:
            cluster_version = await cli.version()
        except ExternalCallError as e:
            return None, f"cannot learn the cluster's Slurm version to check pyslurm {ps_version}: {e}"
    if major_minor(cluster_version) != built_for:
        return None, (
            f"pyslurm {ps_version} is built for Slurm {built_for[0]}.{built_for[1]:02d}, "
            f"but the cluster runs Slurm {cluster_version}"
        )
    return module, f"pyslurm {ps_version} matches the cluster's Slurm {cluster_version}"
