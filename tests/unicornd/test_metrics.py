"""unicornd's Prometheus metrics, scraped over HTTP from a real endpoint."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from detect.statuses import ErrorStatus
from plan.hardware import gpu_spec
from plan.perf import estimate_layout
from tests.unicornd.coord_world import apply, finding, plan, render, task, world
from unicorn_core.config import MetricsConfig, load_config
from unicorn_core.errors import ConfigError
from unicornd.decide import on_finding, on_progress
from unicornd.metrics import MetricsServer, SnapshotMetrics, start_metrics_server
from unicornd.replan import plan_transition
from unicornd.state import KEEP_CLOSED_S, NodeHealth, Snapshot, TaskState
from unicornd.store import prune

E = ErrorStatus
T0 = 1_700_000_000.0
GPU = gpu_spec("a100-80g")


def scenario() -> tuple[Snapshot, float, float]:
    """a: an ECC error on n2, replanned at +3 s, resumed at +40 s (closed); b: a hang, open.
    Returns the snapshot and the seconds from a.1's detection to its transition and resume."""
    snap = world(
        8,
        [
            task("a", 1, ["n1", "n2"], weight=2.0),
            task("b", 2, ["n3", "n4"]),
            task("c", 3, [], state=TaskState.PENDING),
        ],
    )
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n2", E.ECC_ERROR), T0))
    snap = apply(snap, plan_transition(snap, plan({"a": 2, "b": 4, "c": 0}), render, T0 + 3))
    snap = apply(snap, on_progress(snap, "a", 11, T0 + 40))
    snap = apply(snap, on_finding(snap, finding("f2", 2, "n3", E.TASK_HANG), T0 + 41))
    return snap, 3.0, 40.0


@pytest.fixture
def served() -> Iterator[tuple[SnapshotMetrics, MetricsServer]]:
    metrics = SnapshotMetrics(gpu=GPU)
    server = start_metrics_server(MetricsConfig(listen="127.0.0.1:0"), metrics)
    assert server is not None
    try:
        yield metrics, server
    finally:
        server.close()


def scrape(server: MetricsServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(server.url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_scrape_reports_the_snapshot(served: tuple[SnapshotMetrics, MetricsServer]) -> None:
    metrics, server = served
    snap, _, _ = scenario()
    metrics.update(snap)
    got = scrape(server)
    for state in TaskState:
        expected = sum(1 for t in snap.tasks.values() if t.state is state)
        assert value(got, "unicorn_tasks", state=state.value) == expected
    for t in snap.tasks.values():
        assert value(got, "unicorn_task_state", task=t.task_id, state=t.state.value) == 1
        assert value(got, "unicorn_task_weight", task=t.task_id) == t.weight
        assert value(got, "unicorn_task_gpus", task=t.task_id) == (t.layout.world_size if t.layout else 0)
    assert value(got, "unicorn_task_last_iteration", task="a") == snap.tasks["a"].last_iteration
    for health in NodeHealth:
        expected = sum(1 for n in snap.nodes.values() if n.health is health)
        assert value(got, "unicorn_nodes", health=health.value) == expected
    assert value(got, "unicorn_node_health", node="n2", health=snap.nodes["n2"].health.value) == 1
    assert value(got, "unicorn_nodes_held") == sum(n.held for n in snap.nodes.values())
    b1 = snap.incidents["b.1"]
    assert value(got, "unicorn_open_incidents", status=b1.status.value, severity=b1.severity.value) == 1
    assert value(got, "unicorn_open_incidents_by_stage", stage=b1.stage.value) == 1
    a1 = snap.incidents["a.1"]
    assert not a1.is_open
    assert (
        "unicorn_open_incidents",
        (("severity", a1.severity.value), ("status", a1.status.value)),
    ) not in got
    assert value(got, "unicorn_plan_generation") == snap.plan_generation


def test_waf_is_weight_times_planned_tflops_of_running_tasks(
    served: tuple[SnapshotMetrics, MetricsServer],
) -> None:
    metrics, server = served
    snap, _, _ = scenario()
    metrics.update(snap)
    got = scrape(server)
    expected = {}
    for t in snap.tasks.values():
        running = t.state is TaskState.RUNNING and t.layout is not None
        est = estimate_layout(t.model, t.layout, GPU, snap.gpus_per_node).tflops if running else 0.0  # type: ignore[arg-type]
        expected[t.task_id] = t.weight * est
        assert value(got, "unicorn_task_waf_tflops", task=t.task_id) == pytest.approx(expected[t.task_id])
    assert expected["a"] > 0 and expected["b"] == 0, "a runs again, b is recovering"
    assert value(got, "unicorn_waf_tflops") == pytest.approx(sum(expected.values()))


def test_latency_histograms_observe_each_closed_incident_once(
    served: tuple[SnapshotMetrics, MetricsServer],
) -> None:
    metrics, server = served
    snap, _, resumed_after_s = scenario()
    metrics.update(snap)
    metrics.update(snap)  # the same closed incident again: not observed twice
    got = scrape(server)
    sev = snap.incidents["a.1"].severity.value
    assert value(got, "unicorn_incident_recovery_seconds_count", severity=sev) == 1
    assert value(got, "unicorn_incident_recovery_seconds_sum", severity=sev) == resumed_after_s
    assert value(got, "unicorn_incident_reaction_seconds_count", severity=sev) == 1
    assert value(got, "unicorn_incident_reaction_seconds_sum", severity=sev) == 0.0, "same decision"
    assert value(got, "unicorn_incident_recovery_seconds_bucket", severity=sev, le="30.0") == 0
    assert value(got, "unicorn_incident_recovery_seconds_bucket", severity=sev, le="60.0") == 1
    b1 = snap.incidents["b.1"]
    assert value(got, "unicorn_incidents_total", status=b1.status.value, severity=b1.severity.value) == 1
    assert sum(v for (name, _), v in got.items() if name == "unicorn_incidents_total") == len(snap.incidents)
    # Pruned incidents are forgotten and never come back.
    metrics.update(prune(snap, T0 + 40 + KEEP_CLOSED_S + 1))
    assert metrics._observed == set()  # bounded memory


def test_without_gpu_type_no_waf_and_without_snapshot_nothing() -> None:
    metrics = SnapshotMetrics()
    server = start_metrics_server(MetricsConfig(listen="127.0.0.1:0"), metrics)
    assert server is not None
    try:
        assert not any(name.startswith("unicorn_task") for name, _ in scrape(server))
        metrics.update(scenario()[0])
        got = scrape(server)
        assert ("unicorn_task_weight", (("task", "a"),)) in got
        assert not any("waf" in name for name, _ in got)
    finally:
        server.close()


def test_endpoint_off_bad_or_taken() -> None:
    assert start_metrics_server(MetricsConfig(), SnapshotMetrics()) is None
    with pytest.raises(ConfigError, match='listen = "localhost"'):
        load_config(env={"UNICORN_METRICS__LISTEN": "localhost"})
    assert load_config(env={"UNICORN_METRICS__LISTEN": "[::1]:9464"}).metrics.address() == ("::1", 9464)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="cannot listen"):
            start_metrics_server(MetricsConfig(listen=f"127.0.0.1:{port}"), SnapshotMetrics())
