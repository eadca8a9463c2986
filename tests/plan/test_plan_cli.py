"""``unicornctl plan`` through click's test runner (the group is mounted by the lead)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from plan.cli import plan
from unicorn_core.paths import etc_dir

TASKS = etc_dir() / "tasks"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(plan, list(args))
    return result.exit_code, result.output


def test_estimate_json() -> None:
    code, out = run(
        "estimate", "--model", str(TASKS / "gpt3-7b.toml"), "--gpus", "64", "--gpu", "h100-80g", "--json"
    )
    assert code == 0, out
    data = json.loads(out)
    assert data["feasible"] is True
    assert data["layout"]["tp"] * data["layout"]["pp"] * data["layout"]["dp"] == 64
    assert data["iteration_s"] > 0 and 0 < data["mfu"] < 1
    assert abs(data["tflops_per_gpu"] - data["mfu"] * 989.0) < 0.1


def test_estimate_infeasible_exits_1_without_numbers() -> None:
    code, out = run(
        "estimate", "--model", str(TASKS / "gpt3-175b.toml"), "--gpus", "8", "--gpu", "a100-80g", "--json"
    )
    assert code == 1
    data = json.loads(out)
    assert data["feasible"] is False and "memory" in data["reason"]
    assert "iteration_s" not in data and "mfu" not in data


def test_estimate_unknown_gpu_and_bad_file(tmp_path: Path) -> None:
    code, out = run("estimate", "--model", str(TASKS / "gpt3-7b.toml"), "--gpus", "8", "--gpu", "v100")
    assert code == 2 and "unknown GPU type 'v100'" in out
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nweight = 7\n[model]\nlayers = 1\n')
    code, out = run("estimate", "--model", str(bad), "--gpus", "8", "--gpu", "a100-80g")
    assert code == 1 and "weight must be between 0.5 and 2.0, got 7" in out


def test_plan_table3_case_text() -> None:
    code, out = run("--tasks", str(TASKS / "cases" / "case1.toml"), "--nodes", "16")
    assert code == 0, out
    assert "t6-gpt3-7b" in out and "total WAF" in out and "baselines: equally" in out


def test_plan_with_failure_json() -> None:
    code, out = run(
        "--tasks", str(TASKS / "gpt3-7b.toml"), "--tasks", str(TASKS / "gpt3-1.3b.toml"),
        "--nodes", "8", "--fail", "gpt3-7b", "--json",
    )  # fmt: skip
    assert code == 0, out
    data = json.loads(out)
    assert data["event"] == {"lost_nodes": 1, "tasks_hit": ["gpt3-7b"]}
    before = sum(t["gpus"] for t in data["plan"]["tasks"]) + data["plan"]["spare_gpus"]
    after = sum(t["gpus"] for t in data["after"]["tasks"]) + data["after"]["spare_gpus"]
    assert (before, after) == (64, 56)
    hit = next(t for t in data["after"]["tasks"] if t["name"] == "gpt3-7b")
    assert hit["changed"] is True
    assert data["plan"]["total_waf_tflops"] >= max(data["baselines_waf_tflops"].values())


def test_plan_node_count_failure_and_usage_errors() -> None:
    code, out = run("--tasks", str(TASKS / "cases" / "case2.toml"), "--nodes", "16", "--fail", "3", "--json")
    assert code == 0, out
    assert json.loads(out)["event"]["lost_nodes"] == 3
    code, out = run("--tasks", str(TASKS / "cases" / "case2.toml"), "--nodes", "16", "--fail", "nobody")
    assert code == 2 and "neither a node count nor a task" in out
    code, out = run("--nodes", "16")
    assert code == 2 and "--tasks and --nodes are required" in out
    code, out = run(
        "--tasks", str(TASKS / "gpt3-7b.toml"), "--tasks", str(TASKS / "gpt3-7b.toml"), "--nodes", "4"
    )
    assert code == 1 and "appears more than once" in out
