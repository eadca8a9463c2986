"""``unicorn-node-check`` (and its alias ``unicornctl node-check``): the paired check on the
dev cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DevCluster

pytestmark = pytest.mark.system

BIN = Path(sys.executable).parent


def node_check(
    cluster: DevCluster, *args: str, env: dict[str, str] | None = None, program: str = "unicorn-node-check"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / program), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **cluster.env, **(env or {})},
        check=False,
    )


def test_paired_check_names_the_bad_node(cluster: DevCluster) -> None:
    args = ("--paired", "n[1-4]", "--master-addr", "127.0.0.1", "--json")
    healthy = node_check(cluster, *args)
    assert healthy.returncode == 0, healthy.stderr
    doc = json.loads(healthy.stdout)
    assert doc["bad"] == [] and sorted(doc["cleared"]) == ["n1", "n2", "n3", "n4"]
    assert len(doc["tests"]) == 2  # round 1 only: two pairs, both passed

    sick = node_check(cluster, *args, env={"UNICORN_PAIRTEST_FAULT_NODE": "n3"})
    assert sick.returncode == 1, sick.stderr
    doc = json.loads(sick.stdout)
    assert doc["bad"] == ["n3"], doc
    failed = [t for t in doc["tests"] if not t["ok"]]
    assert all("n3" in t["nodes"] for t in failed) and len(doc["tests"]) > 2  # round 2 ran


def test_paired_check_rejects_unknown_nodes(cluster: DevCluster) -> None:
    bad = node_check(cluster, "--paired", "n1,nope9")
    assert bad.returncode == 2 and "unknown node" in bad.stderr
    # unicornctl's alias runs the same command.
    alias = node_check(cluster, "node-check", "--paired", "n1,nope9", program="unicornctl")
    assert alias.returncode == 2 and "unknown node" in alias.stderr
