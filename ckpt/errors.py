"""Errors of the checkpoint engine, on top of :mod:`unicorn_core.errors`.

Restore branches on these types to decide whether the next tier should be tried:
every ``ShardUnavailable`` means "this copy cannot be used, try the next one".
"""

from __future__ import annotations

from unicorn_core.errors import InvalidArgument, UnicornError


class ShardUnavailable(UnicornError):
    """One copy of a shard cannot be used. ``reason`` is a short stable label.

    Labels: ``missing`` (no such shard in this tier), ``incomplete`` (not sealed, no done
    marker, or shorter than its metadata says), ``corrupt`` (a checksum does not match),
    ``busy`` (locked by a writer for longer than the timeout), ``unreachable`` (a peer did
    not answer), ``refused`` (a peer answered that it does not hold it).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class SnapshotBusy(UnicornError):
    """Every snapshot slot of a rank is held by readers; the snapshot was not taken."""

    temporary = True


class RestoreFailed(UnicornError):
    """No tier held a usable copy of the shard. ``report`` says why each one failed."""

    def __init__(self, message: str, report: object) -> None:
        super().__init__(message)
        self.report = report


class InvalidTransition(InvalidArgument):
    """A shard state change that the transition table does not allow."""


__all__ = ["InvalidArgument", "InvalidTransition", "RestoreFailed", "ShardUnavailable", "SnapshotBusy"]
