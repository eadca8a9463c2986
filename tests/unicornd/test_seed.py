"""A starting leader's seed of its agents' silence from their heartbeat keys (unicornd/seed.py)."""

from __future__ import annotations

import pytest

from detect import load_classifier
from detect.liveness import Liveness
from detect.statuses import ErrorStatus, Severity
from tests.unicornd.coord_world import task, world
from unicorn_core.config import AgentConfig, DetectConfig
from unicorn_core.errors import ProtocolError
from unicorn_core.protocol import Heartbeat, encode
from unicornd.detector import Detector
from unicornd.seed import decode_beat, expected_agents, silences
from unicornd.state import Incident, RequeueWait, Snapshot, TaskState

NOW = 1_800_000_000.0
GRACE = 30.0
TTL = 5.0


def beat(job: int, node: str, age_s: float) -> Heartbeat:
    return Heartbeat(
        job_id=job, node=node, wall_time_s=NOW - age_s, agent_pid=10, pids=[11], iteration=3, seq=7
    )


def snap_with(
    requeue: RequeueWait | None = None,
    first_iteration_s: float | None = NOW - 590,
    last_iteration_s: float | None = NOW - 2,
) -> Snapshot:
    a = task(
        "a",
        1,
        ["n1", "n2"],
        launched_s=NOW - 600,
        requeue=requeue,
        first_iteration_s=first_iteration_s,
        last_iteration_s=last_iteration_s,
    )
    b = task("b", 2, ["n3"], launched_s=NOW - 5)
    done = task("c", 3, ["n4"], state=TaskState.FINISHED, launched_s=NOW - 600)
    return world(4, [a, b, done])


def test_the_keys_say_how_long_each_agent_has_been_silent() -> None:
    snap = snap_with()
    assert expected_agents(snap) == [(1, "n1"), (1, "n2"), (2, "n3")]
    beats = {(1, "n1"): beat(1, "n1", 0.4), (1, "n2"): None, (2, "n3"): None}
    # n1 beat 0.4 s ago; n2's key expired although its task was launched 10 min ago (silent
    # at least the key's TTL); n3's task was launched 5 s ago: its agent may be starting.
    assert silences(snap, beats, NOW, GRACE, TTL) == {(1, "n1"): pytest.approx(0.4), (1, "n2"): TTL}
    # Not settled, so an absent key may be an agent being started: no iteration since the
    # launch, or an incident open (an agent restart or a relaunch under way).
    quiet = snap_with(first_iteration_s=None, last_iteration_s=NOW - 700)
    assert silences(quiet, beats, NOW, GRACE, TTL) == {(1, "n1"): pytest.approx(0.4)}
    before = snap_with(first_iteration_s=NOW - 700, last_iteration_s=NOW - 700)  # the launch before
    assert silences(before, beats, NOW, GRACE, TTL) == {(1, "n1"): pytest.approx(0.4)}
    # Relaunched from a checkpoint below the old mark: the mark's time has not moved since
    # the launch, but the launch has iterated, so its agents have beaten: settled.
    below = snap_with(first_iteration_s=NOW - 590, last_iteration_s=NOW - 700)
    assert silences(below, beats, NOW, GRACE, TTL) == {(1, "n1"): pytest.approx(0.4), (1, "n2"): TTL}
    inc = Incident(
        incident_id="a.1",
        task_id="a",
        node="n2",
        rank=None,
        status=ErrorStatus.LOST_CONNECTION,
        severity=Severity.SEV2,
        rule="agent_lost",
        evidence="",
        opened_s=NOW - 10,
    )
    busy = snap.apply(incidents=[inc])
    assert silences(busy, beats, NOW, GRACE, TTL) == {(1, "n1"): pytest.approx(0.4)}


def test_no_seed_for_unreadable_or_foreign_keys_or_jobs_being_requeued() -> None:
    snap = snap_with()
    beats = {(1, "n1"): beat(1, "n9", 0.1), (2, "n3"): beat(2, "n3", 1.0)}  # n2: unreadable
    assert silences(snap, beats, NOW, GRACE, TTL) == {(2, "n3"): pytest.approx(1.0)}
    requeued = snap_with(requeue=RequeueWait(action_id="plan-1/a/requeue", deadline_s=NOW + 60))
    assert (1, "n1") not in expected_agents(requeued)
    # A clock ahead of ours: silent 0, never negative.
    assert silences(snap, {(1, "n1"): beat(1, "n1", -3.0)}, NOW, GRACE, TTL) == {(1, "n1"): 0.0}


def test_a_seeded_silence_expires_on_the_heartbeat_timeout_not_the_new_agents_grace() -> None:
    cfg = DetectConfig()
    det = Detector(cfg, AgentConfig(), load_classifier(None))
    snap = snap_with()
    det.expect_running(snap, 100.0)
    assert det.liveness.initial_timeout_s >= GRACE
    # Unseeded, every agent gets the grace: still waiting 10 s later.
    assert det.liveness.state(1, "n2", 110.0) is Liveness.WAITING
    det.seed_silence(1, "n2", TTL, 100.0)
    det.seed_silence(1, "n1", 0.4, 100.0)
    assert det.silent(1, "n2", 100.0)  # TTL 5 s > the 1.5 s timeout: expired at once
    assert not det.silent(1, "n1", 100.0)
    assert det.silent(1, "n1", 100.0 - 0.4 + cfg.heartbeat_timeout_s + 0.01)
    assert det.liveness.state(2, "n3", 110.0) is Liveness.WAITING  # not seeded: the grace
    # A beat read after the seed moves it forward; a seed never moves a beat back.
    det.liveness.beat(1, "n2", 101.0)
    det.seed_silence(1, "n2", 50.0, 101.0)
    assert det.liveness.state(1, "n2", 101.5) is Liveness.ALIVE


def test_a_key_decodes_to_its_agents_heartbeat_only() -> None:
    raw = encode(beat(1, "n1", 0.5))
    assert decode_beat(raw, (1, "n1")) == beat(1, "n1", 0.5)
    assert decode_beat(raw, (1, "n2")) is None and decode_beat(raw, (2, "n1")) is None
    with pytest.raises(ProtocolError):
        decode_beat(b"\x00garbage", (1, "n1"))
