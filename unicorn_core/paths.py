"""Where unicorn's shipped data files (``etc/``) and a node agent's run folder are found."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Final

ETC_ENV = "UNICORN_ETC_DIR"
AGENT_RUN_ROOT = Path("/tmp/unicorn")  # noqa: S108 - node-local scratch, per installation below


def etc_dir() -> Path:
    """The folder holding ``unicorn.toml`` and the other shipped data files.

    Order: ``$UNICORN_ETC_DIR``; the source checkout's ``etc/`` (editable installs and
    tests); ``<prefix>/share/unicorn/etc`` (where a wheel install puts it).
    """
    env = os.environ.get(ETC_ENV)
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parent.parent / "etc"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "unicorn" / "etc"


def agent_runs_root(key_prefix: str, job_id: int) -> Path:
    """The folder of a job's agents' run folders, one per node (:func:`agent_run_dir`)."""
    return AGENT_RUN_ROOT / key_prefix / str(job_id)


def agent_run_dir(key_prefix: str, job_id: int, node: str) -> Path:
    """The node agent's default run folder (``train.log``, the hook socket's neighbours):
    per installation (Redis key prefix), job and node, because job ids repeat across clusters."""
    return agent_runs_root(key_prefix, job_id) / node


CKPT_RING_ENV: Final = "UNICORN_CKPT_RING"
"""A node agent's checkpoint ring: its task's nodes, comma-separated, in the task's order.
unicornd sets it on every agent it starts (:mod:`launcher.ckptagent` reads it)."""
