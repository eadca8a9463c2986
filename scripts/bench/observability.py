#!/usr/bin/env python3
"""Cost of unicornd's observability per decision and per scrape (issue 9): prints one JSON object.

A cluster of ``--nodes`` nodes with ``--tasks`` tasks (half running, half recovering
with an open incident) and ``--incidents`` closed incidents, each with a full ladder timeline:

- ``alerts_for_s``: median time of :func:`unicornd.alerts.alerts_for` for one decision
  that opens one incident on that snapshot (it runs after every committed decision);
- ``metrics_update_s``: :meth:`SnapshotMetrics.update` on a snapshot already seen (the
  steady state: nothing new to observe);
- ``scrape_s``: one ``GET /metrics`` over HTTP from the endpoint, WAF included;
- ``snapshot_json_s``: ``snapshot_to_json`` of the same snapshot, which unicornd already
  pays on every commit: the yardstick. ``*_over_commit`` are the ratios to it, measured in
  the same run.

Run: ``nice -n 10 .venv/bin/python scripts/bench/observability.py [--nodes 512 --tasks 32 --incidents 500]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from collections.abc import Callable

from detect.statuses import ErrorStatus, Severity
from plan.hardware import gpu_spec
from unicorn_core.config import MetricsConfig
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec
from unicornd.alerts import alerts_for
from unicornd.metrics import SnapshotMetrics, start_metrics_server
from unicornd.state import (
    Incident,
    LadderStage,
    NodeRecord,
    Snapshot,
    StageEntry,
    TaskRecord,
    TaskState,
)
from unicornd.store import snapshot_to_json

L = LadderStage
T0 = 1_700_000_000.0
MODEL = ModelSpec(layers=24, hidden=2048, heads=16, sequence=2048, vocabulary=50257, global_batch=512)
GPN = 8


def build(nodes: int, tasks: int, incidents: int) -> Snapshot:
    per = nodes // tasks
    recs = {}
    for t in range(tasks):
        names = tuple(f"n{t * per + i}" for i in range(per))
        recs[f"t{t}"] = TaskRecord(
            task_id=f"t{t}", name=f"t{t}", model=MODEL, command=("train",), job_id=t + 1,
            state=TaskState.RUNNING if t % 2 == 0 else TaskState.RECOVERING, nodes=names,
            layout=Layout(tp=1, pp=1, dp=per * GPN, micro_batch=1, global_batch=512),
            last_iteration=100, weight=0.5 + 0.5 * (t % 3),
        )  # fmt: skip
    node_recs = {f"n{i}": NodeRecord(f"n{i}") for i in range(nodes)}
    stages = (L.DETECTED, L.ISOLATE, L.REPLAN, L.TRANSITION, L.RESUMED, L.CLOSED)
    incs = {}
    for k in range(incidents):
        t0 = T0 + 100.0 * k
        timeline = tuple(StageEntry(s, t0 + 5.0 * j) for j, s in enumerate(stages))
        incs[f"c.{k}"] = Incident(
            incident_id=f"c.{k}", task_id=f"t{k % tasks}", node=f"n{k % nodes}", rank=0,
            status=ErrorStatus.ECC_ERROR, severity=Severity.SEV1, rule="r", evidence="e", opened_s=t0,
            stage=L.CLOSED, timeline=timeline,
        )  # fmt: skip
    for t in range(1, tasks, 2):  # the recovering tasks
        t0 = T0 + 100.0 * incidents
        incs[f"t{t}.1"] = Incident(
            incident_id=f"t{t}.1", task_id=f"t{t}", node=recs[f"t{t}"].nodes[0], rank=0,
            status=ErrorStatus.TASK_HANG, severity=Severity.SEV2, rule="r", evidence="e", opened_s=t0,
            stage=L.RESTART_PROCESSES,
            timeline=(StageEntry(L.DETECTED, t0), StageEntry(L.RESTART_PROCESSES, t0)),
        )  # fmt: skip
    return Snapshot(tasks=recs, nodes=node_recs, gpus_per_node=GPN, incidents=incs)


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--incidents", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=21)
    args = ap.parse_args()
    snap = build(args.nodes, args.tasks, args.incidents)
    before = snap
    new = Incident(
        incident_id="new.1", task_id="t0", node="n0", rank=0, status=ErrorStatus.ECC_ERROR,
        severity=Severity.SEV1, rule="r", evidence="e", opened_s=T0 + 1e6,
        timeline=(StageEntry(L.DETECTED, T0 + 1e6),),
    )  # fmt: skip
    after = snap.apply(incidents=[new])
    assert len(alerts_for(before, after, T0 + 1e6)) == 1
    metrics = SnapshotMetrics(gpu=gpu_spec("a100-80g"))
    metrics.update(snap)
    server = start_metrics_server(MetricsConfig(listen="127.0.0.1:0"), metrics)
    assert server is not None

    def scrape() -> int:
        with urllib.request.urlopen(server.url, timeout=30) as r:
            return len(r.read())

    try:
        scrape_bytes = scrape()
        commit = median_s(lambda: snapshot_to_json(snap), args.repeat)
        alerts = median_s(lambda: alerts_for(before, after, T0 + 1e6), args.repeat)
        update = median_s(lambda: metrics.update(snap), args.repeat)
        scrape_s = median_s(scrape, args.repeat)
    finally:
        server.close()
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "tasks": args.tasks,
                "closed_incidents": args.incidents,
                "repeat": args.repeat,
                "snapshot_json_s": commit,
                "alerts_for_s": alerts,
                "metrics_update_s": update,
                "scrape_s": scrape_s,
                "scrape_bytes": scrape_bytes,
                "alerts_for_over_commit": alerts / commit,
                "metrics_update_over_commit": update / commit,
            }
        )
    )


if __name__ == "__main__":
    main()
