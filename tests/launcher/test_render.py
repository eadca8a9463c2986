"""Golden-file tests of launcher.render: the exact argv a relaunch would run.

Set ``UNICORN_UPDATE_GOLDEN=1`` to rewrite the files after an intended change, then
review the diff.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from launcher.render import (
    MegatronCheckpointing,
    RdzvBackend,
    Rendezvous,
    TorchrunOptions,
    TrainerCheckpointing,
    megatron_args,
    processes_per_node,
    torchrun_argv,
    torchrun_argvs,
    trainer_args,
)
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec

GOLDEN = Path(__file__).parent / "golden"

GPT_1B = ModelSpec(layers=24, hidden=2048, heads=16, sequence=2048, vocabulary=51200, global_batch=512)
TINY = ModelSpec(layers=4, hidden=64, heads=4, sequence=32, vocabulary=128, global_batch=16)


def check_golden(name: str, lines: list[list[str]]) -> None:
    text = "".join(shlex.join(argv) + "\n" for argv in lines)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("UNICORN_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.read_text() == text, f"{path} differs; rerun with UNICORN_UPDATE_GOLDEN=1 if intended"


def test_torchrun_c10d_two_nodes_with_logging_options() -> None:
    layout = Layout(tp=4, pp=2, dp=1, micro_batch=1, global_batch=512)
    argvs = torchrun_argvs(
        layout,
        nodes=["n1", "n3"],
        gpus_per_node=4,
        rendezvous=Rendezvous("n1", 29500, run_id="job42-r3"),
        options=TorchrunOptions(log_dir="/tmp/run/logs", redirects="3", tee="0:3", monitor_interval_s=0.5),
    )
    assert list(argvs) == ["n1", "n3"]
    check_golden("torchrun_c10d_2nodes", [argvs["n1"], argvs["n3"]])


def test_torchrun_static_rendezvous() -> None:
    layout = Layout(tp=1, pp=1, dp=3, micro_batch=1, global_batch=12)
    argv = torchrun_argv(
        layout,
        nnodes=1,
        node_rank=0,
        gpus_per_node=4,
        rendezvous=Rendezvous("127.0.0.1", 31000, backend=RdzvBackend.STATIC),
        options=TorchrunOptions(program=("/venv/bin/torchrun",)),
    )
    check_golden("torchrun_static_dp3", [argv])


def test_megatron_args_everything() -> None:
    layout = Layout(
        tp=4, pp=4, dp=2, micro_batch=1, global_batch=512, vpp=2, recompute=True, distributed_optimizer=True
    )
    args = megatron_args(
        layout,
        GPT_1B,
        MegatronCheckpointing(save_dir="/ckpt/gpt", load_dir="/ckpt/gpt", save_interval=100),
    )
    check_golden("megatron_full", [args])


def test_megatron_args_layout_only_and_legacy_flag() -> None:
    layout = Layout(tp=2, pp=1, dp=8, micro_batch=4, global_batch=256)
    plain = megatron_args(layout)
    legacy = megatron_args(
        layout,
        checkpointing=MegatronCheckpointing(
            load_dir="/ckpt", legacy_use_dist_ckpt=True, exit_signal_handler=False
        ),
    )
    check_golden("megatron_minimal", [plain, legacy])


def test_trainer_args_golden() -> None:
    layout = Layout(tp=2, pp=2, dp=1, micro_batch=2, global_batch=16)
    args = trainer_args(
        layout, TINY, iterations=50, checkpointing=TrainerCheckpointing("/ckpt/t", 10, "/ckpt/t"), seed=7
    )
    check_golden("trainer_tp2_pp2", [args])


@pytest.mark.parametrize(
    ("layout", "nnodes", "gpus", "needle"),
    [
        (Layout(tp=1, pp=1, dp=6, micro_batch=1, global_batch=12), 4, 4, "does not split evenly"),
        (Layout(tp=1, pp=1, dp=8, micro_batch=1, global_batch=16), 1, 4, "world size 8 != GPUs available 4"),
        (Layout(tp=4, pp=1, dp=1, micro_batch=1, global_batch=16), 2, 4, "TP group must stay within a node"),
    ],
)
def test_processes_per_node_rejects(layout: Layout, nnodes: int, gpus: int, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        processes_per_node(layout, nnodes, gpus)


def test_processes_per_node_spreads_world() -> None:
    assert processes_per_node(Layout(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16), 2, 4) == 4


def test_node_rank_and_distinct_nodes_checked() -> None:
    layout = Layout(tp=1, pp=1, dp=2, micro_batch=1, global_batch=2)
    rdzv = Rendezvous("h", 1)
    with pytest.raises(InvalidArgument, match="node_rank"):
        torchrun_argv(layout, nnodes=2, node_rank=2, gpus_per_node=1, rendezvous=rdzv)
    with pytest.raises(InvalidArgument, match="distinct"):
        torchrun_argvs(layout, nodes=["a", "a"], gpus_per_node=1, rendezvous=rdzv)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"host": "", "port": 1}, "host"),
        ({"host": "h", "port": 0}, "port"),
        ({"host": "h", "port": 1, "run_id": "a b"}, "run_id"),
    ],
)
def test_rendezvous_validation(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        Rendezvous(**kwargs)  # type: ignore[arg-type]


def test_vpp_needs_model_and_divisible_layers() -> None:
    layout = Layout(tp=1, pp=2, dp=1, micro_batch=1, global_batch=4, vpp=3)
    with pytest.raises(InvalidArgument, match="needs the model"):
        megatron_args(layout)
    with pytest.raises(InvalidArgument, match="does not divide"):
        megatron_args(layout, TINY)


def test_checkpointing_options_validated() -> None:
    with pytest.raises(InvalidArgument, match="needs save_dir"):
        MegatronCheckpointing(save_interval=10)
    with pytest.raises(InvalidArgument, match="needs save_dir"):
        TrainerCheckpointing(save_interval=10)


def test_trainer_args_rejects_what_the_trainer_lacks() -> None:
    with pytest.raises(InvalidArgument, match="vpp"):
        trainer_args(Layout(tp=1, pp=2, dp=1, micro_batch=1, global_batch=16, vpp=2), TINY, iterations=1)
    with pytest.raises(InvalidArgument, match="global_batch"):
        trainer_args(Layout(tp=1, pp=1, dp=1, micro_batch=1, global_batch=8), TINY, iterations=1)


def test_render_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, launcher.render; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


def test_a_restart_of_every_nodes_ranks_moves_the_rendezvous_port_the_same_way_on_each() -> None:
    """Each node's step of one restart (restart_ranks, or restart_agent where the agent was
    gone) derives the same new port, which differs from the launch's; other launches and
    ports outside the rendezvous range are left alone."""
    from launcher.render import restart_rendezvous

    base = 29000
    argv = ["torchrun", "--nnodes=2", "--master-addr=10.0.0.1", f"--master-port={base + 998}", "train.py"]
    n1 = restart_rendezvous(argv, "b.2/restart_processes/1/restart_ranks/n1", base)
    n2 = restart_rendezvous(argv, "b.2/restart_processes/1/restart_agent/n2", base)
    assert n1 == n2 and n1 != argv
    (port,) = [int(a.split("=")[1]) for a in n1 if a.startswith("--master-port=")]
    assert base <= port < base + 1000 and port != base + 998
    assert [a for a in n1 if not a.startswith("--master-port=")] == [
        a for a in argv if "master-port" not in a
    ]
    again = restart_rendezvous(argv, "b.2/restart_processes/2/restart_ranks/n1", base)
    assert again != n1  # the next attempt moves elsewhere again (not to the port just left)
    assert restart_rendezvous(argv, "plan-5/b/launch/n1", base) == argv
    rolled = restart_rendezvous(argv, "c.1/restart_processes/1/rollback/n1", base)
    assert rolled == restart_rendezvous(argv, "c.1/restart_processes/1/rollback/n2", base) != argv
    outside = ["torchrun", "--master-port=4000"]
    assert restart_rendezvous(outside, "b.2/restart_processes/1/restart_ranks/n1", base) == outside
