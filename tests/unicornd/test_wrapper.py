"""The sbatch wrapper without a cluster: option checks, model files, progress lines, the
wait loop's states and signal rule, unicornd's stop decision, and the script itself."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from detect.statuses import ErrorStatus
from tests.conftest import REPO
from tests.unicornd.coord_world import apply, finding, of_kind, task, world
from unicorn_core.errors import ConfigError, InvalidArgument
from unicorn_core.protocol import AgentAction
from unicorn_core.slurm.types import JobInfo, JobState
from unicornd import decide, wrapper
from unicornd.actions import CloseIncident, Replan, SendCommand
from unicornd.cli import cli
from unicornd.state import LadderStage, TaskState
from unicornd.wrapper import WAIT_TRANSITIONS, ProgressMeter, TaskView, WaitPhase, next_phase

WRAPPER = REPO / "etc" / "unicorn-job.sbatch"
MODEL_TOML = "layers = 2\nhidden = 32\nheads = 4\nsequence = 16\nvocabulary = 64\nglobal_batch = 4\n"


# --- model files ----------------------------------------------------------------------------


def test_model_file_toml_json_and_task_file(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text(MODEL_TOML)
    doc = dict(line.split(" = ") for line in MODEL_TOML.splitlines())
    (tmp_path / "m.json").write_text(json.dumps({k: int(v) for k, v in doc.items()}))
    a = wrapper.load_model_file(tmp_path / "m.toml")
    assert a == wrapper.load_model_file(tmp_path / "m.json")
    assert (a.layers, a.ffn_hidden) == (2, 4 * 32)
    task_file = wrapper.load_model_file(REPO / "etc" / "tasks" / "gpt3-1.3b.toml")  # its [model] table
    assert (task_file.layers, task_file.hidden) == (24, 2048)


def test_a_model_file_names_the_gpu_types_a_task_accepts(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text('gpu_types = ["h100", "a100", "h100"]\n' + MODEL_TOML)
    model, kinds = wrapper.load_model_and_gpu_types(tmp_path / "m.toml")
    assert kinds == ("h100", "a100") and model == wrapper.load_model_file(tmp_path / "m.toml")
    task_file = 'gpu_types = ["h100"]\n' + (REPO / "etc" / "tasks" / "gpt3-1.3b.toml").read_text()
    (tmp_path / "t.toml").write_text(task_file)  # a task file: gpu_types beside its [model]
    assert wrapper.load_model_and_gpu_types(tmp_path / "t.toml")[1] == ("h100",)
    (tmp_path / "any.toml").write_text(MODEL_TOML)
    assert wrapper.load_model_and_gpu_types(tmp_path / "any.toml")[1] == ()
    for bad in ('gpu_types = "h100"', 'gpu_types = ["h 100"]', "gpu_types = [1]"):
        (tmp_path / "bad.toml").write_text(f"{bad}\n{MODEL_TOML}")
        with pytest.raises(ConfigError, match="gpu_types must be a list of GPU type names"):
            wrapper.load_model_and_gpu_types(tmp_path / "bad.toml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (MODEL_TOML + "depth = 3\n", "unknown field(s) depth; valid: layers"),
        ("layers = 2\n", "missing field(s) hidden, heads, sequence, vocabulary, global_batch"),
        (MODEL_TOML.replace("layers = 2", "layers = true"), "layers must be a positive integer, got True"),
        (MODEL_TOML.replace("heads = 4", "heads = 5"), "hidden 32 is not divisible by heads 5"),
        ("layers = ", "invalid TOML"),
    ],
)
def test_bad_model_file_names_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"model file .*m\.toml") as err:
        wrapper.load_model_file(path)
    assert message in str(err.value)


# --- names and commands ---------------------------------------------------------------------


def test_task_ids_and_default_names() -> None:
    assert wrapper.task_id_for("gpt.7b", 42) == "gpt.7b.42"
    assert wrapper.default_name("my job/1") == "my_job_1"
    assert wrapper.default_name("") == "task"
    with pytest.raises(InvalidArgument, match=r"must match \[A-Za-z0-9_.-\]\+"):
        wrapper.task_id_for("a b", 1)


def test_command_resolution(tmp_path: Path) -> None:
    exe = tmp_path / "bin" / "train"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (tmp_path / "t.py").write_text("")
    (tmp_path / "plain").write_text("")
    path = str(exe.parent)
    assert wrapper.resolve_command(["train", "--x"], cwd=tmp_path, path=path) == (str(exe), "--x")
    assert wrapper.resolve_command(["./t.py"], cwd=tmp_path, path="") == (str(tmp_path / "t.py"),)
    for argv, message in [
        ([], "no training command"),
        (["nope"], "not found on PATH"),
        (["./missing"], "no such file"),
        (["./plain"], "not executable"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            wrapper.resolve_command(argv, cwd=tmp_path, path=path)


# --- what the job's output shows ------------------------------------------------------------


def test_progress_lines_show_changes_only() -> None:
    first = TaskView(TaskState.LAUNCHING, "TP1.PP2.DP1 mb1", ("n1", "n2"), None, None)
    assert wrapper.progress_lines(None, first) == ["state launching", "layout TP1.PP2.DP1 mb1 on n[1-2]"]
    assert wrapper.progress_lines(first, first) == []
    hurt = TaskView(TaskState.RECOVERING, "TP1.PP2.DP1 mb1", ("n1", "n2"), 7, "w.1 lost_connection on n2")
    assert wrapper.progress_lines(first, hurt) == ["state recovering", "incident w.1 lost_connection on n2"]
    healed = TaskView(TaskState.RUNNING, "TP1.PP1.DP1 mb1", ("n1",), 9, None)
    assert wrapper.progress_lines(hurt, healed) == [
        "state running",
        "layout TP1.PP1.DP1 mb1 on n1",
        "incident closed",
    ]


def test_progress_meter_rate_limits_iteration_lines() -> None:
    meter = ProgressMeter(interval_s=10.0)
    assert meter.line(None, 0.0) is None
    assert meter.line(5, 0.0) == "iteration 5"
    assert meter.line(9, 5.0) is None  # within the interval
    assert meter.line(25, 10.0) == "iteration 25 (+20 in 10 s, 2.00 it/s)"
    assert meter.line(25, 30.0) is None  # no progress: nothing to say


def test_log_location_names_the_agent_run_dir() -> None:
    line = wrapper.log_location("pfx", 7, ["n1", "n2", "n3"])
    assert line.endswith("/tmp/unicorn/pfx/7/<node>/train.log on node(s) n[1-3]")


# --- the wait loop's states and signals -----------------------------------------------------


def test_wait_transitions_every_pair() -> None:
    for old, new in itertools.product(WaitPhase, WaitPhase):
        if new in WAIT_TRANSITIONS[old]:
            assert next_phase(old, new) is new
        else:
            with pytest.raises(InvalidArgument, match="is not allowed"):
                next_phase(old, new)


def _job(state: JobState, restarts: int) -> JobInfo:
    return JobInfo(7, "w", state, state.value, "None", ("n1",), 1, True, restarts, "root")


@pytest.mark.parametrize(
    ("sig", "job", "run", "stop"),
    [
        (signal.SIGUSR1, None, 0, True),  # the time limit is near
        (signal.SIGINT, None, 0, True),
        (signal.SIGTERM, _job(JobState.COMPLETING, 0), 0, True),  # scancel (measured: COMPLETING)
        (signal.SIGTERM, _job(JobState.CANCELLED, 2), 2, True),
        (signal.SIGTERM, _job(JobState.COMPLETING, 1), 0, False),  # requeue: Slurm counted a restart
        (signal.SIGTERM, _job(JobState.PENDING, 1), 1, False),
        (signal.SIGTERM, None, 0, False),  # unreadable: unicornd sees the job end by itself
    ],
)
def test_which_signals_stop_the_task(sig: int, job: JobInfo | None, run: int, stop: bool) -> None:
    assert wrapper.signal_means_stop(sig, job, run) is stop


# --- unicornd's decision ----------------------------------------------------------------------


def test_stop_decision_stops_agents_releases_nodes_closes_incident() -> None:
    snap = world(3, [task("w", 7, ["n1", "n2"]), task("o", 8, ["n3"])])
    snap = apply(
        snap, decide.on_finding(snap, finding("f1", 7, "n2", ErrorStatus.CONNECTION_REFUSED_RESET), 100.0)
    )
    assert snap.open_incident("w") is not None
    d = decide.on_task_stop(snap, "w", 200.0, why="job cancelled")
    after = apply(snap, d)
    assert after.tasks["w"].state is TaskState.STOPPED and after.tasks["w"].nodes == ()
    assert after.owner("n1") is None and (owner := after.owner("n3")) is not None and owner.task_id == "o"
    stops = [a for a in d.actions if isinstance(a, SendCommand)]
    assert [(a.job_id, a.node, a.action) for a in stops] == [
        (7, "n1", AgentAction.STOP),
        (7, "n2", AgentAction.STOP),
    ]
    assert len(of_kind(d.actions, CloseIncident)) == 1 and len(of_kind(d.actions, Replan)) == 1
    assert all(i.stage is LadderStage.CLOSED for i in after.incidents.values())
    assert decide.on_task_stop(after, "w", 300.0, why="again").empty  # a repeated stop is a no-op
    with pytest.raises(InvalidArgument, match="unknown task"):
        decide.on_task_stop(snap, "nope", 200.0, why="x")


# --- the CLI and the script -------------------------------------------------------------------


def test_register_rejects_bad_options_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text(MODEL_TOML)
    base = ["task", "register", "--dry-run", "--model", str(tmp_path / "m.toml")]
    runner = CliRunner()
    cases = [
        (
            [*base, "--weight", "3", "--", "true"],
            {},
            "--weight = '3': the weight must be a number between 0.5",
        ),
        ([*base, "--", "true"], {"UNICORN_WEIGHT": "x"}, "$UNICORN_WEIGHT (from sbatch --unicorn-weight"),
        ([*base, "--", "true"], {"UNICORN_MIN_GPUS": "0"}, "min GPUs must be an integer >= 1"),
        ([*base, "--min-gpus", "4", "--max-gpus", "2", "--", "true"], {}, "--max-gpus 2 is below"),
        ([*base, "--", "no-such-program-here"], {}, "not found on PATH"),
        ([*base, "--framework", "jax", "--", "true"], {}, "'jax' is not one of"),
        (["task", "register", "--model", str(tmp_path / "m.toml"), "--", "true"], {}, "--job-id and --nodes"),
    ]
    for args, env, message in cases:
        result = runner.invoke(cli, args, env=env)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)


def test_register_refuses_a_megatron_command_that_conflicts_with_unicorn(tmp_path: Path) -> None:
    """Exit 2 naming the flag and why, with or without --dry-run (sbatch --check): refused
    before unicornd is asked, so nothing is registered."""
    (tmp_path / "m.toml").write_text(MODEL_TOML)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    base = ["task", "register", "--model", str(tmp_path / "m.toml"), "--framework", "megatron"]
    good = [str(script), "--save", str(tmp_path / "ckpt"), "--save-interval", "10", "--lr", "1e-4"]
    runner = CliRunner()
    for extra in (["--dry-run"], ["--job-id", "7", "--nodes", "n[1-2]"]):
        result = runner.invoke(cli, [*base, *extra, "--", *good, "--tensor-model-parallel-size=2"])
        assert result.exit_code == 2, result.output
        assert "--tensor-model-parallel-size cannot be given to a task under unicorn" in result.output
        assert "registered" not in result.output
    shape = runner.invoke(cli, [*base, "--dry-run", "--", *good, "--num-layers", "24"])
    assert shape.exit_code == 2 and "--num-layers 24 differs from the model file's layers = 2" in shape.output
    ok = runner.invoke(cli, [*base, "--dry-run", "--", *good])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["command"] == good


def test_register_dry_run_takes_defaults_from_the_spank_variables(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text(MODEL_TOML)
    args = ["task", "register", "--dry-run", "--model", str(tmp_path / "m.toml"), "--name", "x", "true", "-v"]
    result = CliRunner().invoke(cli, args, env={"UNICORN_WEIGHT": "1.25", "UNICORN_MIN_GPUS": "2"})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert (doc["weight"], doc["min_gpus"], doc["task_id"]) == (1.25, 2, "x")
    assert Path(doc["command"][0]).is_absolute() and doc["command"][1:] == ["-v"]


def test_register_gpu_types_option_overrides_the_model_file(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text('gpu_types = ["a100"]\n' + MODEL_TOML)
    base = ["task", "register", "--dry-run", "--model", str(tmp_path / "m.toml"), "--name", "x"]
    from_file = CliRunner().invoke(cli, [*base, "true"])
    assert from_file.exit_code == 0 and json.loads(from_file.output)["gpu_types"] == ["a100"], (
        from_file.output
    )
    given = CliRunner().invoke(cli, [*base, "--gpu-types", "h100, h200", "true"])
    assert given.exit_code == 0 and json.loads(given.output)["gpu_types"] == ["h100", "h200"], given.output
    bad = CliRunner().invoke(cli, [*base, "--gpu-types", "h 100", "true"])
    assert bad.exit_code == 2 and "gpu type 'h 100'" in bad.output, bad.output


def test_script_header_is_what_job_submit_lua_requires() -> None:
    header = []
    for line in WRAPPER.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            break
        header.append(line)
    assert "#UNICORN-WRAPPER v1" in header and "#SBATCH --no-kill" in header
    assert any(line.startswith("#SBATCH --signal=B:USR1@") for line in header)


def test_script_check_mode_rejects_a_bad_weight(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text(MODEL_TOML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["UNICORNCTL"] = str(Path(sys.executable).parent / "unicornctl")
    run = subprocess.run(
        ["bash", str(WRAPPER), "--check", "--model", str(tmp_path / "m.toml"), "--weight", "2.5", "--", "x"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert run.returncode == 2 and "the weight must be a number between 0.5 and 2.0" in run.stderr, run
    outside = subprocess.run(
        ["bash", str(WRAPPER), "--", "true"], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert outside.returncode == 2 and "submit this script with sbatch" in outside.stderr
