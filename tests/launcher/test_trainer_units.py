"""Single-process tests of the trainer's pieces: validation, data, schedule, log line, checkpoint I/O."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
import torch

from launcher.trainer import checkpoint
from launcher.trainer.config import (
    DataParallel,
    FaultInjection,
    PipelineSchedule,
    TrainConfig,
    resolve_layout,
)
from launcher.trainer.data import batch, replica_samples, sample_tokens
from launcher.trainer.logline import iteration_line
from launcher.trainer.loop import learning_rate
from launcher.trainer.model import build_stage, lm_loss, placement
from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec

TINY = ModelSpec(layers=4, hidden=64, heads=4, sequence=16, vocabulary=64, global_batch=12)


def layout_for(world: int, local: int = 4, *, model: ModelSpec = TINY, **kw: int | None) -> Layout:
    args: dict[str, int | None] = {"tp": 1, "pp": 1, "dp": None, "micro_batch": 1, "global_batch": 12}
    args.update(kw)
    return resolve_layout(world_size=world, local_world_size=local, model=model, **args)  # type: ignore[arg-type]


def test_dp_inferred_from_world() -> None:
    assert layout_for(4, tp=2).dp == 2
    assert layout_for(3).dp == 3


@pytest.mark.parametrize(
    ("world", "local", "model", "kw", "needle"),
    [
        (2, 2, ModelSpec(4, 66, 3, 16, 64, 12), {"tp": 2}, "does not divide the model's 3 attention heads"),
        (4, 4, TINY, {"tp": 1, "dp": 2}, "needs tp\\*pp\\*dp = 2 ranks, but torchrun started 4"),
        (4, 4, TINY, {"tp": 3}, "does not divide the world size 4"),
        (4, 2, TINY, {"tp": 4}, "tensor parallelism stays within a node"),
        (3, 3, TINY, {"pp": 3}, "pp=3 does not divide the model's 4 layers"),
        (4, 4, TINY, {"micro_batch": 2, "global_batch": 12}, "does not divide global_batch 12"),
    ],
)
def test_invalid_layouts_rejected_with_clear_message(
    world: int, local: int, model: ModelSpec, kw: dict[str, int], needle: str
) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        layout_for(world, local, model=model, **kw)


def test_config_rejects_ddp_with_tp_and_bad_options() -> None:
    tp2 = layout_for(2, tp=2)
    with pytest.raises(InvalidArgument, match="DDP cannot wrap"):
        TrainConfig(model=TINY, layout=tp2, iterations=4, data_parallel=DataParallel.DDP)
    assert TrainConfig(model=TINY, layout=tp2, iterations=4).dp_impl is DataParallel.FSDP
    assert TrainConfig(model=TINY, layout=layout_for(2), iterations=4).dp_impl is DataParallel.DDP
    with pytest.raises(InvalidArgument, match="needs --save-dir"):
        TrainConfig(model=TINY, layout=tp2, iterations=4, save_interval=2)
    with pytest.raises(InvalidArgument, match="beyond --iterations"):
        TrainConfig(model=TINY, layout=tp2, iterations=4, exit_at_iteration=5)
    pp2dp2 = layout_for(4, pp=2)
    with pytest.raises(InvalidArgument, match="use --pp-schedule 1f1b or --data-parallel fsdp"):
        TrainConfig(model=TINY, layout=pp2dp2, iterations=4, pp_schedule=PipelineSchedule.GPIPE)
    TrainConfig(
        model=TINY,
        layout=pp2dp2,
        iterations=4,
        pp_schedule=PipelineSchedule.GPIPE,
        data_parallel=DataParallel.FSDP,
    )
    with pytest.raises(InvalidArgument, match="outside the world"):
        TrainConfig(model=TINY, layout=tp2, iterations=4, fault=FaultInjection(iteration=1, rank=2))


def test_samples_depend_only_on_seed_and_index() -> None:
    a = sample_tokens(17, seed=1, sequence=16, vocabulary=64)
    assert a == sample_tokens(17, seed=1, sequence=16, vocabulary=64)
    assert a != sample_tokens(18, seed=1, sequence=16, vocabulary=64)
    assert a != sample_tokens(17, seed=2, sequence=16, vocabulary=64)
    stride = (a[1] - a[0]) % 64
    assert all((a[t + 1] - a[t]) % 64 == stride for t in range(16))
    whole_x, whole_y = batch(24, 12, seed=1, sequence=16, vocabulary=64)
    assert torch.equal(whole_x[:, 1:], whole_y[:, :-1])
    # DP3 and DP4 replicas together cover the same global batch in the same order.
    for dp in (3, 4):
        parts = [
            batch(*replica_samples(3, global_batch=12, dp=dp, dp_rank=r), seed=1, sequence=16, vocabulary=64)[
                0
            ]
            for r in range(dp)
        ]
        assert torch.equal(torch.cat(parts), whole_x)


def test_learning_rate_warmup_then_cosine() -> None:
    cfg = TrainConfig(
        model=TINY, layout=layout_for(1), iterations=10, lr=1e-3, min_lr=1e-4, warmup_iterations=2
    )
    assert learning_rate(1, cfg) == pytest.approx(5e-4)
    assert learning_rate(2, cfg) == pytest.approx(1e-3)
    assert learning_rate(10, cfg) == pytest.approx(1e-4)
    rates = [learning_rate(k, cfg) for k in range(2, 11)]
    assert all(a > b for a, b in itertools.pairwise(rates))


def test_megatron_log_line_format() -> None:
    line = iteration_line(
        iteration=10,
        train_iters=100,
        consumed_samples=160,
        elapsed_ms=41.27,
        learning_rate=1e-3,
        global_batch=16,
        lm_loss=4.1234567,
        wall_time_s=0.0,
    )
    assert re.search(r"\] iteration       10/     100 \| consumed samples:          160 \|", line)
    assert "elapsed time per iteration (ms): 41.3 |" in line
    assert "learning rate: 1.000000E-03 |" in line
    assert "lm loss: 4.123457E+00 |" in line
    assert "number of nan iterations:   0 |" in line
    assert "number of nan iterations:   1 |" in iteration_line(
        iteration=1,
        train_iters=1,
        consumed_samples=1,
        elapsed_ms=1,
        learning_rate=1,
        global_batch=1,
        lm_loss=math.nan,
    )


def test_stages_of_any_split_start_from_the_same_weights() -> None:
    whole = build_stage(TINY, placement(TINY, 0, 1), seed=5)
    parts = [build_stage(TINY, placement(TINY, s, 2), seed=5) for s in range(2)]
    whole_sd = whole.state_dict()
    merged = {k: v for p in parts for k, v in p.state_dict().items()}
    assert merged.keys() == whole_sd.keys()
    assert all(torch.equal(merged[k], whole_sd[k]) for k in whole_sd)
    x, y = batch(0, 2, seed=1, sequence=16, vocabulary=64)
    assert torch.allclose(parts[1](parts[0](x)), whole(x))
    assert lm_loss(whole(x), y).item() == pytest.approx(math.log(64), rel=0.05)
    other = build_stage(TINY, placement(TINY, 0, 1), seed=6)
    assert not torch.equal(other.state_dict()["head.weight"], whole_sd["head.weight"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_checkpoint_publishes_only_complete_versions(tmp_path: Path) -> None:
    assert checkpoint.load_latest({"w": torch.zeros(3)}, tmp_path) is None
    checkpoint.save({"w": torch.arange(3.0), "meta": {"seed": 1}}, 4, tmp_path)
    assert (tmp_path / "latest").read_text() == "4\n"
    # A later version whose marker was never written (crash mid-save) is not visible.
    (tmp_path / "iter_0000008").mkdir()
    weights = torch.zeros(3)
    state: dict[str, object] = {"w": weights, "meta": {"seed": 0}}
    assert checkpoint.load_latest(state, tmp_path) == 4
    assert torch.equal(weights, torch.arange(3.0))  # loaded in place
    assert state["meta"] == {"seed": 1}


def test_checkpoint_marker_corruption_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("banana\n")
    with pytest.raises(InvalidArgument, match="not an iteration number"):
        checkpoint.latest_iteration(tmp_path)
    (tmp_path / "latest").write_text("12\n")
    with pytest.raises(InvalidArgument, match="folder is missing"):
        checkpoint.latest_iteration(tmp_path)
