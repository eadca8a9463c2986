"""Megatron-LM adapter: parsing Megatron's own log lines, torchrun error files, the full command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher.megatron import (
    _ONLY,
    _REFUSED,
    MEMORY_TIER_RUNNER,
    LogFollower,
    MegatronIteration,
    MegatronUserArgs,
    check_user_args,
    parse_iteration_line,
    pretrain_command,
    read_error_file,
    to_timing,
)
from launcher.render import RdzvBackend, Rendezvous, TorchrunOptions, torchrun_argvs
from launcher.trainer.logline import iteration_line
from tests.launcher.test_render import check_golden
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec
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


# --- the user's command line under --framework megatron ----------------------------------------

MODEL = ModelSpec(layers=2, hidden=64, heads=4, sequence=32, vocabulary=128, global_batch=8)
SCRIPT = "/w/pretrain_gpt.py"
BASE = ("--save", "/x", "--save-interval", "100")
DATA = ("--train-iters", "1000", "--lr", "3e-4", "--data-path", "/d/text_document", "--log-interval", "1")


def both_forms(flag: str, value: str) -> list[tuple[str, ...]]:
    """``--flag value`` and ``--flag=value``: argparse reads both."""
    return [(flag, value), (f"{flag}={value}",)]


def test_the_refused_flags_cover_what_unicorn_owns_and_what_breaks_resuming() -> None:
    owned = {
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
        "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
        "--use-distributed-optimizer", "--recompute-granularity", "--recompute-method",
        "--recompute-num-layers", "--no-load-optim", "--no-load-rng", "--no-save-optim",
        "--no-save-rng", "--finetune", "--ckpt-convert-format", "--ckpt-convert-save",
        "--use-mp-args-from-checkpoint-args",
    }  # fmt: skip
    assert owned <= set(_REFUSED)
    assert {"--context-parallel-size", "--expert-model-parallel-size", "--ckpt-format"} <= set(_ONLY)
    assert not {"--use-checkpoint-args", "--async-save", "--override-opt_param-scheduler"} & set(_REFUSED)


@pytest.mark.parametrize("form", [0, 1], ids=["space", "equals"])
@pytest.mark.parametrize("flag", sorted(_REFUSED))
def test_every_refused_flag_is_refused_in_both_forms(flag: str, form: int) -> None:
    args = both_forms(flag, "2")[form]
    with pytest.raises(
        InvalidArgument, match=f"^{re.escape(flag)} cannot be given to a task under unicorn: "
    ):
        check_user_args((SCRIPT, *BASE, *DATA, *args), MODEL)


@pytest.mark.parametrize("form", [0, 1], ids=["space", "equals"])
@pytest.mark.parametrize(
    ("flag", "bad"),
    [
        ("--context-parallel-size", "2"),
        ("--expert-model-parallel-size", "4"),
        ("--expert-tensor-parallel-size", "2"),
        ("--num-distributed-optimizer-instances", "2"),
        ("--ckpt-format", "torch"),
        ("--non-persistent-ckpt-type", "local"),
        ("--exit-signal", "SIGINT"),
    ],
)
def test_one_value_flags_refuse_any_other_value(flag: str, bad: str, form: int) -> None:
    allowed = _ONLY[flag][0]
    check_user_args((SCRIPT, *BASE, *both_forms(flag, allowed)[form]), MODEL)
    with pytest.raises(InvalidArgument, match=f"^{re.escape(flag)} {bad} cannot be used .*only {allowed}"):
        check_user_args((SCRIPT, *BASE, *both_forms(flag, bad)[form]), MODEL)


@pytest.mark.parametrize("form", [0, 1], ids=["space", "equals"])
@pytest.mark.parametrize(
    ("flag", "field", "right", "wrong"),
    [
        ("--num-layers", "layers", 2, 24),
        ("--hidden-size", "hidden", 64, 2048),
        ("--ffn-hidden-size", "ffn_hidden", 256, 1024),
        ("--num-attention-heads", "heads", 4, 16),
        ("--seq-length", "sequence", 32, 2048),
        ("--num-query-groups", "num_query_groups", 4, 2),
        ("--global-batch-size", "global_batch", 8, 256),
    ],
)
def test_model_shape_and_global_batch_must_match_the_model_file(
    flag: str, field: str, right: int, wrong: int, form: int
) -> None:
    check_user_args((SCRIPT, *BASE, *both_forms(flag, str(right))[form]), MODEL)
    message = f"{flag} {wrong} differs from the model file's {field} = {right}"
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}"):
        check_user_args((SCRIPT, *BASE, *both_forms(flag, str(wrong))[form]), MODEL)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (("python", "pretrain_gpt.py", *BASE), "needs the command SCRIPT.py ARGS"),
        (("/usr/bin/torchrun", SCRIPT, *BASE), "needs the command SCRIPT.py ARGS"),
        ((), "needs the command SCRIPT.py ARGS"),
        ((SCRIPT, *DATA), "--save DIR is required"),
        ((SCRIPT, "--save=", "--save-interval", "5"), "--save DIR is required"),
        ((SCRIPT, "--save", "/x"), "--save needs --save-interval N"),
        ((SCRIPT, "--save", "/x", "--save-interval", "0"), "--save-interval must be positive"),
        ((SCRIPT, "--save", "/x", "--save-interval", "often"), "--save-interval 'often' is not an integer"),
        ((SCRIPT, *BASE, "--load", "/y"), "--load /y differs from --save /x"),
        ((SCRIPT, *BASE, "--save"), "--save needs a value"),
        ((SCRIPT, "--save", "--save-interval", "5"), "--save needs a value"),
        ((SCRIPT, *BASE, "--tensor_model_parallel_size", "2"), "it is spelled --tensor-model-parallel-size"),
        ((SCRIPT, *BASE, "--max-position-embeddings", "16"), "below the model file's sequence = 32"),
        ((SCRIPT, *BASE, "--group-query-attention"), "--group-query-attention without --num-query-groups"),
        ((SCRIPT, *BASE, "--swiglu"), "--swiglu needs --ffn-hidden-size"),
    ],
)
def test_commands_that_cannot_resume_or_do_not_parse_are_refused(
    command: tuple[str, ...], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        check_user_args(command, MODEL)


def test_an_accepted_command_keeps_the_users_arguments_unchanged() -> None:
    args = (
        *DATA, "--save=/x", "--persistent-save-interval=50", "--load", "/x/", "--use-checkpoint-args",
        "--async-save", "--override-opt_param-scheduler", "--context-parallel-size", "1",
        "--ckpt-format", "torch", "--ckpt-format=torch_dist", "--max-position-embeddings", "64",
        "--num-query-groups", "4", "--exit-signal", "SIGTERM", "--sequence-parallel",
    )  # fmt: skip
    user = check_user_args((SCRIPT, *args), MODEL)
    assert user == MegatronUserArgs(
        script=SCRIPT, args=args, save_dir="/x", load_dir="/x/", save_interval=50, given=user.given
    )
    assert {
        "--save",
        "--save-interval",
        "--load",
        "--ckpt-format",
        "--lr",
        "--sequence-parallel",
    } <= user.given
    gqa = ModelSpec(
        layers=2, hidden=64, heads=4, sequence=32, vocabulary=128, global_batch=8, num_query_groups=2
    )
    assert check_user_args((SCRIPT, *BASE, "--group-query-attention"), gqa).save_dir == "/x"


# --- one node's argv ---------------------------------------------------------------------------


def _torchruns(layout: Layout) -> dict[str, list[str]]:
    return torchrun_argvs(
        layout,
        nodes=["n1", "n2"],
        gpus_per_node=2,
        rendezvous=Rendezvous("n1", 29500, run_id="t.7-3", backend=RdzvBackend.STATIC),
        options=TorchrunOptions(program=("/opt/u/bin/torchrun",), monitor_interval_s=0.1),
    )


def test_pretrain_command_tp1_pp2_dp2_golden() -> None:
    """What each node runs: torchrun, the runner, the script and the user's arguments
    unchanged, then the layout, the model shape and the checkpoint flags."""
    layout = Layout(tp=1, pp=2, dp=2, micro_batch=1, global_batch=8)
    heads = _torchruns(layout)
    argvs = {n: pretrain_command(heads[n], (SCRIPT, *BASE, *DATA), layout=layout, model=MODEL) for n in heads}
    check_golden("megatron_pretrain_tp1_pp2_dp2", [argvs["n1"], argvs["n2"]])
    argv = argvs["n2"]
    tail = argv[len(heads["n2"]) :]
    assert tail[:3] == ["-m", MEMORY_TIER_RUNNER, SCRIPT] and "--no-python" not in argv
    assert tail[3 : 3 + len(BASE) + len(DATA)] == [*BASE, *DATA]
    assert argv.count("--save") == 1 and argv[argv.index("--load") + 1] == "/x"


def test_pretrain_command_leaves_out_what_the_user_gave() -> None:
    layout = Layout(tp=2, pp=1, dp=2, micro_batch=2, global_batch=8, distributed_optimizer=True)
    user = (
        "--num-layers=2", "--global-batch-size", "8", "--load", "/x", "--ckpt-format=torch_dist",
        "--exit-signal-handler", "--max-position-embeddings", "64",
    )  # fmt: skip
    argv = pretrain_command(_torchruns(layout)["n1"], (SCRIPT, *BASE, *user), layout=layout, model=MODEL)
    flags = [word.partition("=")[0] for word in argv if word.startswith("--")]
    for flag in (
        "--num-layers",
        "--global-batch-size",
        "--load",
        "--save",
        "--ckpt-format",
        "--exit-signal-handler",
    ):
        assert flags.count(flag) == 1, flag
    assert flags.count("--max-position-embeddings") == 1 and "64" in argv  # the user's, not the sequence
    # The distributed optimizer's checkpoint must reshard to another TP/PP, not just DP.
    assert "--use-distributed-optimizer" in argv and argv[-1] == "--dist-ckpt-optim-fully-reshardable"


def test_pretrain_command_checks_the_command_and_the_layouts_batch() -> None:
    layout = Layout(tp=1, pp=2, dp=2, micro_batch=1, global_batch=8)
    torchrun = _torchruns(layout)["n1"]
    with pytest.raises(InvalidArgument, match="--micro-batch-size cannot be given"):
        pretrain_command(torchrun, (SCRIPT, *BASE, "--micro-batch-size", "4"), layout=layout, model=MODEL)
    other = Layout(tp=1, pp=2, dp=2, micro_batch=1, global_batch=16)
    with pytest.raises(InvalidArgument, match="global_batch 16 differs from the model's 8"):
        pretrain_command(torchrun, (SCRIPT, *BASE), layout=other, model=MODEL)
