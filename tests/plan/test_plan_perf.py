"""Performance and memory model: never a layout that does not fit; plausible throughput."""

from __future__ import annotations

from pathlib import Path

import pytest

from plan.hardware import gpu_spec, load_gpus, parse_gpus
from plan.memory import estimate_memory
from plan.perf import (
    Infeasible,
    LayoutEstimate,
    best_layout,
    estimate_layout,
    layout_table,
)
from unicorn_core.errors import ConfigError, InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec
from unicorn_core.paths import etc_dir
from unicorn_core.taskspec import load_task_file

GPT3_175B = load_task_file(etc_dir() / "tasks" / "gpt3-175b.toml").model
GPT3_7B = load_task_file(etc_dir() / "tasks" / "gpt3-7b.toml").model


def test_gpu_table_has_all_types() -> None:
    gpus = load_gpus()
    assert set(gpus) == {"a100-40g", "a100-80g", "a800-80g", "h100-80g", "h800-80g", "h200-141g"}
    assert gpus["h200-141g"].hbm_gib > gpus["h100-80g"].hbm_gib > gpus["a100-40g"].hbm_gib
    assert gpus["h800-80g"].nvlink_gb_s < gpus["h100-80g"].nvlink_gb_s


def test_gpu_table_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="unknown GPU type 'v100'; known: a100-40g"):
        gpu_spec("v100")
    with pytest.raises(ConfigError, match=r"x\.hbm_gib must be a positive number, got -1"):
        parse_gpus(
            "[x]\npeak_bf16_tflops=1\nhbm_gib=-1\nhbm_tb_s=1\nnvlink_gb_s=1\nnetwork_gb_s=1\n", "gpus.toml"
        )
    with pytest.raises(ConfigError, match="unknown key"):
        parse_gpus("[x]\nflops=1\n", "gpus.toml")


def test_175b_does_not_fit_on_tp1_pp1() -> None:
    gpu = gpu_spec("h100-80g")
    layout = Layout(1, 1, 8, 1, GPT3_175B.global_batch, recompute=True, distributed_optimizer=True)
    est = estimate_layout(GPT3_175B, layout, gpu, 8)
    assert not est.fits and est.memory.total_gib > gpu.hbm_gib
    table = layout_table(GPT3_175B, gpu, 8)
    assert all(e.layout.tp * e.layout.pp > 1 for e in table.best.values())


@pytest.mark.parametrize("gpu_name", ["a100-40g", "h100-80g"])
def test_chosen_layouts_always_fit(gpu_name: str) -> None:
    gpu = gpu_spec(gpu_name)
    for model in (GPT3_7B, GPT3_175B):
        table = layout_table(model, gpu, 8)
        assert table.best
        for world, est in table.best.items():
            assert est.layout.world_size == world
            assert est.fits and est.memory.total_gib <= gpu.hbm_gib
            assert estimate_memory(model, est.layout).total_gib == pytest.approx(est.memory.total_gib)
            est.layout.validate(model, 8)


def test_infeasible_reports_reason_not_number() -> None:
    gpu = gpu_spec("a100-80g")
    mem = best_layout(GPT3_175B, 8, gpu, 8)
    assert isinstance(mem, Infeasible) and mem.reason.startswith("memory")
    shape = best_layout(GPT3_7B, 48, gpu, 8)
    assert isinstance(shape, Infeasible) and shape.reason.startswith("shape") and "32, 64" in shape.reason
    ok = best_layout(GPT3_7B, 64, gpu, 8)
    assert isinstance(ok, LayoutEstimate) and 0 < ok.mfu < 1


def test_memory_savers_trade_time_for_memory() -> None:
    gpu = gpu_spec("a100-80g")
    plain = Layout(2, 2, 16, 1, 1024)
    variants = {
        "plain": plain,
        "recompute": Layout(2, 2, 16, 1, 1024, recompute=True),
        "distopt": Layout(2, 2, 16, 1, 1024, distributed_optimizer=True),
    }
    est = {k: estimate_layout(GPT3_7B, v, gpu, 8) for k, v in variants.items()}
    assert est["recompute"].memory.activations_gib < est["plain"].memory.activations_gib
    assert est["recompute"].iteration_s > est["plain"].iteration_s
    assert est["distopt"].memory.states_gib < est["plain"].memory.states_gib


def test_faster_gpu_is_faster() -> None:
    a100 = best_layout(GPT3_7B, 64, gpu_spec("a100-80g"), 8)
    h100 = best_layout(GPT3_7B, 64, gpu_spec("h100-80g"), 8)
    assert isinstance(a100, LayoutEstimate) and isinstance(h100, LayoutEstimate)
    assert h100.iteration_s < a100.iteration_s


# Narayanan et al. 2021, Table 1 (A100 80GB, recomputation on, TFLOP/s counting it):
# (heads, hidden, layers, tp, pp, gpus, batch, published TFLOP/s per GPU).
NARAYANAN = [
    (24, 2304, 24, 1, 1, 32, 512, 137),
    (32, 3072, 30, 2, 1, 64, 512, 138),
    (32, 4096, 36, 4, 1, 128, 512, 142),
    (48, 6144, 40, 8, 1, 256, 1024, 135),
    (64, 8192, 48, 8, 2, 512, 1536, 138),
    (80, 10240, 60, 8, 4, 1024, 1792, 140),
    (160, 25600, 128, 8, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize(("heads", "hidden", "layers", "tp", "pp", "gpus", "batch", "published"), NARAYANAN)
def test_matches_published_megatron_throughput(
    heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, published: float
) -> None:
    model = ModelSpec(layers, hidden, heads, 2048, 51200, batch)
    dp = gpus // (tp * pp)
    best = max(
        (
            estimate_layout(model, Layout(tp, pp, dp, b, batch, recompute=True), gpu_spec("a100-80g"), 8)
            for b in (1, 2, 4, 8)
            if batch % (dp * b) == 0
        ),
        key=lambda e: e.tflops,
    )
    # hardware FLOPs = model FLOPs + the recomputed forward pass of the transformer layers
    extra = batch * model.sequence * model.layers * model.layer_forward_flop_per_token()
    hardware_tflops_per_gpu = best.tflops_per_gpu * (1 + extra / model.model_flop_per_iteration())
    assert hardware_tflops_per_gpu == pytest.approx(published, rel=0.2)
