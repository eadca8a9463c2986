"""Redis Sentinel on the real dev cluster (`dev-cluster up --redis sentinel`: a primary, its
replica and three sentinels, quorum 2). unicornd, its agents and unicornctl follow a
failover; nothing an agent or a test wrote (and the replica acknowledged) is lost."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from tests.conftest import DevCluster, private_cluster
from tests.system.coordinator import Coordinator, Supervisor, coordinator
from tests.system.test_unicornd import running, task, unicornctl
from unicorn_core.keys import PAYLOAD_FIELD
from unicorn_core.protocol import FaultReport, encode
from unicornd.state import NodeHealth, TaskRecord

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def sentinel_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with private_cluster(
        tmp_path_factory, "sentinel", "--nodes", "2", "--gpus-per-node", "1", "--redis", "sentinel"
    ) as c:
        yield c


def inject_replicated(c: Coordinator, a: TaskRecord, node: str, evidence: str) -> bytes:
    """An agent's SEV2 exception report for ``a`` on ``node``, written to the primary and
    acknowledged by the replica (WAIT on the same connection) before this returns."""
    report = FaultReport(
        job_id=a.job_id or 0,
        node=node,
        wall_time_s=time.time(),
        status="other_software_error",
        severity="SEV2",
        rule="injected",
        rank=1,
        evidence=evidence,
    )
    with c.client() as r:
        entry = cast(bytes, r.xadd(c.keys.events(report.job_id), {PAYLOAD_FIELD: encode(report)}))
        assert int(cast(int, r.execute_command("WAIT", 1, 5000))) >= 1, "the replica did not acknowledge"
    return entry


def primary_port(cluster: DevCluster) -> int | None:
    """The port a majority of the sentinels names as primary (None: no majority answered)."""
    status = json.loads(cluster.script("status", "--json").stdout)
    port = status["redis_primary_port"]
    return None if port is None else int(port)


@pytest.mark.timeout(600)
def test_a_sentinel_failover_during_a_recovery_loses_no_event(
    sentinel_cluster: DevCluster, tmp_path: Path
) -> None:
    """Two unicornd (restarted when they exit, as systemd does) and a task on both nodes.
    An exception report starts a recovery; the primary is SIGKILLed while it runs. The
    sentinels promote the replica; the report is decided, the recovery completes, the
    agents report iterations again (their Redis users made again on the new primary) and
    unicornctl reads the new primary's state."""
    with coordinator(sentinel_cluster, tmp_path) as c:
        sup = Supervisor(c, tmp_path)
        a = replace(task(c, "f", "n1,n2", 1.0, tmp_path), max_gpus=2)
        c.register(a)
        c.wait(running("f", 3), "f training", 240)
        before = primary_port(sentinel_cluster)
        inject_replicated(c, a, "n2", "RuntimeError: written before the failover (injected by the test)")
        c.wait(lambda s: s.open_incident("f") is not None, "the recovery started", 60)
        out = sentinel_cluster.script("failover-redis")
        moved = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"failover: {moved}; unicornd exits so far: {sup.exits}")
        assert moved["old_port"] == before and primary_port(sentinel_cluster) == moved["new_port"] != before
        snap = c.wait(
            lambda s: (
                any("before the failover" in i.evidence for i in s.incidents.values())
                and not any(i.is_open for i in s.incidents.values())
                and running("f", 0)(s)
            ),
            "the recovery completed on the new primary",
            240,
        )
        mark = snap.tasks["f"].last_iteration or 0
        snap = c.wait(running("f", mark + 3), "the agents reporting to the new primary", 180)
        assert all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values()), snap.nodes
        shown = unicornctl(c, "status", "--json")
        assert shown.returncode == 0, shown.stderr
        doc = json.loads(shown.stdout)["unicorn"]
        assert doc["daemon_alive"] and doc["leader"] is not None, doc
        (shown_task,) = [t for t in doc["tasks"] if t["task_id"] == "f"]
        assert shown_task["state"] == "running" and shown_task["last_iteration"] >= mark + 3, doc
