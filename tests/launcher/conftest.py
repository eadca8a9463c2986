"""Fixtures shared with the checkpoint engine's tests (a private shm root per test)."""

from __future__ import annotations

from tests.ckpt.conftest import shm_root

__all__ = ["shm_root"]
