"""Failure traces: the generators' laws, determinism, the CSV schemas and their errors."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from plan.sim.trace import (
    DAY_S,
    HOUR_S,
    TRACE_A,
    TRACE_B,
    EventKind,
    Trace,
    TraceEvent,
    generate_trace,
    load_trace_csv,
    parse_trace_csv,
)
from unicorn_core.errors import ConfigError, InvalidArgument
from unicorn_core.paths import etc_dir

EXAMPLE = etc_dir() / "traces" / "example.csv"


def repair_delays(trace: Trace) -> list[float]:
    """Seconds from each SEV1 to the return of its node."""
    failed_at: dict[int, float] = {}
    delays = []
    for e in trace.events:
        if e.kind is EventKind.SEV1:
            failed_at[e.node] = e.time_s
        elif e.kind is EventKind.NODE_RETURN:
            delays.append(e.time_s - failed_at.pop(e.node))
    return delays


@pytest.mark.parametrize("seed", range(5))
def test_trace_a_has_the_papers_counts_and_repair_law(seed: int) -> None:
    trace = generate_trace(TRACE_A, seed)
    counts = trace.counts()
    assert counts[EventKind.SEV1] == 10
    assert counts[EventKind.SEV2] + counts[EventKind.SEV3] == 33
    assert trace.nodes == 16 and trace.duration_s == 56 * DAY_S
    delays = repair_delays(trace)
    assert delays and all(1 * DAY_S <= d <= 7 * DAY_S for d in delays)
    assert counts[EventKind.NODE_RETURN] == len(delays) <= 10


def test_trace_b_is_trace_a_amplified_twenty_times() -> None:
    traces = [generate_trace(TRACE_B, seed) for seed in range(40)]
    weeks_a = TRACE_A.duration_s / (7 * DAY_S)
    sev1_mean = statistics.mean(t.counts()[EventKind.SEV1] for t in traces)
    other_mean = statistics.mean(t.counts()[EventKind.SEV2] + t.counts()[EventKind.SEV3] for t in traces)
    assert sev1_mean == pytest.approx(10 / weeks_a * 20, rel=0.15)
    assert other_mean == pytest.approx(33 / weeks_a * 20, rel=0.1)
    assert len({t.counts()[EventKind.SEV1] for t in traces}) > 1  # Poisson, not fixed
    delays = [d for t in traces for d in repair_delays(t)]
    assert all(1 * DAY_S / 20 <= d <= 7 * DAY_S / 20 for d in delays)
    assert all(t.duration_s == 7 * DAY_S for t in traces)


def test_same_seed_same_trace() -> None:
    assert generate_trace(TRACE_B, 7) == generate_trace(TRACE_B, 7)
    assert generate_trace(TRACE_B, 7) != generate_trace(TRACE_B, 8)


def test_trace_rejects_inconsistent_histories() -> None:
    with pytest.raises(InvalidArgument, match="not down"):
        Trace("t", 4, 100.0, (TraceEvent(1.0, EventKind.NODE_RETURN, 2),))
    with pytest.raises(InvalidArgument, match="already down"):
        Trace("t", 4, 100.0, (TraceEvent(1.0, EventKind.SEV1, 2), TraceEvent(2.0, EventKind.SEV2, 2)))
    with pytest.raises(InvalidArgument, match="non-decreasing"):
        Trace("t", 4, 100.0, (TraceEvent(5.0, EventKind.SEV2, 1), TraceEvent(2.0, EventKind.SEV2, 1)))
    with pytest.raises(InvalidArgument, match=r"0\.\.3"):
        Trace("t", 4, 100.0, (TraceEvent(5.0, EventKind.SEV2, 4),))


def test_example_csv() -> None:
    trace = load_trace_csv(EXAMPLE, nodes=16, seed=0)
    counts = trace.counts()
    assert (counts[EventKind.SEV1], counts[EventKind.SEV2], counts[EventKind.SEV3]) == (2, 2, 2)
    assert trace.duration_s == 168 * HOUR_S
    returns = {e.node: e.time_s for e in trace.events if e.kind is EventKind.NODE_RETURN}
    assert returns == {2: (31.25 + 48) * HOUR_S, 9: 101.5 * HOUR_S}
    assert load_trace_csv(EXAMPLE, nodes=16, seed=0) == trace


def test_csv_open_node_is_picked_among_nodes_up() -> None:
    text = "time_h,event,node\n1,sev1,0\n2,sev1,1\n3,sev2,\n4,end,\n"
    for seed in range(20):
        trace = parse_trace_csv(text, "t.csv", nodes=3, seed=seed)
        assert trace.events[-1].node == 2


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("time_h,event,node\n1,sev9,0\n", r"t\.csv:2: event must be one of"),
        ("time_h,event,node\n1,return,0\n", r"t\.csv:2: node 0 returns .* not down"),
        ("time_h,event,node\n1,sev1,0\n2,sev1,0\n", r"t\.csv:3: node 0 is down"),
        ("time_h,event,node\n1,sev2,16\n", "outside the 16-node cluster"),
        ("time_h,event,node\nsoon,sev2,1\n", "time_h must be a number"),
        ("time_h,event,node,extra\n1,sev2,1,x\n", r"unknown column\(s\) \['extra'\]"),
        ("time_h,event,node,repair_h\n1,sev2,1,5\n", "repair_h is only valid on sev1"),
        ("time_h,event,node\n1,return,\n", "must name its node"),
        ("when,what\n1,sev2\n", "neither the native schema"),
        ("# only a comment\n", "no header"),
    ],
)
def test_csv_errors_name_file_and_line(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_trace_csv(text, "t.csv", nodes=16)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_trace_csv(tmp_path / "absent.csv", nodes=16)


def test_acme_job_records() -> None:
    text = (
        "job_id,node_num,state,submit_time,start_time,end_time,fail_time\n"
        "a,8,COMPLETED,2023-05-17 00:00:00+00:00,2023-05-17 00:01:00+00:00,2023-05-24 00:00:00+00:00,\n"
        "b,8,NODE_FAIL,2023-05-17 01:00:00+00:00,2023-05-17 01:00:10+00:00,2023-05-17 03:00:00+00:00,\n"
        "c,2,FAILED,2023-05-17 02:00:00+00:00,2023-05-17 02:00:10+00:00,2023-05-17 09:00:00+00:00,"
        "2023-05-17 08:30:00+00:00\n"
    )
    trace = parse_trace_csv(text, "acme.csv", nodes=16, seed=1)
    assert trace.duration_s == 7 * DAY_S
    kinds = [(e.kind, e.time_s) for e in trace.events if e.kind is not EventKind.NODE_RETURN]
    assert kinds == [(EventKind.SEV1, 3 * HOUR_S), (EventKind.SEV2, 8.5 * HOUR_S)]
    assert all(1 * DAY_S <= d <= 7 * DAY_S for d in repair_delays(trace))
    with pytest.raises(ConfigError, match="UTC offset"):
        parse_trace_csv(text.replace("+00:00", ""), "acme.csv", nodes=16)
