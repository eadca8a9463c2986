"""Megatron-LM adapter: parsing Megatron's own log lines, torchrun error files, the full command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.megatron import (
    LogFollower,
    MegatronIteration,
    parse_iteration_line,
    pretrain_command,
    read_error_file,
    to_timing,
)
from launcher.render import MegatronCheckpointing, Rendezvous, torchrun_argv
from launcher.trainer.logline import iteration_line
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.protocol import IterationPhase

# Recorded shapes of Megatron-LM's training_log output (core 0.16-era with the timestamp
# and throughput fields; an older release without the timestamp, fp16 loss scale and a
# skipped iteration), plus lines the parser must ignore.
NEW = (
    " [2025-06-02 14:03:11] iteration      100/  500000 | consumed samples:        25600 |"
    " elapsed time per iteration (ms): 1203.4 | throughput per GPU (TFLOP/s/GPU): 180.3 |"
    " learning rate: 1.499999E-05 | global batch size:   256 | lm loss: 7.856320E+00 |"
    " loss scale: 1.0 | grad norm: 2.137 | number of skipped iterations:   0 |"
    " number of nan iterations:   0 |"
)
OLD = (
    " iteration       10/     100 | consumed samples:          320 |"
    " elapsed time per iteration (ms): 1593.2 |"
    " learning rate: 3.000E-05 | global batch size:    32 | lm loss: 1.085962E+01 |"
    " loss scale: 4294967296.0 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)
SKIPPED = (
    " iteration       11/     100 | consumed samples:          352 | elapsed time per iteration (ms): 801.0 |"
    " learning rate: 3.000E-05 | global batch size:    32 | loss scale: 2147483648.0 |"
    " number of skipped iterations:   1 | number of nan iterations:   0 |"
)
NOISE = [
    "validation loss at iteration 100 | lm loss value: 7.812E+00 | lm loss PPL: 2.47E+03 |",
    "(min, max) time across ranks (ms):",
    "    forward-backward ...............................: (1180.21, 1190.43)",
    "[after training is done] datetime: 2025-06-02 14:03:11",
    " iteration        5/     100 | consumed samples:          160 |",  # no timing: not an iteration report
    "",
]


def test_parses_current_megatron_line() -> None:
    it = parse_iteration_line(NEW)
    assert it is not None
    assert (it.iteration, it.train_iters, it.consumed_samples, it.global_batch) == (100, 500000, 25600, 256)
    assert it.elapsed_ms == pytest.approx(1203.4)
    assert it.learning_rate == pytest.approx(1.499999e-05)
    assert it.lm_loss == pytest.approx(7.85632)
    assert (it.skipped, it.nan) == (0, 0)
    assert it.extra["grad norm"] == pytest.approx(2.137)
    assert it.extra["throughput per gpu (tflop/s/gpu)"] == pytest.approx(180.3)


def test_parses_old_and_skipped_lines() -> None:
    old = parse_iteration_line(OLD)
    assert (
        old is not None and old.lm_loss == pytest.approx(10.85962) and old.extra["loss scale"] == 4294967296.0
    )
    skipped = parse_iteration_line(SKIPPED)
    assert skipped is not None and skipped.lm_loss is None and skipped.skipped == 1


@pytest.mark.parametrize("line", NOISE)
def test_ignores_other_lines(line: str) -> None:
    assert parse_iteration_line(line) is None


def test_reads_unicorn_train_lines_too() -> None:
    line = iteration_line(
        iteration=7,
        train_iters=9,
        consumed_samples=112,
        elapsed_ms=42.25,
        learning_rate=1e-3,
        global_batch=16,
        lm_loss=4.5,
    )
    it = parse_iteration_line(line)
    assert it is not None
    assert (it.iteration, it.train_iters, it.consumed_samples, it.global_batch, it.lm_loss) == (
        7,
        9,
        112,
        16,
        4.5,
    )


def test_follower_handles_split_chunks_and_makes_timings() -> None:
    stream = "\n".join([NOISE[0], OLD, SKIPPED, NEW]) + "\n"
    follower = LogFollower()
    got: list[MegatronIteration] = []
    for start in range(0, len(stream), 37):  # chunk boundaries fall inside lines
        got.extend(follower.feed(stream[start : start + 37]))
    assert [i.iteration for i in got] == [10, 11, 100]
    assert follower.lines == 4
    timing = to_timing(got[2], job_id=7, node="n2", rank=15, wall_time_s=1.0)
    assert (timing.iteration, timing.rank, timing.samples, timing.phase) == (
        100,
        15,
        256,
        IterationPhase.TRAIN,
    )
    assert timing.duration_s == pytest.approx(1.2034)
    assert timing.loss == pytest.approx(7.85632)


def test_reads_torchrun_error_file(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: CUDA error: an illegal memory access was encountered",
                    "extraInfo": {
                        "py_callstack": "Traceback (most recent call last):\n  ...",
                        "timestamp": "1700000000",
                    },
                }
            }
        )
    )
    report = read_error_file(path, job_id=3, node="n1", rank=5)
    assert report.exc_type == "RuntimeError"
    assert report.message.startswith("CUDA error: an illegal memory access")
    assert report.wall_time_s == 1700000000.0
    assert report.traceback.startswith("Traceback")
    (tmp_path / "bad.json").write_text("not json")
    with pytest.raises(InvalidArgument, match="not a torchrun error file"):
        read_error_file(tmp_path / "bad.json", job_id=3, node="n1", rank=5)


def test_pretrain_command_puts_layout_last_and_requires_checkpoints() -> None:
    layout = Layout(tp=2, pp=2, dp=2, micro_batch=1, global_batch=64)
    torchrun = torchrun_argv(
        layout, nnodes=2, node_rank=1, gpus_per_node=4, rendezvous=Rendezvous("n1", 29500)
    )
    ck = MegatronCheckpointing(save_dir="/ckpt", load_dir="/ckpt", save_interval=50)
    argv = pretrain_command(
        torchrun,
        "pretrain_gpt.py",
        ["--tensor-model-parallel-size", "8"],
        layout=layout,
        model=None,
        checkpointing=ck,
    )
    assert argv[: len(torchrun)] == torchrun
    assert argv[len(torchrun)] == "pretrain_gpt.py"
    # argparse keeps the last value: the rendered layout overrides the user's.
    assert argv.index("--tensor-model-parallel-size", len(torchrun) + 3) > len(torchrun) + 1
    assert argv[-9:] == [
        "--save", "/ckpt", "--save-interval", "50", "--load", "/ckpt", "--ckpt-format", "torch_dist",
        "--exit-signal-handler",
    ]  # fmt: skip
    in_memory = pretrain_command(
        torchrun, "pretrain_gpt.py", [], layout=layout, model=None, checkpointing=ck, memory_tier=True
    )
    assert in_memory[len(torchrun) : len(torchrun) + 3] == ["-m", "launcher.mcore_ckpt", "pretrain_gpt.py"]
    with pytest.raises(InvalidArgument, match="both --save and --load"):
        pretrain_command(
            torchrun,
            "pretrain_gpt.py",
            [],
            layout=layout,
            model=None,
            checkpointing=MegatronCheckpointing(save_dir="/c"),
        )
