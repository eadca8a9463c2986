"""scripts/dev-cluster itself: coexistence, exact stop, bad input."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.conftest import DevCluster, pid_alive, start_cluster

pytestmark = pytest.mark.system


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def status(c: DevCluster) -> dict[str, object]:
    result: dict[str, object] = json.loads(c.script("status", "--json", check=False).stdout)
    return result


def test_two_clusters_coexist_and_down_stops_only_its_own(cluster: DevCluster, tmp_path: Path) -> None:
    second = start_cluster(tmp_path / "second", "--nodes", "2", "--gpus-per-node", "0")
    try:
        assert second.slurm_conf != cluster.slurm_conf and second.redis_url != cluster.redis_url
        s2 = status(second)
        assert s2["nodes"] == {"n1": "idle", "n2": "idle"} and s2["redis_ok"] is True
        out = second.slurm("srun", "-N2", "sh", "-c", "echo $SLURMD_NODENAME").stdout.split()
        assert sorted(out) == ["n1", "n2"]
        again = second.script("up", check=False)
        assert again.returncode == 1 and "already running" in again.stderr
        started = status(second)["daemons"]
        assert isinstance(started, dict)
        pids = [d["pid"] for d in started.values()]
        redis_port = int(second.redis_url.rsplit(":", 1)[1].split("/")[0])
    finally:
        second.script("down")
    # munged, slurmctld, redis, and a slurmd and an sshd per node
    assert len(pids) == 3 + 2 * 2 and not [p for p in pids if pid_alive(p)], "down left processes running"
    assert not port_open(redis_port)
    s1 = status(cluster)
    d1 = s1["daemons"]
    assert isinstance(d1, dict) and all(d["alive"] for d in d1.values()) and s1["redis_ok"] is True


def test_bad_input_is_rejected(cluster: DevCluster, tmp_path: Path) -> None:
    r = cluster.script("kill-node", "n99", check=False)
    assert r.returncode == 1 and "unknown node 'n99'" in r.stderr
    r = cluster.script("revive-node", "n1", check=False)
    assert r.returncode == 1 and "is running" in r.stderr
    empty = DevCluster(tmp_path / "none", {})
    r = empty.script("status", check=False)
    assert r.returncode == 1 and "no cluster" in r.stderr
    r = empty.script("up", "--nodes", "0", check=False)
    assert r.returncode == 1 and "--nodes" in r.stderr
    r = empty.script("up", "--slurm", "23.02", check=False)
    assert r.returncode == 1 and "--slurm must be one of 22.05, 24.11; got 23.02" in r.stderr
    assert not (tmp_path / "none" / "state.json").exists()
