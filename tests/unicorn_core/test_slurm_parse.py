"""Parsers over output recorded from the dev cluster (Slurm 22.05.8, and 24.11.5 from
``dev-cluster up --slurm 24.11``) and synthetic 23.02+ shapes.

Both recordings hold the same cluster state: n2 drained with a reason holding ``=``, job
"my train" running on n3-n4, a 4-node job pending (24.11's also holds 2 GPUs per node)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unicorn_core.slurm.parse import (
    GroupedSinfo,
    SlurmParseError,
    gpu_type_in_gres,
    gpus_in_gres,
    job_from_scontrol,
    jobs_from_squeue_json,
    node_from_scontrol,
    node_from_sinfo_json,
    nodes_from_scontrol_json,
    nodes_from_sinfo_json,
    parse_scontrol_record,
    tres_limits,
)
from unicorn_core.slurm.types import JobState, NodeState

DATA = Path(__file__).parent / "data"


def test_sinfo_json_22_05() -> None:
    nodes = {n.name: n for n in nodes_from_sinfo_json((DATA / "sinfo-22.05.json").read_text())}
    assert sorted(nodes) == ["n1", "n2", "n3", "n4"]
    n2 = nodes["n2"]
    assert n2.state is NodeState.IDLE
    assert n2.drained and not n2.usable and n2.responding
    assert n2.reason == "unicorn: ecc_error gpu=1 job=7"
    assert (n2.gpus, n2.cpus, n2.real_memory_mib, n2.partitions) == (4, 8, 8192, ("debug",))
    assert nodes["n3"].state is NodeState.MIXED and nodes["n3"].usable
    assert nodes["n1"].usable and not nodes["n1"].drained


def test_scontrol_node_json_24_11() -> None:
    """24.11's ``scontrol show node --json``: one record per node, states as lists."""
    nodes = {n.name: n for n in nodes_from_scontrol_json((DATA / "scontrol-node-24.11.json").read_text())}
    assert sorted(nodes) == ["n1", "n2", "n3", "n4"]
    n2 = nodes["n2"]
    assert n2.state is NodeState.IDLE and n2.drained and not n2.usable
    assert n2.reason == "unicorn: ecc_error gpu=1 job=7"
    assert (n2.gpus, n2.cpus, n2.real_memory_mib, n2.partitions) == (4, 8, 8192, ("debug",))
    assert (nodes["n3"].state, nodes["n3"].gpus_used) == (NodeState.MIXED, 2)
    assert nodes["n1"].usable and nodes["n1"].gpus_used == 0


def test_sinfo_json_24_11_is_grouped() -> None:
    """24.11's ``sinfo --json`` groups nodes (n3 and n4 share one record): refused with the
    error that sends the CLI backend to ``scontrol show node --json``."""
    text = (DATA / "sinfo-24.11.json").read_text()
    groups = json.loads(text)["sinfo"]
    assert ["n3", "n4"] in [g["nodes"]["nodes"] for g in groups]
    with pytest.raises(GroupedSinfo, match="scontrol show node --json"):
        nodes_from_sinfo_json(text)


def test_squeue_json_24_11() -> None:
    jobs = {j.job_id: j for j in jobs_from_squeue_json((DATA / "squeue-24.11.json").read_text())}
    running = jobs[2]
    assert (running.state, running.name, running.nodes, running.num_nodes) == (
        JobState.RUNNING,
        "my train",
        ("n3", "n4"),
        2,
    )
    assert running.batch and running.user == "root" and running.batch_host == "n3"
    assert jobs[3].state is JobState.PENDING and jobs[3].nodes == () and jobs[3].num_nodes == 4
    assert jobs[3].batch_host == ""


def test_scontrol_records_24_11() -> None:
    """``scontrol -o show job|node`` parse as on 22.05 (24.11 renamed ``TRES=`` to
    ``ReqTRES=``/``AllocTRES=``, which nothing here reads)."""
    rec = parse_scontrol_record((DATA / "scontrol-job-24.11.txt").read_text())
    assert "ReqTRES" in rec and "TRES" not in rec
    job = job_from_scontrol(rec)
    assert (job.job_id, job.state, job.nodes, job.name, job.batch) == (
        2,
        JobState.RUNNING,
        ("n3", "n4"),
        "my train",
        True,
    )
    assert job.batch_host == "n3"
    node = node_from_scontrol(parse_scontrol_record((DATA / "scontrol-node-24.11.txt").read_text()))
    assert node.drained and node.reason == "unicorn: ecc_error gpu=1 job=7" and node.gpus == 4


def test_squeue_json_22_05() -> None:
    jobs = {j.job_id: j for j in jobs_from_squeue_json((DATA / "squeue-22.05.json").read_text())}
    running = jobs[9]
    assert running.state is JobState.RUNNING
    assert running.name == "my train"
    assert running.nodes == ("n3", "n4") and running.num_nodes == 2
    assert running.batch and running.user == "root" and running.batch_host == "n3"
    pending = jobs[10]
    assert pending.state is JobState.PENDING and pending.nodes == () and pending.batch_host == ""


def test_scontrol_job_record() -> None:
    rec = parse_scontrol_record((DATA / "scontrol-job-22.05.txt").read_text())
    assert rec["JobName"] == "my train"  # value with a space
    job = job_from_scontrol(rec)
    assert (job.job_id, job.state, job.nodes, job.num_nodes, job.batch) == (
        9,
        JobState.RUNNING,
        ("n3", "n4"),
        2,
        True,
    )
    assert job.batch_host == "n3"
    no_host = job_from_scontrol({**rec, "BatchHost": "(null)"})
    assert no_host.batch_host == ""


def test_scontrol_node_reason_with_equals_sign() -> None:
    node = node_from_scontrol(parse_scontrol_record((DATA / "scontrol-node-22.05.txt").read_text()))
    assert node.state is NodeState.IDLE and node.drained
    assert node.reason == "unicorn: ecc_error gpu=1 job=7"
    assert node.gpus == 4


def test_newer_slurm_shapes() -> None:
    """23.02+ report state as a list and numbers as {set, number} objects."""
    node = node_from_sinfo_json(
        {
            "name": "g1",
            "state": ["IDLE", "DRAIN", "NOT_RESPONDING"],
            "cpus": {"set": True, "number": 64},
            "gres": "gpu:h100:8(S:0-1)",
            "gres_used": "gpu:h100:2(IDX:0-1)",
            "reason": "x",
        }
    )
    assert node.state is NodeState.IDLE and node.drained and not node.responding
    assert (node.cpus, node.gpus, node.gpus_used) == (64, 8, 2)
    jobs = jobs_from_squeue_json(
        json.dumps({"jobs": [{"job_id": 5, "job_state": ["RUNNING"], "nodes": "g[1-2]"}]})
    )
    assert jobs[0].state is JobState.RUNNING and jobs[0].nodes == ("g1", "g2")


def test_unknown_job_state_kept_raw() -> None:
    jobs = jobs_from_squeue_json(json.dumps({"jobs": [{"job_id": 5, "job_state": "STAGE_OUT"}]}))
    assert jobs[0].state is JobState.OTHER and jobs[0].state_raw == "STAGE_OUT"


@pytest.mark.parametrize(
    "gres,n",
    [
        ("gpu:4", 4),
        ("gpu:a100:8(S:0-1)", 8),
        ("", 0),
        ("gpu:0", 0),
        ("mps:100,gpu:2", 2),
        ("gpu:a:2,gpu:b:3", 5),
    ],
)
def test_gpus_in_gres(gres: str, n: int) -> None:
    assert gpus_in_gres(gres) == n


@pytest.mark.parametrize(
    ("gres", "kind"),
    [
        ("gpu:4", ""),
        ("gpu:h100:8(S:0-1)", "h100"),
        ("gpu:a100:4,gpu:h100:2", "a100"),
        ("gpu:h100:2,gpu:a100:2", "a100"),  # a tie goes by name
        ("gpu:a100:1,gpu:a100:1,gpu:h100:1", "a100"),
        ("", ""),
        ("mps:100", ""),
    ],
)
def test_gpu_type_in_gres(gres: str, kind: str) -> None:
    assert gpu_type_in_gres(gres) == kind


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        json.dumps({"nodes": "x"}),
        json.dumps({"nodes": [{"state": "idle"}]}),
        json.dumps({"errors": ["boom"], "nodes": []}),
        json.dumps({"nodes": [{"name": "n1", "state": 3}]}),
    ],
)
def test_bad_sinfo_output_raises_parse_error(text: str) -> None:
    with pytest.raises(SlurmParseError):
        nodes_from_sinfo_json(text)


@pytest.mark.parametrize("text", ["", "   ", "no equals signs here"])
def test_bad_scontrol_record(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_scontrol_record(text)


def test_job_record_without_id_rejected() -> None:
    with pytest.raises(SlurmParseError):
        job_from_scontrol({"JobState": "RUNNING"})
    with pytest.raises(SlurmParseError):
        jobs_from_squeue_json(json.dumps({"jobs": [{"job_id": 0, "job_state": "RUNNING"}]}))


@pytest.mark.parametrize(
    ("text", "limits"),
    [
        ("", (None, None)),
        ("node=2", (2, None)),
        ("cpu=64,node=4,gres/gpu=32", (4, 32)),
        ("gres/gpu:h100=8,gres/gpu=16", (None, 8)),
        ("node=x,billing=3", (None, None)),
    ],
)
def test_tres_limits(text: str, limits: tuple[int | None, int | None]) -> None:
    assert tres_limits(text) == limits


def test_a_job_asking_gpus_per_task_holds_gres() -> None:
    """``--gpus-per-task`` and ``--gpus-per-socket`` ask for GRES too (such a job is never
    expanded); CPUs per task do not."""
    base = {"job_id": 5, "job_state": "RUNNING"}
    per_task = json.dumps({"jobs": [{**base, "tres_per_task": "cpu:4,gres/gpu:1"}]})
    assert jobs_from_squeue_json(per_task)[0].holds_gres
    cpus_only = json.dumps({"jobs": [{**base, "tres_per_task": "cpu:4"}]})
    assert not jobs_from_squeue_json(cpus_only)[0].holds_gres
    rec = {"JobId": "5", "JobState": "RUNNING", "TresPerSocket": "gres/gpu:2"}
    assert job_from_scontrol(rec).gres == "gres/gpu:2"
