"""Root-cause choice across ranks and nodes: which finding explains the failure.

When one rank fails, the others follow: their collectives time out, their connections
to it are reset, torchrun tears the survivors down. The first failing rank is usually
the culprit (torchelastic's "first observed failure"), so the earliest finding wins,
with two corrections:

1. *Secondary* evidence (NCCL timeouts, connection resets, hangs, terminations, remote
   errors; see ``Classification.secondary``) is a consequence, not a cause, whenever
   there is any primary evidence. It wins only when nothing else was found.
2. Findings within ``simultaneous_s`` of the earliest count as simultaneous (clock skew
   between nodes and the different latencies of the detection paths make their order
   meaningless); among those the most severe wins, then the earliest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from detect.classify import Classification
from unicorn_core.errors import InvalidArgument

DEFAULT_SIMULTANEOUS_S: Final = 1.0
"""Default tie window: the detection paths (exit watcher, log scanner, hook socket,
heartbeat) differ in latency by up to about one agent heartbeat interval (1 s)."""


@dataclass(frozen=True)
class Evidence:
    """One classified piece of evidence, where and when it was seen.

    ``time_s`` must be on one clock for all findings compared together: the sender's
    wall time (``wall_time_s`` of the message; nodes are NTP-synchronised) or the
    coordinator's monotonic receive time. ``source`` says which detection path produced
    it (e.g. ``exit``, ``exception``, ``log``, ``gpu``, ``heartbeat``, ``hang``).
    """

    node: str
    rank: int | None
    time_s: float
    classification: Classification
    source: str = ""

    def __post_init__(self) -> None:
        if not math.isfinite(self.time_s):
            raise InvalidArgument(f"evidence time_s must be finite, got {self.time_s}")


def choose_root_cause(
    findings: Sequence[Evidence], simultaneous_s: float = DEFAULT_SIMULTANEOUS_S
) -> Evidence | None:
    """The finding that most likely caused the others; None when every finding is benign.

    Deterministic: among equal candidates the one listed first wins.
    """
    if not math.isfinite(simultaneous_s) or simultaneous_s < 0:
        raise InvalidArgument(f"simultaneous_s must be a finite number >= 0, got {simultaneous_s}")
    faults = [f for f in findings if f.classification.is_fault]
    if not faults:
        return None
    primary = [f for f in faults if not f.classification.secondary] or faults
    first = min(f.time_s for f in primary)
    window = [f for f in primary if f.time_s <= first + simultaneous_s]

    def rank(f: Evidence) -> tuple[int, float]:
        assert f.classification.severity is not None
        return (f.classification.severity.level, f.time_s)

    return min(window, key=rank)
