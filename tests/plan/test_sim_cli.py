"""``unicornctl simulate`` through click's test runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from plan.sim.cli import simulate
from unicorn_core.paths import etc_dir


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(simulate, list(args))
    return result.exit_code, result.output


def test_json_has_every_policy_against_the_ideal_causes_and_ratios() -> None:
    code, out = run("--trace", "trace-a", "--workload", "case5", "--seed", "2", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert list(data["policies"]) == ["unicorn", "megatron", "oobleck", "varuna", "bamboo", "per-task"]
    assert data["ratios"]["megatron"] == 1.0
    assert data["trace"]["sev1"] == 10
    bound = data["trace"]["node_bound_fraction"]
    for entry in data["policies"].values():
        causes = entry["lost_by_cause"]
        assert set(causes) == {"steady_state", "detection", "transition", "sub_healthy"}
        gap = data["ideal_waf"] - entry["accumulated_waf"]
        assert sum(causes.values()) == pytest.approx(gap, abs=0.01)
        assert entry["fraction_of_ideal"] == pytest.approx(
            entry["accumulated_waf"] / data["ideal_waf"], abs=1e-4
        )
        assert 0 < entry["fraction_of_ideal"] <= bound < 1
    unicorn = data["policies"]["unicorn"]["accumulated_waf"]
    megatron = data["policies"]["megatron"]["accumulated_waf"]
    assert data["ratios"]["unicorn"] == pytest.approx(unicorn / megatron, rel=1e-3)
    for name, ratio in data["unicorn_vs"].items():
        assert ratio == pytest.approx(unicorn / data["policies"][name]["accumulated_waf"], rel=1e-3)
        assert ratio > 1


def test_static_allocations_and_young_daly_snapshots_on_request() -> None:
    code, out = run(
        "--trace", "trace-b", "--workload", "case5", "--policy", "weighted", "--snapshot-every", "0", "--json"
    )
    assert code == 0, out
    data = json.loads(out)
    assert set(data["policies"]) == {"weighted", "megatron"}
    code, out = run("--trace", "trace-b", "--workload", "case5", "--policy", "unicorn", "--json")
    auto = run(
        "--trace", "trace-b", "--workload", "case5", "--policy", "unicorn", "--snapshot-every", "0", "--json"
    )
    tenth = json.loads(out)["policies"]["unicorn"]["failure_free_fraction"]
    assert json.loads(auto[1])["policies"]["unicorn"]["failure_free_fraction"] > tenth


def test_megatron_is_always_run_as_the_reference() -> None:
    code, out = run("--trace", "trace-b", "--workload", "case1", "--policy", "unicorn", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert list(data["policies"]) == ["unicorn", "megatron"]
    assert set(data["ratios"]) == {"unicorn", "megatron"}


def test_csv_trace_text_output_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "waf.png"
    code, out = run(
        "--trace",
        str(etc_dir() / "traces" / "example.csv"),
        "--workload",
        str(etc_dir() / "tasks" / "cases" / "case3.toml"),
        "--policy",
        "per-task",
        "--plot",
        str(png),
    )
    assert code == 0, out
    assert "per-task" in out and "megatron" in out and "plot written" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--trace", "trace-c", "--workload", "case1"), "neither a built-in trace (trace-a, trace-b)"),
        (("--trace", "trace-a", "--workload", "case9"), "not found"),
        (("--trace", "trace-a", "--workload", "case1", "--gpu", "tpu"), "unknown GPU type"),
        (("--trace", "trace-a", "--workload", "case1", "--spare-nodes", "16"), "spare nodes"),
    ],
)
def test_bad_input_is_a_clear_error(args: tuple[str, ...], message: str) -> None:
    code, out = run(*args)
    assert code == 1
    assert message in out
