"""[slurm] scope: which nodes unicorn manages (partitions, node feature, reservation)."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from tests.fakes.slurm import FakeSlurm, idle_node, running_job
from unicorn_core.config import SlurmConfig, load_config
from unicorn_core.errors import ConfigError
from unicorn_core.slurm.backend import UnknownReservation
from unicorn_core.slurm.cli import CliSlurm
from unicorn_core.slurm.parse import node_from_scontrol, node_from_sinfo_json, parse_partitions
from unicorn_core.slurm.scope import Scope, ScopeError, jobs_by_node, resolve_scope
from unicorn_core.slurm.types import JobState

# Recorded from the dev cluster (Slurm 22.05.8, `up --cpu-nodes 1`), shortened.
PARTITIONS = (
    "PartitionName=gpu AllowGroups=ALL Default=YES Nodes=n[1-2] State=UP TotalCPUs=16 TotalNodes=2\n"
    "PartitionName=cpu AllowGroups=ALL Default=NO Nodes=n3 State=UP TotalCPUs=8 TotalNodes=1\n"
)
RESERVATION = (
    "ReservationName=r1 StartTime=2026-11-24T03:38:50 EndTime=2026-11-24T04:38:50 "
    "Duration=01:00:00 Nodes=n[1-2] NodeCnt=2 CoreCnt=16 Features=(null) PartitionName=(null) "
    "Flags=IGNORE_JOBS,SPEC_NODES TRES=cpu=16 Users=root Groups=(null) State=ACTIVE\n"
)


def cluster() -> FakeSlurm:
    return FakeSlurm(
        [
            idle_node("g1", partitions=("gpu",), features=("h100",)),
            idle_node("g2", partitions=("gpu", "all"), features=("a100",)),
            idle_node("c1", partitions=("cpu", "all")),
        ],
        reservations={"train": ("g1",)},
    )


def test_an_empty_scope_admits_every_node() -> None:
    scope = Scope()
    assert scope.everything and scope.describe() == "every node"
    assert all(scope.admits(n) for n in cluster().nodes.values())


def test_partitions_feature_and_reservation_each_narrow_the_scope_and_say_why() -> None:
    nodes = cluster().nodes
    by_partition = Scope(partitions=("gpu",))
    assert [n for n in nodes if by_partition.admits(nodes[n])] == ["g1", "g2"]
    why = by_partition.why_outside(nodes["c1"])
    assert why is not None and "cpu,all" in why and "[slurm] partitions" in why and "'gpu'" in why
    by_feature = Scope(partitions=("gpu",), feature="h100")
    assert [n for n in nodes if by_feature.admits(nodes[n])] == ["g1"]
    assert "node_feature" in (by_feature.why_outside(nodes["g2"]) or "")
    by_reservation = Scope(partitions=("all",), reservation="train", reserved=frozenset({"g2"}))
    assert [n for n in nodes if by_reservation.admits(nodes[n])] == ["g2"]
    assert "reservation" in (by_reservation.why_outside(nodes["c1"]) or "")
    inside, outside = by_partition.split(nodes.values())
    assert [n.name for n in inside] == ["g1", "g2"] and [n.name for n in outside] == ["c1"]


async def test_no_scope_asks_slurm_nothing() -> None:
    slurm = cluster()
    assert await resolve_scope(slurm, SlurmConfig()) == Scope()
    assert slurm.queries == []


async def test_an_unknown_partition_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(ScopeError) as ei:
        await resolve_scope(cluster(), SlurmConfig(partitions=("gpu", "nope")))
    assert "['nope']" in str(ei.value) and "all, cpu, gpu" in str(ei.value)
    assert isinstance(ei.value, ConfigError)


async def test_an_unknown_reservation_is_an_error_and_a_known_one_gives_its_nodes() -> None:
    with pytest.raises(ScopeError, match=r"reservation.*'gone'"):
        await resolve_scope(cluster(), SlurmConfig(reservation="gone"))
    scope = await resolve_scope(cluster(), SlurmConfig(partitions=("gpu",), reservation="train"))
    assert scope.reserved == frozenset({"g1"}) and scope.describe() == "partitions gpu and reservation train"


def test_jobs_by_node_counts_jobs_holding_nodes_only() -> None:
    pending = dataclasses.replace(running_job(3, []), state=JobState.PENDING, state_raw="PENDING")
    done = dataclasses.replace(running_job(4, ["g1"]), state=JobState.COMPLETED, state_raw="COMPLETED")
    helper = running_job(5, ["g2"], name="unicorn-expand-1")
    completing = dataclasses.replace(running_job(6, ["g2"]), state=JobState.COMPLETING)
    held = jobs_by_node(
        [running_job(2, ["g1", "c1"]), running_job(1, ["g1"]), pending, done, helper, completing]
    )
    assert held == {"g1": (1, 2), "c1": (2,), "g2": (6,)}


def test_recorded_partitions_and_reservation_parse() -> None:
    assert parse_partitions(PARTITIONS) == ["gpu", "cpu"]
    assert parse_partitions("No partitions in the system\n") == []


def test_features_come_from_sinfo_json_and_scontrol() -> None:
    base = {"name": "n1", "state": "idle", "partitions": ["gpu"]}
    assert node_from_sinfo_json({**base, "active_features": "h100,ib"}).features == ("h100", "ib")
    assert node_from_sinfo_json({**base, "active_features": ["h100"]}).features == ("h100",)
    assert node_from_sinfo_json({**base, "active_features": ""}).features == ()
    rec = {"NodeName": "n1", "State": "IDLE", "ActiveFeatures": "(null)", "Partitions": "gpu"}
    assert node_from_scontrol(rec).features == ()
    assert node_from_scontrol({**rec, "ActiveFeatures": "a100,nvl"}).features == ("a100", "nvl")


def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


async def test_cli_backend_reads_partitions_and_reservations_through_scontrol(tmp_path: Path) -> None:
    (tmp_path / "partitions.txt").write_text(PARTITIONS)
    (tmp_path / "resv.txt").write_text(RESERVATION)
    _tool(
        tmp_path,
        "scontrol",
        f'if [ "$3" = partition ]; then cat {tmp_path}/partitions.txt; exit 0; fi\n'
        f'if [ "$4" = r1 ]; then cat {tmp_path}/resv.txt; exit 0; fi\n'
        'echo "Reservation $4 not found"; exit 1',
    )
    slurm = CliSlurm(timeout_s=5, bin_dir=tmp_path)
    assert await slurm.list_partitions() == ["gpu", "cpu"]
    assert await slurm.reservation_nodes("r1") == ("n1", "n2")
    with pytest.raises(UnknownReservation, match="'r2'"):
        await slurm.reservation_nodes("r2")


def test_scope_keys_load_from_the_environment_and_bad_names_are_refused() -> None:
    cfg = load_config(None, env={"UNICORN_SLURM__PARTITIONS": "gpu, big", "UNICORN_SLURM__RESERVATION": "r1"})
    assert cfg.slurm.partitions == ("gpu", "big") and cfg.slurm.reservation == "r1" and cfg.slurm.scoped
    assert not load_config(None, env={}).slurm.scoped
    with pytest.raises(ConfigError, match="not a Slurm name"):
        load_config(None, env={"UNICORN_SLURM__PARTITIONS": "gpu;rm -rf"})
    with pytest.raises(ConfigError, match="names a partition twice"):
        load_config(None, env={"UNICORN_SLURM__PARTITIONS": "gpu,gpu"})
