"""ModelSpec arithmetic and Layout validation."""

from __future__ import annotations

import pytest

from unicorn_core.errors import InvalidArgument
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec

GPT3_7B = ModelSpec(layers=32, hidden=4096, heads=32, sequence=2048, vocabulary=50257, global_batch=1024)


def test_model_flops_match_narayanan_formula() -> None:
    m = GPT3_7B
    b, s, n, h, v = m.global_batch, m.sequence, m.layers, m.hidden, m.vocabulary
    expected = 72 * b * s * n * h**2 * (1 + s / (6 * h) + v / (12 * n * h))
    assert m.model_flop_per_iteration() == pytest.approx(expected, rel=1e-12)


def test_parameter_count_is_gpt3_6_7b() -> None:
    assert 6.5e9 < GPT3_7B.parameters < 6.9e9


def test_defaults_and_gqa() -> None:
    assert GPT3_7B.ffn_hidden == 4 * 4096 and GPT3_7B.num_query_groups == 32
    gqa = ModelSpec(32, 4096, 32, 2048, 32000, 512, ffn_hidden=11008, num_query_groups=8)
    assert gqa.kv_hidden == 1024
    assert gqa.layer_parameters < ModelSpec(32, 4096, 32, 2048, 32000, 512, ffn_hidden=11008).layer_parameters


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": 0}, "layers must be a positive integer"),
        ({"hidden": 4001}, "not divisible by heads"),
        ({"num_query_groups": 5}, "not divisible by num_query_groups"),
    ],
)
def test_bad_models(kwargs: dict[str, int], message: str) -> None:
    base = {
        "layers": 32,
        "hidden": 4096,
        "heads": 32,
        "sequence": 2048,
        "vocabulary": 50257,
        "global_batch": 1024,
    }
    with pytest.raises(InvalidArgument, match=message):
        ModelSpec(**{**base, **kwargs})


def test_valid_layout() -> None:
    layout = Layout(tp=4, pp=4, dp=8, micro_batch=2, global_batch=1024, vpp=2)
    layout.validate(GPT3_7B, gpus_per_node=8)
    assert layout.world_size == 128
    assert layout.num_microbatches == 64
    assert layout.describe() == "TP4.PP4.DP8 mb2 vpp2"


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (Layout(16, 1, 1, 1, 1024), "within a node"),
        (Layout(8, 3, 1, 1, 1024), "pp=3 does not divide the model's 32 layers"),
        (Layout(8, 4, 1, 1, 1024, vpp=16), "pp\\*vpp=4\\*16=64 does not divide"),
        (Layout(8, 1, 1, 1, 512), "global_batch 512 differs"),
        (Layout(2, 8, 32, 8, 1024, vpp=2), "micro-batch count \\(4\\) divisible by pp=8"),
    ],
)
def test_invalid_layouts(layout: Layout, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        layout.validate(GPT3_7B, gpus_per_node=8)


def test_heads_must_divide_tp() -> None:
    model = ModelSpec(24, 2304, 36, 2048, 50257, 512)
    with pytest.raises(InvalidArgument, match="does not divide the model's 36 attention heads"):
        Layout(8, 1, 1, 1, 512).validate(model, gpus_per_node=16)


def test_layout_construction_checks_batch() -> None:
    with pytest.raises(InvalidArgument, match="does not divide global_batch 1000"):
        Layout(1, 1, 16, 1, 1000)
    with pytest.raises(InvalidArgument, match="needs pipeline parallelism"):
        Layout(1, 1, 1, 1, 8, vpp=2)
