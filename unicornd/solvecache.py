"""The planner's memory of its solves (:class:`SolveCache`), apart from :mod:`unicornd.replan`
because it keeps time and a lock, which decision modules never touch."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Final

from plan.planner import Plan
from unicornd.state import PlanBasis

BEYOND_ONE_STEP: Final = "beyond one step: "
"""How :func:`unicornd.replan.miss_reason` starts a miss no one-step table could hold."""


@dataclass
class Took:
    """One timed lookup: ``hit`` True (cached), False (solved), None (not cacheable)."""

    hit: bool | None = None


SOLVES_KEPT: Final = 1024
"""Solves a :class:`SolveCache` keeps: a one-step table is one per planned task plus a spare
(201 at 200 tasks), so about five tables, enough for the tables of a rank crash's incident
and of the state before it. :mod:`unicornd.lookup` shares equal assignments across the
tables of a plan basis, so a cached plan holds little besides its tuple of references
(without sharing, a plan of 200 tasks held ~74 KB)."""


class SolveCache:
    """Plans solved before, by their exact inputs: a cached plan is the plan the solve would
    give, so using one changes no decision (a restarted unicornd that solves afresh decides
    the same). :mod:`unicornd.lookup` fills it ahead of failures. Thread-safe (replans run
    in worker threads). ``hits``/``misses`` count :func:`plan_for` calls that could use it;
    ``hit_s``/``miss_s`` are their durations (the newest 1,000)."""

    def __init__(self, kept: int = SOLVES_KEPT) -> None:
        self.kept = kept
        self._plans: OrderedDict[Hashable, tuple[PlanBasis | None, Plan]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.hit_s: deque[float] = deque(maxlen=1000)
        self.miss_s: deque[float] = deque(maxlen=1000)
        self.table: tuple[Hashable, PlanBasis | None, bool] | None = None
        """The newest one-step table :mod:`unicornd.lookup` started: (the key of the state it
        is built around, its basis, whether it was built whole); None before the first."""
        self.misses_beyond_one_step = 0
        """Misses whose state was more than one step from the newest table's (all of them,
        where :attr:`missed` keeps the newest 1,000)."""
        self.missed: deque[tuple[float, str]] = deque(maxlen=1000)
        """(wall time, why) of each miss (:func:`unicornd.replan.miss_reason`), the newest 1,000."""

    def table_started(self, key: Hashable, basis: PlanBasis | None) -> None:
        with self._lock:
            self.table = (key, basis, False)

    def table_built(self, key: Hashable, basis: PlanBasis | None) -> None:
        with self._lock:
            if self.table is not None and self.table[0] == key and self.table[1] is basis:
                self.table = (key, basis, True)

    def note_miss(self, why: str) -> None:
        with self._lock:
            self.missed.append((time.time(), why))
            if why.startswith(BEYOND_ONE_STEP):
                self.misses_beyond_one_step += 1

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: Hashable, basis: PlanBasis | None) -> Plan | None:
        """The plan solved for ``key`` with this very basis (the same object: a basis is
        made once per refresh; equal contents from another refresh do not count)."""
        with self._lock:
            found = self._plans.get(key)
            if found is None or found[0] is not basis:
                return None
            self._plans.move_to_end(key)
            return found[1]

    def put(self, key: Hashable, basis: PlanBasis | None, plan: Plan) -> None:
        with self._lock:
            self._plans[key] = (basis, plan)
            self._plans.move_to_end(key)
            while len(self._plans) > self.kept:
                self._plans.popitem(last=False)

    @contextlib.contextmanager
    def measure(self) -> Iterator[Took]:
        """Time a lookup: the caller sets ``hit`` (left None: not counted)."""
        took = Took()
        started = time.perf_counter()
        yield took
        if took.hit is None:
            return
        with self._lock:
            if took.hit:
                self.hits += 1
                self.hit_s.append(time.perf_counter() - started)
            else:
                self.misses += 1
                self.miss_s.append(time.perf_counter() - started)
