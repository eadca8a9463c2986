"""Failure traces: seeded generators for Unicron's trace-a and trace-b, and a CSV loader.

A :class:`Trace` is a cluster size, a duration and a time-ordered list of events on
nodes ``0..nodes-1``: failures of severity SEV1 (the node is lost until it returns),
SEV2 (a process or software fault), SEV3 (a transient network fault), and node returns.
Every trace is checked on construction: a SEV1 or a return names a node that is up,
respectively down, at that moment; SEV2 and SEV3 strike a node that is up.

CSV schema (``etc/traces/README.md`` has an example). Lines starting with ``#`` are
comments; the header row names the columns, in any order:

``time_h``   hours since the start of the trace (float >= 0), required
``event``    ``sev1`` | ``sev2`` | ``sev3`` | ``return`` | ``end``, required
``node``     node index ``0..nodes-1``; empty: a node picked with the seeded generator,
             uniformly among the nodes up at that time (required for ``return``)
``repair_h`` ``sev1`` only, optional: the node returns this many hours later (else only
             an explicit ``return`` row brings it back)

An ``end`` row sets the duration (default: the time of the last row). Rows may come in
any order; they are sorted by time (stable).

Job records as in the public Acme traces (Shanghai AI Lab, ``trace_kalos.csv``: columns
``state``, ``node_num``, ``submit_time``, ``end_time`` and optionally ``fail_time``) are
read too: a ``NODE_FAIL`` job is a SEV1 on one node, repaired after a uniform 1-7 days
(trace-a's repair law), a ``FAILED`` job a SEV2, other states are ignored. Times are
ISO 8601, relative to the earliest ``submit_time``. Filter the file to the jobs of the
cluster you model first: one row is one failure on this cluster.
"""

from __future__ import annotations

import csv
import heapq
import io
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from pathlib import Path

import numpy as np

from unicorn_core.errors import ConfigError, InvalidArgument

HOUR_S = 3600.0
DAY_S = 24 * HOUR_S
WEEK_S = 7 * DAY_S


class EventKind(StrEnum):
    """What happens to a node (Unicron's severity levels, SEV1 the most severe)."""

    SEV1 = "sev1"  # node fault: the node is lost until repaired (ECC, NVLink, driver, lost connection)
    SEV2 = "sev2"  # process/software fault: restart the process (exit, CUDA error, hang)
    SEV3 = "sev3"  # transient network fault: retry in place (connection reset, link flapping)
    NODE_RETURN = "return"  # a repaired node joins again

    @property
    def is_failure(self) -> bool:
        return self is not EventKind.NODE_RETURN


@dataclass(frozen=True)
class TraceEvent:
    """One event at ``time_s`` seconds after the start, on node ``node``."""

    time_s: float
    kind: EventKind
    node: int


@dataclass(frozen=True)
class Trace:
    """A failure trace of a ``nodes``-node cluster over ``duration_s`` seconds (validated)."""

    name: str
    nodes: int
    duration_s: float
    events: tuple[TraceEvent, ...]

    def __post_init__(self) -> None:
        check_events(self.nodes, self.duration_s, self.events, self.name)

    def counts(self) -> dict[EventKind, int]:
        """Events of each kind."""
        found = Counter(e.kind for e in self.events)
        return {kind: found.get(kind, 0) for kind in EventKind}


def check_events(nodes: int, duration_s: float, events: Sequence[TraceEvent], where: str) -> None:
    """Raise :class:`InvalidArgument` unless ``events`` is a consistent history of ``nodes`` nodes."""
    if nodes < 1:
        raise InvalidArgument(f"{where}: a trace needs at least one node, got {nodes}")
    if not duration_s > 0:
        raise InvalidArgument(f"{where}: duration must be positive, got {duration_s!r} s")
    down: set[int] = set()
    last = 0.0
    for i, e in enumerate(events):
        at = f"{where}: event {i} ({e.kind.value} on node {e.node} at {e.time_s / HOUR_S:.3f} h)"
        if not 0 <= e.node < nodes:
            raise InvalidArgument(f"{at}: node must be in 0..{nodes - 1}")
        if not last <= e.time_s <= duration_s:
            raise InvalidArgument(f"{at}: times must be non-decreasing and within the {duration_s:g} s trace")
        last = e.time_s
        if e.kind is EventKind.NODE_RETURN:
            if e.node not in down:
                raise InvalidArgument(f"{at}: the node is not down")
            down.discard(e.node)
        elif e.node in down:
            raise InvalidArgument(f"{at}: the node is already down")
        elif e.kind is EventKind.SEV1:
            down.add(e.node)


@dataclass(frozen=True)
class TraceSpec:
    """How to generate a trace: failure rates per week and the repair-time law.

    ``poisson``: counts are Poisson with these means (a Poisson process); otherwise they
    are the rates times the duration, rounded, as fixed counts. Either way the times are
    uniform over the trace. ``sev3_share`` splits the non-SEV1 failures into SEV3/SEV2.
    """

    name: str
    nodes: int
    duration_s: float
    sev1_per_week: float
    other_per_week: float
    repair_min_s: float
    repair_max_s: float
    poisson: bool
    sev3_share: float = 0.5  # assumption: no published SEV2/SEV3 split; both kinds are frequent

    def __post_init__(self) -> None:
        if self.nodes < 1 or not self.duration_s > 0:
            raise InvalidArgument(f"{self.name}: need nodes >= 1 and a positive duration")
        if self.sev1_per_week < 0 or self.other_per_week < 0:
            raise InvalidArgument(f"{self.name}: failure rates must be >= 0")
        if not 0 < self.repair_min_s <= self.repair_max_s:
            raise InvalidArgument(f"{self.name}: need 0 < repair_min_s <= repair_max_s")
        if not 0 <= self.sev3_share <= 1:
            raise InvalidArgument(f"{self.name}: sev3_share must be in [0, 1], got {self.sev3_share!r}")

    def amplified(self, factor: float, duration_s: float, name: str) -> TraceSpec:
        """Failure rates x ``factor`` as a Poisson process; repairs ``factor`` times faster."""
        if not factor > 0:
            raise InvalidArgument(f"amplification factor must be positive, got {factor!r}")
        return replace(
            self,
            name=name,
            duration_s=duration_s,
            sev1_per_week=self.sev1_per_week * factor,
            other_per_week=self.other_per_week * factor,
            repair_min_s=self.repair_min_s / factor,
            repair_max_s=self.repair_max_s / factor,
            poisson=True,
        )


# Unicron (Section 7, Figure 11): trace-a is 8 weeks of a real 128-GPU cluster (16 nodes of
# 8 GPUs) with 10 SEV1 and 33 other failures; a SEV1 node comes back after 1-7 days.
TRACE_A = TraceSpec(
    name="trace-a",
    nodes=16,
    duration_s=8 * WEEK_S,
    sev1_per_week=10 / 8,
    other_per_week=33 / 8,
    repair_min_s=1 * DAY_S,
    repair_max_s=7 * DAY_S,
    poisson=False,
)
# trace-b: the same failure rates x20 over 7 days, Poisson arrivals (~25 SEV1, ~82 others;
# the paper reports 26 and 80). Repaired nodes return "at a similar rate", so repair
# times shrink by the same factor (1.2-8.4 h); with 1-7 days the cluster would be empty.
TRACE_B = TRACE_A.amplified(20.0, 7 * DAY_S, "trace-b")

BUILTIN_TRACES = {TRACE_A.name: TRACE_A, TRACE_B.name: TRACE_B}


def _pick_up(rng: np.random.Generator, nodes: int, down: set[int]) -> int | None:
    up = [n for n in range(nodes) if n not in down]
    return up[int(rng.integers(len(up)))] if up else None


def generate_trace(spec: TraceSpec, seed: int) -> Trace:
    """A trace drawn from ``spec``; the same seed gives the same trace.

    Failures strike a node chosen uniformly among those up at the time (a failure that
    finds every node down is dropped); a SEV1 node returns after a uniform repair time,
    if that falls within the trace.
    """
    rng = np.random.default_rng(seed)
    weeks = spec.duration_s / WEEK_S
    mean_sev1, mean_other = spec.sev1_per_week * weeks, spec.other_per_week * weeks
    if spec.poisson:
        n_sev1, n_other = int(rng.poisson(mean_sev1)), int(rng.poisson(mean_other))
    else:
        n_sev1, n_other = round(mean_sev1), round(mean_other)
    kinds = [EventKind.SEV1] * n_sev1 + [
        EventKind.SEV3 if rng.random() < spec.sev3_share else EventKind.SEV2 for _ in range(n_other)
    ]
    times = rng.uniform(0.0, spec.duration_s, size=len(kinds))
    # heap of (time, order, kind, node): failures carry node -1 (picked when they happen)
    queue: list[tuple[float, int, EventKind, int]] = [
        (float(t), i, k, -1) for i, (t, k) in enumerate(zip(times, kinds, strict=True))
    ]
    heapq.heapify(queue)
    order = len(queue)
    down: set[int] = set()
    events: list[TraceEvent] = []
    while queue:
        t, _, kind, node = heapq.heappop(queue)
        if kind is EventKind.NODE_RETURN:
            down.discard(node)
            events.append(TraceEvent(t, kind, node))
            continue
        picked = _pick_up(rng, spec.nodes, down)
        if picked is None:
            continue
        events.append(TraceEvent(t, kind, picked))
        if kind is EventKind.SEV1:
            down.add(picked)
            back = t + float(rng.uniform(spec.repair_min_s, spec.repair_max_s))
            if back <= spec.duration_s:
                heapq.heappush(queue, (back, order, EventKind.NODE_RETURN, picked))
                order += 1
    return Trace(spec.name, spec.nodes, spec.duration_s, tuple(events))


@dataclass(frozen=True)
class _Row:
    time_s: float
    kind: EventKind
    node: int | None
    repair_s: float | None
    line: int


_NATIVE_COLUMNS = ("time_h", "event", "node", "repair_h")
_ACME_REQUIRED = ("state", "node_num", "submit_time", "end_time")


def load_trace_csv(path: Path, nodes: int, seed: int = 0) -> Trace:
    """Read a trace in the native schema or as Acme job records (see the module docstring).

    ``nodes`` is the cluster size the trace is replayed on; ``seed`` picks the nodes that
    rows leave open. Raises :class:`ConfigError` naming the file and line of a bad row.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"trace {str(path)!r}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"trace {str(path)!r}: not UTF-8 text: {exc}") from exc
    return parse_trace_csv(text, str(path), nodes, seed, name=path.stem)


def parse_trace_csv(text: str, source: str, nodes: int, seed: int = 0, name: str = "csv") -> Trace:
    """Parse CSV ``text`` (``source`` names it in errors); see :func:`load_trace_csv`."""
    if nodes < 1:
        raise InvalidArgument(f"nodes must be >= 1, got {nodes}")
    numbered = [
        (i + 1, line) for i, line in enumerate(text.splitlines()) if not line.lstrip().startswith("#")
    ]
    numbered = [(i, line) for i, line in numbered if line.strip()]
    if not numbered:
        raise ConfigError(f"{source}: no header row")
    reader = csv.DictReader(io.StringIO("\n".join(line for _, line in numbered)))
    header = [h.strip() for h in reader.fieldnames or ()]
    reader.fieldnames = header
    lines = [i for i, _ in numbered[1:]]
    records = list(reader)
    rng = np.random.default_rng(seed)
    if all(c in header for c in _ACME_REQUIRED):
        rows, end_s = _acme_rows(records, lines, source, rng)
    elif "time_h" in header and "event" in header:
        unknown = sorted(set(header) - set(_NATIVE_COLUMNS))
        if unknown:
            raise ConfigError(f"{source}: unknown column(s) {unknown}; valid: {', '.join(_NATIVE_COLUMNS)}")
        rows, end_s = _native_rows(records, lines, source)
    else:
        raise ConfigError(
            f"{source}: header {header} is neither the native schema (time_h, event, node, repair_h) "
            f"nor Acme job records ({', '.join(_ACME_REQUIRED)})"
        )
    return _resolve(rows, end_s, nodes=nodes, rng=rng, source=source, name=name)


def _float(value: str, what: str, where: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{where}: {what} must be a number, got {value!r}") from None
    if not number >= 0 or number == float("inf"):
        raise ConfigError(f"{where}: {what} must be a finite number >= 0, got {value!r}")
    return number


def _native_rows(
    records: Iterable[dict[str, str | None]], lines: Sequence[int], source: str
) -> tuple[list[_Row], float | None]:
    rows: list[_Row] = []
    end_s: float | None = None
    kinds = {k.value: k for k in EventKind}
    for line, rec in zip(lines, records, strict=False):
        where = f"{source}:{line}"
        event = (rec.get("event") or "").strip().lower()
        time_s = _float((rec.get("time_h") or "").strip(), "time_h", where) * HOUR_S
        if event == "end":
            end_s = time_s if end_s is None else max(end_s, time_s)
            continue
        if event not in kinds:
            raise ConfigError(f"{where}: event must be one of {', '.join([*kinds, 'end'])}, got {event!r}")
        kind = kinds[event]
        node_text = (rec.get("node") or "").strip()
        node = None
        if node_text:
            if not node_text.isdigit():
                raise ConfigError(f"{where}: node must be an integer >= 0, got {node_text!r}")
            node = int(node_text)
        repair_text = (rec.get("repair_h") or "").strip()
        repair_s = _float(repair_text, "repair_h", where) * HOUR_S if repair_text else None
        if repair_s is not None and kind is not EventKind.SEV1:
            raise ConfigError(f"{where}: repair_h is only valid on sev1 rows")
        if kind is EventKind.NODE_RETURN and node is None:
            raise ConfigError(f"{where}: a return row must name its node")
        rows.append(_Row(time_s, kind, node, repair_s, line))
    return rows, end_s


def _timestamp(value: str | None, what: str, where: str) -> datetime:
    try:
        stamp = datetime.fromisoformat((value or "").strip())
    except ValueError:
        raise ConfigError(f"{where}: {what} must be an ISO 8601 timestamp, got {value!r}") from None
    if stamp.tzinfo is None:
        raise ConfigError(f"{where}: {what} needs a UTC offset (as in the Acme traces), got {value!r}")
    return stamp


def _acme_rows(
    records: Iterable[dict[str, str | None]], lines: Sequence[int], source: str, rng: np.random.Generator
) -> tuple[list[_Row], float | None]:
    parsed: list[tuple[int, str, datetime, datetime, datetime | None]] = []
    for line, rec in zip(lines, records, strict=False):
        where = f"{source}:{line}"
        state = (rec.get("state") or "").strip().upper()
        submit = _timestamp(rec.get("submit_time"), "submit_time", where)
        end = _timestamp(rec.get("end_time"), "end_time", where)
        fail_text = (rec.get("fail_time") or "").strip()
        fail = _timestamp(fail_text, "fail_time", where) if fail_text else None
        parsed.append((line, state, submit, end, fail))
    if not parsed:
        raise ConfigError(f"{source}: no job records")
    start = min(p[2] for p in parsed)
    end_s = max((p[3] - start).total_seconds() for p in parsed)
    rows = []
    for line, state, _, end, fail in parsed:
        kind = {"NODE_FAIL": EventKind.SEV1, "FAILED": EventKind.SEV2}.get(state)
        if kind is None:
            continue
        at = ((fail or end) - start).total_seconds()
        repair_s = (
            float(rng.uniform(TRACE_A.repair_min_s, TRACE_A.repair_max_s)) if kind is EventKind.SEV1 else None
        )
        rows.append(_Row(at, kind, None, repair_s, line))
    return rows, end_s


def _resolve(
    rows: list[_Row], end_s: float | None, *, nodes: int, rng: np.random.Generator, source: str, name: str
) -> Trace:
    """Order rows by time, pick open nodes, add repair returns, and check the history."""
    rows = sorted(rows, key=lambda r: r.time_s)
    duration = end_s if end_s is not None else max((r.time_s for r in rows), default=0.0)
    if not duration > 0:
        raise ConfigError(f"{source}: the trace has no duration (add an 'end' row)")
    queue: list[tuple[float, int, _Row]] = [(r.time_s, i, r) for i, r in enumerate(rows)]
    heapq.heapify(queue)
    order = len(queue)
    down: set[int] = set()
    events: list[TraceEvent] = []
    while queue:
        t, _, row = heapq.heappop(queue)
        if t > duration:
            continue
        where = f"{source}:{row.line}" if row.line > 0 else f"{source} (repair of a sev1)"
        node = row.node
        if node is None:
            node = _pick_up(rng, nodes, down)
            if node is None:
                raise ConfigError(f"{where}: {row.kind.value} at {t / HOUR_S:g} h finds every node down")
        if node >= nodes:
            raise ConfigError(f"{where}: node {node} is outside the {nodes}-node cluster")
        if row.kind is EventKind.NODE_RETURN:
            if node not in down:
                raise ConfigError(f"{where}: node {node} returns at {t / HOUR_S:g} h but is not down")
            down.discard(node)
        elif node in down:
            raise ConfigError(f"{where}: node {node} is down at {t / HOUR_S:g} h")
        elif row.kind is EventKind.SEV1:
            down.add(node)
            if row.repair_s is not None:
                back = _Row(t + row.repair_s, EventKind.NODE_RETURN, node, None, 0)
                heapq.heappush(queue, (back.time_s, order, back))
                order += 1
        events.append(TraceEvent(t, row.kind, node))
    return Trace(name, nodes, duration, tuple(events))
