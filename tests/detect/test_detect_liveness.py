"""HeartbeatTracker: expiry on the caller's clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detect.liveness import HeartbeatTracker, Liveness
from detect.statuses import ErrorStatus, Severity
from unicorn_core.errors import InvalidArgument


def test_beats_keep_a_node_alive_and_silence_expires_it() -> None:
    t = HeartbeatTracker(timeout_s=3.0)
    t.beat(7, "n1", 10.0)
    t.beat(7, "n2", 10.0)
    t.beat(7, "n1", 12.0)
    assert t.expired(13.0) == []
    assert t.state(7, "n2", 13.0) is Liveness.ALIVE
    gone = t.expired(13.5)
    assert [(e.job_id, e.node, e.last_beat_s, e.silent_s) for e in gone] == [(7, "n2", 10.0, 3.5)]
    assert t.state(7, "n2", 13.5) is Liveness.EXPIRED
    cls = gone[0].classification()
    assert (cls.status, cls.severity, cls.rule) == (
        ErrorStatus.LOST_CONNECTION,
        Severity.SEV1,
        "heartbeat_timeout",
    )
    assert "n2" in cls.evidence and "3.5 s" in cls.evidence
    t.beat(7, "n2", 14.0)  # it came back
    assert t.expired(14.0) == []


def test_first_beat_gets_the_initial_timeout() -> None:
    t = HeartbeatTracker(timeout_s=3.0, initial_timeout_s=30.0)
    t.expect(1, "n3", 0.0)
    assert t.state(1, "n3", 29.0) is Liveness.WAITING and t.expired(29.0) == []
    late = t.expired(31.0)
    assert len(late) == 1 and late[0].last_beat_s is None and late[0].timeout_s == 30.0
    assert "never heard from" in late[0].classification().evidence
    t.beat(1, "n3", 31.0)
    assert t.state(1, "n3", 33.0) is Liveness.ALIVE
    assert t.state(1, "n3", 34.5) is Liveness.EXPIRED  # now the steady timeout applies


def test_old_beats_do_not_move_last_seen_back_and_expect_does_not_reset() -> None:
    t = HeartbeatTracker(timeout_s=3.0)
    t.beat(1, "n1", 10.0)
    t.beat(1, "n1", 5.0)
    t.expect(1, "n1", 100.0)
    assert t.expired(13.5)[0].last_beat_s == 10.0


def test_forget_and_order() -> None:
    t = HeartbeatTracker(timeout_s=1.0)
    t.beat(1, "a", 0.0)
    t.beat(1, "b", 5.0)
    t.beat(2, "a", 3.0)
    assert [(e.job_id, e.node) for e in t.expired(10.0)] == [(1, "a"), (2, "a"), (1, "b")]
    t.forget(1, "a")
    t.forget_job(2)
    assert [(e.job_id, e.node) for e in t.expired(10.0)] == [(1, "b")] and len(t) == 1
    assert t.state(2, "a", 10.0) is None


@pytest.mark.parametrize(
    "kwargs", [{"timeout_s": 0.0}, {"timeout_s": math.inf}, {"timeout_s": 1.0, "initial_timeout_s": -1.0}]
)
def test_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        HeartbeatTracker(**kwargs)


def test_bad_clock_values() -> None:
    t = HeartbeatTracker(timeout_s=1.0)
    with pytest.raises(InvalidArgument):
        t.beat(1, "a", math.nan)
    with pytest.raises(InvalidArgument):
        t.expired(math.inf)
    assert len(t) == 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["n1", "n2", "n3"]), st.floats(0, 100)), max_size=30),
    st.floats(0, 200),
)
def test_expired_is_exactly_the_silent_ones(beats: list[tuple[str, float]], now: float) -> None:
    t = HeartbeatTracker(timeout_s=3.0)
    last: dict[str, float] = {}
    for node, time_s in beats:
        t.beat(0, node, time_s)
        last[node] = max(last.get(node, time_s), time_s)
    assert {e.node for e in t.expired(now)} == {n for n, s in last.items() if now - s > 3.0}


def test_a_launch_performed_late_moves_only_an_unbeaten_agents_grace() -> None:
    t = HeartbeatTracker(timeout_s=1.5, initial_timeout_s=30.0)
    t.expect(1, "a", 0.0)
    t.expect(1, "b", 0.0)
    t.beat(1, "b", 1.0)
    t.launched(1, "a", 20.0)  # performed 20 s after it was expected
    t.launched(1, "b", 20.0)  # has beaten: its silence counts from its beat
    t.launched(1, "c", 20.0)  # not tracked: nothing
    assert t.state(1, "a", 45.0) is Liveness.WAITING
    assert t.state(1, "a", 51.0) is Liveness.EXPIRED
    assert t.state(1, "b", 3.0) is Liveness.EXPIRED
    assert t.state(1, "c", 21.0) is None
    t.launched(1, "a", 10.0)  # never back in time
    assert t.state(1, "a", 45.0) is Liveness.WAITING


def test_an_agent_whose_launch_is_not_performed_yet_is_never_silent() -> None:
    t = HeartbeatTracker(timeout_s=1.5, initial_timeout_s=30.0)
    t.expect(1, "a", 0.0, started=False)
    assert t.state(1, "a", 500.0) is Liveness.WAITING and t.expired(500.0) == []
    t.launched(1, "a", 500.0)
    assert t.state(1, "a", 529.0) is Liveness.WAITING
    assert [e.node for e in t.expired(531.0)] == ["a"]
