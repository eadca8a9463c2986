"""``unicornd``: the coordinator daemon's entry point.

``unicornd`` runs the recovery loop (:mod:`unicornd.daemon`) until a signal: SIGTERM
drains (finishes the action in flight), SIGINT/SIGQUIT stop now; it exits non-zero
when one of its root tasks dies, so systemd restarts it. ``unicornd --check``
validates the configuration and that Slurm and Redis answer, then exits.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from unicorn_core import redis_io
from unicorn_core.config import Config, load_config
from unicorn_core.errors import ConfigError, UnicornError
from unicorn_core.logs import configure_logging, get_logger
from unicorn_core.slurm import make_backend
from unicorn_core.slurm.scope import resolve_scope


async def check(cfg: Config) -> None:
    log = get_logger("unicornd")
    slurm = await make_backend(cfg.slurm)
    version = await slurm.version()
    scope = await resolve_scope(slurm, cfg.slurm)  # an unknown partition or reservation fails here
    nodes = [n for n in await slurm.list_nodes() if scope.admits(n)]
    client = redis_io.connect(cfg.redis, client_name="unicornd-check")
    try:
        await redis_io.call(("PING",), client.ping())
    finally:
        await client.aclose()
    log.info(
        "check passed",
        slurm_version=version,
        nodes=len(nodes),
        scope=scope.describe(),
        redis=cfg.redis.url.split("@")[-1],
    )


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--check", "check_only", is_flag=True, help="Validate config, Slurm and Redis; then exit.")
def cli(config_path: Path | None, check_only: bool) -> None:
    """The unicorn coordinator (runs beside slurmctld)."""
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    configure_logging(cfg.log.level, cfg.log.format)
    if not check_only:
        from unicornd.daemon import run_daemon

        try:
            sys.exit(asyncio.run(run_daemon(cfg, config_path=str(config_path) if config_path else None)))
        except UnicornError as e:
            get_logger("unicornd").error("unicornd failed to start", error=str(e))
            sys.exit(1)
    try:
        asyncio.run(check(cfg))
    except UnicornError as e:
        get_logger("unicornd").error("check failed", error=str(e))
        sys.exit(1)


def main() -> None:
    cli(prog_name="unicornd")
