"""scripts/bench/classify_learned.py: the learned baselines, and that the blind set is never read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from tests.bench_script import load_bench

BENCH = load_bench("classify_learned")


@dataclass(frozen=True)
class _Line:
    text: str
    status: str


def test_tokens_drop_long_numbers_and_pair_words() -> None:
    assert BENCH.tokens("NCCL error 12345 at rank 7") == [
        "nccl",
        "error",
        "at",
        "rank",
        "7",
        "nccl error",
        "error at",
        "at rank",
        "rank 7",
    ]


def test_models_give_a_seen_line_its_label() -> None:
    lines = [
        ("CUDA error: an illegal memory access was encountered", "illegal_memory_access"),
        ("NCCL watchdog timeout after 600000 milliseconds", "nccl_timeout"),
        ("iteration 10 lm loss 7.1", "none"),
    ]
    docs = [BENCH.tokens(text) for text, _ in lines]
    labels = [label for _, label in lines]
    for model in (BENCH.NaiveBayes(docs, labels), BENCH.NearestLine(docs, labels)):
        assert [model.predict(d) for d in docs] == labels
    assert BENCH.NearestLine(docs, labels).predict(BENCH.tokens("zzz qqq")) == "none"  # no known token


def test_leaves_each_spent_set_out_and_never_reads_the_blind_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {
        "train-e": [_Line("CUDA error: illegal memory access", "illegal_memory_access")],
        "train-b": [_Line("iteration 1 loss 2.0", "none")],
        "dev-e": [_Line("watchdog caught collective operation timeout", "nccl_timeout")],
        "dev-b": [_Line("iteration 2 loss 1.9", "none")],
        "s1-e": [_Line("illegal memory access was encountered", "illegal_memory_access")],
        "s1-b": [_Line("iteration 3 loss 1.8", "none")],
    }

    def load(name: str) -> list[_Line]:
        assert not name.startswith("blind"), "the blind set was read"
        return data[name]

    fake = SimpleNamespace(
        SETS={
            "train": ("train-e", "train-b"),
            "dev": ("dev-e", "dev-b"),
            "s1": ("s1-e", "s1-b"),
            "held_out": ("blind-e", "blind-b"),
        },
        load=load,
    )
    monkeypatch.setattr(BENCH, "_corpus", lambda: fake)
    BENCH.main([])
    out = json.loads(capsys.readouterr().out)
    assert out["left_out"] == ["s1"]
    assert out["s1"]["n"] == 1 and out["s1"]["benign_n"] == 1
    assert out["knn_status_acc"] == 1.0 and out["knn_benign_fired"] == 0


def test_the_fallback_names_only_lines_no_rule_matched() -> None:
    @dataclass(frozen=True)
    class _Result:
        rule: str
        status: SimpleNamespace

    class _Rules:  # one rule: lines with "CUDA" are cuda_error
        def classify_line(self, text: str) -> _Result:
            hit = "CUDA" in text
            return _Result("cuda" if hit else "", SimpleNamespace(value="cuda_error" if hit else "none"))

    data = {
        "t-e": [_Line("watchdog caught collective operation timeout", "nccl_timeout")],
        "t-b": [_Line("iteration 1 loss 2.0", "none")],
        "h-e": [
            _Line("CUDA failure here", "cuda_error"),  # the rule's
            _Line("the watchdog caught a collective operation timeout", "nccl_timeout"),  # the fallback's
            _Line("zzz qqq", "link_flapping"),  # nothing known: missed
        ],
        "h-b": [_Line("iteration 9 loss 1.0", "none"), _Line("collective operation timeout warning", "none")],
    }
    fake = SimpleNamespace(
        SETS={"t": ("t-e", "t-b"), "held_out": ("h-e", "h-b")}, load=data.__getitem__, load_classifier=_Rules
    )
    out = BENCH.fallback(fake, ["t"], 0.3)
    assert out["fallback_rules_status_acc"] == round(1 / 3, 4)
    assert out["fallback_status_acc"] == round(2 / 3, 4)
    assert (out["fallback_named_right"], out["fallback_named_wrong"]) == (1, 0)
    assert out["fallback_benign_fired"] == 1  # the benign look-alike: what the fallback costs
