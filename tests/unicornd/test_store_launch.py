"""unicornd's persisted snapshot format and the command lines it launches."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from detect.statuses import ErrorStatus, Severity
from unicorn_core.config import AgentConfig
from unicorn_core.errors import InvalidArgument, ProtocolError
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec
from unicornd.launch import agent_argv, render_task, rendezvous_port
from unicornd.state import (
    KEEP_CLOSED_S,
    Incident,
    LadderStage,
    NodeHealth,
    NodeRecord,
    Policy,
    Snapshot,
    StageEntry,
    TaskRecord,
)
from unicornd.store import prune, snapshot_from_json, snapshot_to_json

MODEL = ModelSpec(layers=24, hidden=2048, heads=16, sequence=2048, vocabulary=50257, global_batch=12)


def _task(**kw: object) -> TaskRecord:
    base = dict(
        task_id="a", name="a", model=MODEL, command=("/bin/train", "--x=1"), job_id=7, nodes=("n1", "n2")
    )
    return TaskRecord(**{**base, **kw})  # type: ignore[arg-type]


def _snapshot() -> Snapshot:
    inc = Incident(
        incident_id="a.1", task_id="a", node="n2", rank=1, status=ErrorStatus.LOST_CONNECTION,
        severity=Severity.SEV1, rule="heartbeat_timeout", evidence="silent", opened_s=100.0,
        stage=LadderStage.CLOSED, timeline=(StageEntry(LadderStage.CLOSED, 100.0),),
    )  # fmt: skip
    return Snapshot(
        tasks={"a": _task(layout=Layout(1, 2, 1, 1, 12))},
        nodes={
            "n1": NodeRecord("n1"),
            "n2": NodeRecord("n2", health=NodeHealth.DRAINED, reason="unicorn: x"),
        },
        gpus_per_node=4,
        incidents={"a.1": inc},
        plan_generation=3,
        policy=Policy(),
    )


def test_snapshot_round_trips_through_json() -> None:
    snap = _snapshot()
    assert snapshot_from_json(snapshot_to_json(snap), Policy()) == snap


@pytest.mark.parametrize(
    "text", ["not json", "[]", '{"v": 99}', '{"v": 1, "gpus_per_node": 1, "tasks": [{"x": 1}]}']
)
def test_bad_state_is_refused(text: str) -> None:
    with pytest.raises(ProtocolError):
        snapshot_from_json(text, Policy())


def test_prune_drops_only_old_closed_incidents() -> None:
    snap = _snapshot()
    assert prune(snap, 100.0 + KEEP_CLOSED_S - 1) == snap
    assert prune(snap, 100.0 + KEEP_CLOSED_S + 1).incidents == {}


def test_render_task_builds_torchrun_per_node() -> None:
    cfg = AgentConfig(bin_dir="/opt/u/bin", rendezvous_host="10.0.0.1")
    layout = Layout(tp=1, pp=2, dp=1, micro_batch=1, global_batch=12, vpp=2)
    argv = render_task(_task(), layout, ("n1", "n2"), cfg=cfg, gpus_per_node=1, generation=4)
    port = rendezvous_port(cfg, "a", 4)
    assert argv["n2"] == [
        "/opt/u/bin/torchrun", "--nnodes=2", "--node-rank=1", "--nproc-per-node=1", "--max-restarts=0",
        "--master-addr=10.0.0.1", f"--master-port={port}", "--monitor-interval=0.1", "--no-python",
        "/bin/train", "--x=1", "--tp=1", "--pp=2", "--dp=1", "--micro-batch=1", "--global-batch=12",
    ]  # fmt: skip
    assert argv["n1"][2] == "--node-rank=0"
    assert rendezvous_port(cfg, "a", 5) != port  # a relaunch never reuses the last port
    script = render_task(
        _task(command=("train.py",)), layout, ("n1",), cfg=cfg, gpus_per_node=2, generation=1
    )
    assert "--no-python" not in script["n1"] and "train.py" in script["n1"]


MEGATRON = ("/w/pretrain_gpt.py", "--save", "/ckpt", "--save-interval", "50", "--lr", "3e-4")


def test_megatron_tasks_run_the_script_under_the_runner_with_unicorns_flags() -> None:
    layout = Layout(tp=2, pp=1, dp=2, micro_batch=1, global_batch=12)
    task = replace(_task(), framework="megatron", command=MEGATRON)
    cfg = AgentConfig(bin_dir="/opt/u/bin", rendezvous_host="h")
    argv = render_task(task, layout, ("n1",), cfg=cfg, gpus_per_node=4, generation=1)
    assert argv["n1"][8:] == [
        "-m", "launcher.mcore_ckpt", *MEGATRON,
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
        "--micro-batch-size", "1", "--global-batch-size", "12",
        "--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "8192",
        "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
        "--load", "/ckpt", "--ckpt-format", "torch_dist", "--exit-signal-handler",
    ]  # fmt: skip
    assert argv["n1"][7] == "--monitor-interval=0.1"  # torchrun's last option: no --no-python


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (("python", "pretrain_gpt.py", "--save", "/c", "--save-interval", "5"), "SCRIPT.py ARGS"),
        (("/w/pretrain_gpt.py", "--lr", "1e-4"), "--save DIR is required"),
        ((*MEGATRON, "--pipeline-model-parallel-size=2"), "--pipeline-model-parallel-size cannot be given"),
        ((*MEGATRON, "--num-layers", "2"), "--num-layers 2 differs from the model file's layers = 24"),
    ],
)
def test_a_megatron_task_with_a_conflicting_command_is_refused_and_never_rendered(
    command: tuple[str, ...], message: str
) -> None:
    """Registration refuses it (the CLI's record, the daemon's from the request); one already
    stored is still read back (unicornd must read its state) but never renders."""
    task = _task(framework="megatron", command=command)
    with pytest.raises(InvalidArgument, match=f"task a: .*{re.escape(message)}"):
        task.check_command()
    doc = {**_task().to_dict(), "framework": "megatron", "command": list(command)}
    assert TaskRecord.from_dict(doc) == task
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        render_task(task, Layout(1, 1, 1, 1, 12), ("n1",), cfg=AgentConfig(), gpus_per_node=1, generation=1)


def test_agent_argv() -> None:
    cfg = AgentConfig(bin_dir="/opt/u/bin")
    assert agent_argv(cfg, 7, "n1", ["torchrun", "x"], config_path="/etc/u.toml") == [
        "/opt/u/bin/unicorn-agent", "--job-id", "7", "--node", "n1", "--config", "/etc/u.toml",
        "--", "torchrun", "x",
    ]  # fmt: skip


def test_unknown_framework_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="framework"):
        _task(framework="jax")
