"""Heartbeat liveness of node agents: which (job, node) went silent, on the caller's clock.

The coordinator calls :meth:`HeartbeatTracker.beat` for every heartbeat it reads and
:meth:`HeartbeatTracker.expired` periodically, both with its monotonic clock. A node
registered with :meth:`HeartbeatTracker.expect` (its agent was just launched) gets
``initial_timeout_s`` for its first beat, because starting an agent through srun takes
longer than one heartbeat interval; after that, ``timeout_s`` between beats.

A node's state is computed from the times, never stored:

- ``waiting``: expected, no beat yet, within ``initial_timeout_s``;
- ``alive``: last beat within ``timeout_s``;
- ``expired``: silent past its timeout (reported by :meth:`~HeartbeatTracker.expired`
  until the node beats again or is forgotten).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from detect.classify import Classification
from detect.statuses import ErrorStatus, Severity
from unicorn_core.errors import InvalidArgument


class Liveness(enum.StrEnum):
    """A node agent's liveness at a given time (see module doc)."""

    WAITING = "waiting"
    ALIVE = "alive"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Expired:
    """(job, node) has been silent ``silent_s`` seconds, more than ``timeout_s``.

    ``last_beat_s`` is None when it never sent a beat (silence counts from ``expect``).
    """

    job_id: int
    node: str
    last_beat_s: float | None
    silent_s: float
    timeout_s: float

    def classification(self) -> Classification:
        """As a ``lost_connection`` finding (SEV1: the node is dead or unreachable)."""
        never = " (never heard from)" if self.last_beat_s is None else ""
        return Classification(
            ErrorStatus.LOST_CONNECTION,
            Severity.SEV1,
            "heartbeat_timeout",
            f"no heartbeat from node {self.node} of job {self.job_id} for {self.silent_s:.3g} s "
            f"(timeout {self.timeout_s:g} s){never}",
        )


@dataclass
class _Entry:
    since_s: float
    """Last beat, or when the node was expected (or its launch performed)."""
    beaten: bool
    started: bool = True
    """False: expected by a launch not performed yet; its silence does not count."""


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidArgument(f"{name} must be finite, got {value}")


class HeartbeatTracker:
    """Last-seen times per (job, node) and the timeouts that turn silence into a finding."""

    def __init__(self, timeout_s: float, initial_timeout_s: float | None = None) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        initial = timeout_s if initial_timeout_s is None else initial_timeout_s
        if not (math.isfinite(initial) and initial > 0):
            raise InvalidArgument(f"initial_timeout_s must be > 0, got {initial_timeout_s}")
        self.timeout_s = timeout_s
        self.initial_timeout_s = initial
        self._entries: dict[tuple[int, str], _Entry] = {}

    def expect(self, job_id: int, node: str, now_s: float, *, started: bool = True) -> None:
        """An agent for (job, node) was launched at ``now_s``; its first beat is due within
        ``initial_timeout_s``. ``started=False``: its launch is decided but not performed
        yet (it may wait behind other actions): its silence counts only from
        :meth:`launched`. No effect on a node that already beat."""
        _finite("now_s", now_s)
        self._entries.setdefault((job_id, node), _Entry(now_s, beaten=False, started=started))

    def launched(self, job_id: int, node: str, now_s: float) -> None:
        """The launch of the expected agent of (job, node) was performed at ``now_s``: its
        first beat is due within ``initial_timeout_s`` of then, not of when it was expected.
        No effect on an agent that has beaten, nor on one not tracked."""
        _finite("now_s", now_s)
        entry = self._entries.get((job_id, node))
        if entry is not None and not entry.beaten:
            entry.since_s = now_s if not entry.started else max(entry.since_s, now_s)
            entry.started = True

    def beat(self, job_id: int, node: str, now_s: float) -> None:
        """A heartbeat from (job, node) arrived at ``now_s``.

        Last-seen only moves forward: a beat older than the one recorded (events read out
        of order) changes nothing.
        """
        _finite("now_s", now_s)
        entry = self._entries.get((job_id, node))
        if entry is None or not entry.beaten:
            self._entries[(job_id, node)] = _Entry(now_s, beaten=True)
        elif now_s > entry.since_s:
            entry.since_s = now_s

    def forget(self, job_id: int, node: str) -> None:
        """Stop tracking (job, node): its agent was stopped on purpose or the job ended."""
        self._entries.pop((job_id, node), None)

    def forget_job(self, job_id: int) -> None:
        """Stop tracking every node of ``job_id``."""
        for key in [k for k in self._entries if k[0] == job_id]:
            del self._entries[key]

    def _timeout(self, entry: _Entry) -> float:
        return self.timeout_s if entry.beaten else self.initial_timeout_s

    def state(self, job_id: int, node: str, now_s: float) -> Liveness | None:
        """The liveness of (job, node) at ``now_s``; None when it is not tracked."""
        _finite("now_s", now_s)
        entry = self._entries.get((job_id, node))
        if entry is None:
            return None
        if not entry.started:
            return Liveness.WAITING
        if now_s - entry.since_s > self._timeout(entry):
            return Liveness.EXPIRED
        return Liveness.ALIVE if entry.beaten else Liveness.WAITING

    def expired(self, now_s: float) -> list[Expired]:
        """Every tracked (job, node) silent past its timeout at ``now_s``, longest silence first."""
        _finite("now_s", now_s)
        found = []
        for (job_id, node), entry in self._entries.items():
            if not entry.started:
                continue
            timeout = self._timeout(entry)
            silent = now_s - entry.since_s
            if silent > timeout:
                found.append(Expired(job_id, node, entry.since_s if entry.beaten else None, silent, timeout))
        found.sort(key=lambda e: (-e.silent_s, e.job_id, e.node))
        return found

    def __len__(self) -> int:
        return len(self._entries)
