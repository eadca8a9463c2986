"""Where unicorn's shipped data files (``etc/``) are found."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ETC_ENV = "UNICORN_ETC_DIR"


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
