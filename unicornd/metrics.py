"""Prometheus metrics of unicornd, computed from its snapshot, and the HTTP endpoint.

:class:`SnapshotMetrics` owns a private registry (no module-level singleton). The daemon
calls :meth:`SnapshotMetrics.update` with each snapshot it commits. Gauges are computed
from the latest snapshot when Prometheus scrapes, so a task or node that leaves the
snapshot leaves the metrics too:

=========================================  ===============================================
``unicorn_tasks{state}``                   tasks per :class:`TaskState` (0 included)
``unicorn_task_state{task,state}``         1, for the task's current state
``unicorn_task_weight{task}``              the task's weight
``unicorn_task_gpus{task}``                GPUs of its layout (0 without one)
``unicorn_task_last_iteration{task}``      highest iteration reported (tasks that have one)
``unicorn_task_waf_tflops{task}``          weight x planned TFLOP/s of its layout while it
                                           runs, else 0 (Unicron's F; only with a GPU type)
``unicorn_waf_tflops``                     their sum: the cluster's weighted achieved FLOP/s
``unicorn_nodes{health}``                  nodes per :class:`NodeHealth` (0 included)
``unicorn_node_health{node,health}``       1, for the node's health
``unicorn_nodes_held``                     nodes held drained until an operator resumes them
``unicorn_open_incidents{status,severity}``  open incidents
``unicorn_open_incidents_by_stage{stage}``   open incidents per ladder stage
``unicorn_plan_generation``                plans applied so far
=========================================  ===============================================

Observed once per incident by :meth:`~SnapshotMetrics.update` (process-local: after a
restart the closed incidents still in the snapshot, the last 24 h, are observed again,
which Prometheus reads as a counter reset):

* ``unicorn_incidents_total{status,severity}``: incidents seen (severity when first seen).
* ``unicorn_incident_reaction_seconds{severity}``: from detection to the first ladder
  rung (the finding classified and acted on), per closed incident. The time from the
  fault itself to its detection is not in the snapshot (incidents carry no fault time).
* ``unicorn_incident_recovery_seconds{severity}``: from detection to ``resumed``, per
  closed incident that resumed (one closed because its task ended is not a recovery).

From the goodput ledger (:mod:`unicornd.goodput`; :meth:`~SnapshotMetrics.update_ledger`),
cumulative since the ledger started (it is kept in Redis, so they survive restarts):

* ``unicorn_goodput_gpu_seconds_total``, ``unicorn_goodput_productive_gpu_seconds_total``
  and ``unicorn_goodput_lost_gpu_seconds_total{cause}``: GPU-seconds accounted, productive,
  lost by :class:`~unicornd.goodput.Cause`;
* gauges ``unicorn_goodput_{ideal,achieved}_wtflop`` and
  ``unicorn_goodput_lost_wtflop{cause}``: weighted TFLOP (a cause can be negative);
* gauges ``unicorn_goodput_achieved_waf_tflops`` (measured, now),
  ``unicorn_goodput_ideal_waf_tflops`` (W* now) and
  ``unicorn_goodput_task_achieved_waf_tflops{task}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from threading import Thread
from typing import Final
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plan.hardware import GpuSpec
from plan.perf import estimate_layout
from unicorn_core.config import MetricsConfig
from unicorn_core.errors import ConfigError, InvalidArgument
from unicornd.alerts import incident_milestones
from unicornd.goodput import Cause, Ledger
from unicornd.state import NodeHealth, Snapshot, TaskRecord, TaskState

LATENCY_BUCKETS_S: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""From sub-second reactions to recoveries that wait for a transition (up to
``Policy.transition_timeout_s`` = 600 s) and beyond, when an operator was involved."""


class SnapshotMetrics:
    """Metrics of the latest snapshot (see the module docstring); ``registry`` is what to serve.

    ``gpu``: the nodes' GPU type, for WAF; None leaves the WAF metrics out. Thread-safe
    for one updater (the daemon loop) and any number of scrapes: a scrape reads the
    snapshot reference once, and snapshots are immutable.
    """

    def __init__(self, *, gpu: GpuSpec | None = None) -> None:
        self.registry = CollectorRegistry()
        self.gpu = gpu
        self._snap: Snapshot | None = None
        self.ledger: Ledger | None = None
        self._seen: set[str] = set()
        self._observed: set[str] = set()
        self.incidents = Counter(
            "unicorn_incidents",
            "Incidents seen, by root-cause status and severity when first seen.",
            ["status", "severity"],
            registry=self.registry,
        )
        self.reaction = Histogram(
            "unicorn_incident_reaction_seconds",
            "Seconds from an incident's detection to its first ladder rung, per closed incident.",
            ["severity"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.recovery = Histogram(
            "unicorn_incident_recovery_seconds",
            "Seconds from an incident's detection until its task resumed, per closed incident that resumed.",
            ["severity"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(self))

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snap

    def update(self, snap: Snapshot) -> None:
        """Take ``snap`` as the current state; count new incidents, observe newly closed ones."""
        for inc in sorted(snap.incidents.values(), key=lambda i: (i.opened_s, i.incident_id)):
            severity = inc.severity.value
            if inc.incident_id not in self._seen:
                self._seen.add(inc.incident_id)
                self.incidents.labels(inc.status.value, severity).inc()
            if inc.is_open or inc.incident_id in self._observed:
                continue
            self._observed.add(inc.incident_id)
            since = incident_milestones(inc).since_detected()
            if "classified" in since:
                self.reaction.labels(severity).observe(since["classified"])
            if "resumed" in since:
                self.recovery.labels(severity).observe(since["resumed"])
        # Incidents pruned from the snapshot never come back: forget them (bounded memory).
        self._seen &= snap.incidents.keys()
        self._observed &= snap.incidents.keys()
        self._snap = snap

    def update_ledger(self, ledger: Ledger | None) -> None:
        """Take ``ledger`` as the current goodput ledger (None: none kept, no goodput metrics)."""
        self.ledger = ledger

    def task_waf_tflops(self, task: TaskRecord, gpus_per_node: int) -> float | None:
        """Unicron's F for the task as it runs now: weight x planned TFLOP/s of its layout
        (0 unless running); None without a GPU type or when the layout does not fit the model."""
        if self.gpu is None:
            return None
        if task.state is not TaskState.RUNNING or task.layout is None:
            return 0.0
        try:
            return task.weight * estimate_layout(task.model, task.layout, self.gpu, gpus_per_node).tflops
        except InvalidArgument:
            return None


class _SnapshotCollector(Collector):
    """Gauges computed from the latest snapshot at scrape time."""

    def __init__(self, owner: SnapshotMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        snap = self.owner.snapshot
        if snap is None:
            return
        yield from self._tasks(snap)
        yield from _nodes(snap)
        yield from _incidents(snap)
        if self.owner.ledger is not None:
            yield from goodput_metrics(self.owner.ledger)
        yield GaugeMetricFamily(
            "unicorn_plan_generation", "Plans applied so far.", value=snap.plan_generation
        )

    def _tasks(self, snap: Snapshot) -> Iterator[Metric]:
        tasks = sorted(snap.tasks.values(), key=lambda t: t.task_id)
        by_state = GaugeMetricFamily("unicorn_tasks", "Tasks per state.", labels=["state"])
        for state in TaskState:
            by_state.add_metric([state.value], sum(1 for t in tasks if t.state is state))
        task_state = GaugeMetricFamily(
            "unicorn_task_state", "1 for each task's current state.", labels=["task", "state"]
        )
        weight = GaugeMetricFamily("unicorn_task_weight", "Task weight (planner priority).", labels=["task"])
        gpus = GaugeMetricFamily("unicorn_task_gpus", "GPUs of the task's current layout.", labels=["task"])
        iteration = GaugeMetricFamily(
            "unicorn_task_last_iteration", "Highest iteration the task reported.", labels=["task"]
        )
        waf = GaugeMetricFamily(
            "unicorn_task_waf_tflops",
            "Weight x planned TFLOP/s of the task's layout while it runs, else 0.",
            labels=["task"],
        )
        total_waf = 0.0
        for t in tasks:
            task_state.add_metric([t.task_id, t.state.value], 1)
            weight.add_metric([t.task_id], t.weight)
            gpus.add_metric([t.task_id], t.layout.world_size if t.layout else 0)
            if t.last_iteration is not None:
                iteration.add_metric([t.task_id], t.last_iteration)
            f = self.owner.task_waf_tflops(t, snap.gpus_per_node)
            if f is not None:
                waf.add_metric([t.task_id], f)
                total_waf += f
        yield from (by_state, task_state, weight, gpus, iteration)
        if self.owner.gpu is not None:
            yield waf
            yield GaugeMetricFamily(
                "unicorn_waf_tflops", "Sum of the tasks' weighted planned TFLOP/s.", value=total_waf
            )


def goodput_metrics(ledger: Ledger) -> Iterator[Metric]:
    """The goodput ledger's metrics (see the module docstring)."""
    t = ledger.totals
    yield CounterMetricFamily(
        "unicorn_goodput_gpu_seconds", "GPU-seconds accounted by the goodput ledger.", value=t.gpu_s
    )
    yield CounterMetricFamily(
        "unicorn_goodput_productive_gpu_seconds",
        "GPU-seconds that advanced training at the calibrated rate.",
        value=t.productive_gpu_s,
    )
    lost = CounterMetricFamily(
        "unicorn_goodput_lost_gpu_seconds", "GPU-seconds lost, by cause.", labels=["cause"]
    )
    lost_work = GaugeMetricFamily(
        "unicorn_goodput_lost_wtflop", "Weighted TFLOP of the gap to the ideal, by cause.", labels=["cause"]
    )
    for c in Cause:
        lost.add_metric([c.value], t.lost_gpu_s.get(c, 0.0))
        lost_work.add_metric([c.value], t.lost_wtflop.get(c, 0.0))
    yield from (lost, lost_work)
    yield GaugeMetricFamily(
        "unicorn_goodput_ideal_wtflop", "Weighted TFLOP the ideal would have done.", value=t.ideal_wtflop
    )
    yield GaugeMetricFamily(
        "unicorn_goodput_achieved_wtflop", "Weighted TFLOP achieved (measured).", value=t.achieved_wtflop
    )
    yield GaugeMetricFamily(
        "unicorn_goodput_achieved_waf_tflops",
        "Achieved WAF now: weight x model FLOP/s of the running tasks' measured iterations.",
        value=ledger.achieved_wtflops(),
    )
    yield GaugeMetricFamily(
        "unicorn_goodput_ideal_waf_tflops",
        "Ideal WAF now: the planner's best failure-free allocation, calibrated.",
        value=ledger.ideal_wtflops(),
    )
    per_task = GaugeMetricFamily(
        "unicorn_goodput_task_achieved_waf_tflops", "A task's measured WAF now.", labels=["task"]
    )
    for tid, book in sorted(ledger.tasks.items()):
        per_task.add_metric([tid], book.achieved_wtflops if book.phase == "running" else 0.0)
    yield per_task


def _nodes(snap: Snapshot) -> Iterator[Metric]:
    nodes = sorted(snap.nodes.values(), key=lambda n: n.name)
    by_health = GaugeMetricFamily("unicorn_nodes", "Nodes per health state.", labels=["health"])
    for health in NodeHealth:
        by_health.add_metric([health.value], sum(1 for n in nodes if n.health is health))
    node_health = GaugeMetricFamily(
        "unicorn_node_health", "1 for each node's health state.", labels=["node", "health"]
    )
    for n in nodes:
        node_health.add_metric([n.name, n.health.value], 1)
    held = GaugeMetricFamily(
        "unicorn_nodes_held",
        "Nodes held drained until an operator resumes them.",
        value=sum(1 for n in nodes if n.held),
    )
    yield from (by_health, node_health, held)


def _incidents(snap: Snapshot) -> Iterator[Metric]:
    open_incidents = [i for i in snap.incidents.values() if i.is_open]
    counts: dict[tuple[str, str], int] = {}
    stages: dict[str, int] = {}
    for i in open_incidents:
        key = (i.status.value, i.severity.value)
        counts[key] = counts.get(key, 0) + 1
        stages[i.stage.value] = stages.get(i.stage.value, 0) + 1
    by_kind = GaugeMetricFamily(
        "unicorn_open_incidents", "Open incidents by status and severity.", labels=["status", "severity"]
    )
    for (status, severity), n in sorted(counts.items()):
        by_kind.add_metric([status, severity], n)
    by_stage = GaugeMetricFamily(
        "unicorn_open_incidents_by_stage", "Open incidents by ladder stage.", labels=["stage"]
    )
    for stage, n in sorted(stages.items()):
        by_stage.add_metric([stage], n)
    yield from (by_kind, by_stage)


@dataclass
class MetricsServer:
    """A running metrics endpoint (a daemon thread); :meth:`close` stops it."""

    host: str
    port: int
    server: WSGIServer
    thread: Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(cfg: MetricsConfig, metrics: SnapshotMetrics) -> MetricsServer | None:
    """Serve ``metrics.registry`` on ``cfg.listen`` (None when it is empty).

    Raises ``ConfigError`` when the address cannot be bound (in use, not local): the
    daemon fails at start rather than run without the metrics it was told to serve.
    """
    address = cfg.address()
    if address is None:
        return None
    host, port = address
    try:
        server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as e:
        raise ConfigError(f"metrics.listen = {cfg.listen!r}: cannot listen: {e.strerror or e}") from e
    return MetricsServer(host, int(server.server_address[1]), server, thread)
