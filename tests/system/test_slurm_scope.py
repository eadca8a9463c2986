"""[slurm] scope on a real cluster with two partitions: gpu (n1-n3, unicorn's) and cpu (n4).

Another user's job runs in cpu and on one gpu node (n3). With ``partitions = ["gpu"]``
unicornd's snapshot holds n1-n3 only; n3 is shown not ours and is no planner input;
``unicornctl drain`` refuses n4 (outside) and n3 (not ours) with exit 2 and changes
nothing in Slurm; a partition Slurm lacks fails ``unicornd --check``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DevCluster, private_cluster
from tests.system.coordinator import UNICORND, coordinator
from unicornd.state import NodeHealth

pytestmark = pytest.mark.system

UNICORNCTL = Path(sys.executable).parent / "unicornctl"


@pytest.fixture(scope="module")
def two_partitions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with private_cluster(
        tmp_path_factory, "scope", "--nodes", "4", "--gpus-per-node", "2", "--cpu-nodes", "1"
    ) as c:
        yield c


def _foreign_job(cluster: DevCluster, *options: str) -> str:
    out = cluster.slurm(
        "sbatch", "--parsable", "--job-name=etl", "--output=/dev/null", *options, "--wrap=sleep 600"
    )
    job = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 30
    while cluster.slurm("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} did not start"
        time.sleep(0.2)
    return job


def _ctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(UNICORNCTL), *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_dev_cluster_has_two_partitions(two_partitions: DevCluster) -> None:
    out = two_partitions.slurm("sinfo", "-h", "-N", "-o", "%N %P").stdout.split("\n")
    assert sorted(line.strip() for line in out if line.strip()) == ["n1 gpu*", "n2 gpu*", "n3 gpu*", "n4 cpu"]


@pytest.mark.skipif(os.geteuid() != 0, reason="unicornctl drain needs an operator (root here)")
def test_unicornd_manages_only_its_partition_and_leaves_other_users_nodes_alone(
    two_partitions: DevCluster, tmp_path: Path
) -> None:
    cluster = two_partitions
    on_cpu = _foreign_job(cluster, "--partition=cpu", "--nodes=1")
    on_n3 = int(_foreign_job(cluster, "--partition=gpu", "--nodelist=n3", "--nodes=1"))
    try:
        with coordinator(cluster, tmp_path, UNICORN_SLURM__PARTITIONS="gpu") as c:
            snap = c.wait(
                lambda s: s.nodes.get("n3") is not None and s.foreign_jobs("n3") == (on_n3,), "n3 not ours"
            )
            assert sorted(snap.nodes) == ["n1", "n2", "n3"]  # n4 (cpu) never enters the snapshot
            assert snap.plannable() == ["n1", "n2"]  # the planner's nodes: never n3

            status = _ctl(c.env, "status", "--json")
            assert status.returncode == 0, status.stderr
            nodes = {n["name"]: n for n in json.loads(status.stdout)["nodes"]}
            assert nodes["n3"]["scope"] == "not ours" and nodes["n3"]["other_jobs"] == [on_n3]
            assert nodes["n4"]["scope"] == "outside" and nodes["n1"]["scope"] == "ours"
            text = _ctl(c.env, "status").stdout
            assert f"[not ours: jobs {on_n3}]" in text and "[outside scope]" in text

            refused = _ctl(c.env, "drain", "n4", "--reason", "test", "--yes")
            assert refused.returncode == 2, refused.stderr
            assert "n4 is in cpu, not in [slurm] partitions = ['gpu']" in refused.stderr
            assert "nothing changed" in refused.stderr
            refused = _ctl(c.env, "drain", "n3", "--reason", "test", "--yes")
            assert refused.returncode == 2, refused.stderr
            assert f"other users' jobs [{on_n3}]" in refused.stderr
            refused = _ctl(c.env, "resume", "n4", "--yes")
            assert refused.returncode == 2 and "outside unicorn's scope" in refused.stderr
            states = cluster.slurm("sinfo", "-h", "-N", "-n", "n3,n4", "-o", "%N %T").stdout
            assert "drain" not in states, states
            now = c.snapshot()
            assert now is not None and now.nodes["n3"].health is NodeHealth.HEALTHY

            # The foreign job on n3 ends: n3 becomes unicorn's to plan.
            cluster.slurm("scancel", str(on_n3))
            snap = c.wait(lambda s: s.foreign_jobs("n3") == (), "n3 free of the foreign job")
            assert snap.plannable() == ["n1", "n2", "n3"]
    finally:
        cluster.slurm("scancel", on_cpu, str(on_n3), check=False)


def test_an_unknown_partition_fails_unicornd_check(two_partitions: DevCluster) -> None:
    env = {**os.environ, **two_partitions.env, "UNICORN_SLURM__PARTITIONS": "gpu,nope"}
    res = subprocess.run(
        [str(UNICORND), "--check"], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert res.returncode == 1
    assert "['nope'], which Slurm does not have; its partitions: gpu, cpu" in res.stdout + res.stderr
