"""slurm_plugins/: the SPANK plugin, job_submit.lua, the HealthCheckProgram and the Epilog.

System tests run on a private 3-node dev cluster with a 2 s HealthCheckInterval: jobs
run on n1, the health-check tests inject GPU faults into n2 and n3 and restore them.
The script-level tests of healthcheck.sh and epilog.sh (fake unicorn-node-check and scontrol),
the bounds check and the install tests need no cluster: ``tests/slurm_plugins/test_plugins.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import DevCluster, private_cluster
from tests.slurm_plugins.test_plugins import memory_tier

HEALTH_CHECK_INTERVAL_S = 2
# A job, a drain or a health check round is seconds away; these bounds only stop a hang.
WAIT_S = 30.0

# What job_submit.lua looks for in the unicorn wrapper (jobs run on n1; faults go to n2, n3).
WRAPPER_HEADER = "#!/bin/bash\n#UNICORN-WRAPPER v1\n#SBATCH --no-kill\n#SBATCH --nodelist=n1\n"
WRAPPER_LIKE = (
    WRAPPER_HEADER
    + """{{ echo "UNICORN_WEIGHT=${{UNICORN_WEIGHT-unset}}"
  echo "UNICORN_MIN_GPUS=${{UNICORN_MIN_GPUS-unset}}"; }} > {out}
"""
)


def wait_until(pred: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
    """Poll ``pred`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def pcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    args = ("--nodes", "3", "--gpus-per-node", "1", "--health-check-interval", str(HEALTH_CHECK_INTERVAL_S))
    with private_cluster(tmp_path_factory, "plugins", *args) as c:
        yield c


def job_fields(c: DevCluster, job_id: str) -> dict[str, str]:
    line = c.slurm("scontrol", "-o", "show", "job", job_id).stdout.strip()
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


def node_fields(c: DevCluster, node: str) -> dict[str, str]:
    line = c.slurm("scontrol", "-o", "show", "node", node).stdout.strip()
    reason = line.split(" Reason=", 1)[1] if " Reason=" in line else ""
    fields = dict(tok.split("=", 1) for tok in line.split(" Reason=")[0].split() if "=" in tok)
    fields["Reason"] = reason
    return fields


def job_count(c: DevCluster) -> int:
    return len(c.slurm("scontrol", "-o", "show", "job").stdout.splitlines())


def wrapper_job(c: DevCluster, tmp_path: Path, name: str) -> tuple[Path, Path]:
    out = tmp_path / f"{name}.env"
    script = tmp_path / f"{name}.sh"
    script.write_text(WRAPPER_LIKE.format(out=out))
    return script, out


def sbatch(c: DevCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return c.slurm("sbatch", "--parsable", "--output=/dev/null", *args, check=False)


def read_env_file(path: Path) -> dict[str, str]:
    wait_until(lambda: path.exists() and path.read_text().count("\n") == 2, f"the job to write {path}")
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


# ------------------------------------------------------------------------ SPANK plugin


@pytest.mark.system
@pytest.mark.slurm_release
def test_spank_options_reach_the_batch_script_and_are_recorded(pcluster: DevCluster, tmp_path: Path) -> None:
    script, out = wrapper_job(pcluster, tmp_path, "both")
    sub = sbatch(pcluster, "--unicorn-weight=1.25", "--unicorn-min-gpus=2", str(script))
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    assert read_env_file(out) == {"UNICORN_WEIGHT": "1.25", "UNICORN_MIN_GPUS": "2"}
    fields = job_fields(pcluster, job_id)
    assert fields["AdminComment"] == 'unicorn:{"v":1,"weight":1.25,"min_gpus":2}'
    assert fields["Requeue"] == "1"

    # Without the options nothing is exported; the record says unicornd's defaults apply.
    script, out = wrapper_job(pcluster, tmp_path, "none")
    sub = sbatch(pcluster, "--export=NONE", str(script))
    assert sub.returncode == 0, sub.stderr
    assert read_env_file(out) == {"UNICORN_WEIGHT": "unset", "UNICORN_MIN_GPUS": "unset"}
    assert job_fields(pcluster, sub.stdout.strip())["AdminComment"] == 'unicorn:{"v":1}'


@pytest.mark.system
@pytest.mark.slurm_release
def test_spank_option_reaches_a_step_inside_the_job(pcluster: DevCluster, tmp_path: Path) -> None:
    # srun options travel to slurmstepd and are exported there, step by step (job_submit.lua
    # sees job allocations only, never steps).
    out = tmp_path / "step.out"
    script = tmp_path / "step.sh"
    script.write_text(WRAPPER_HEADER + f"srun --unicorn-weight=0.75 printenv UNICORN_WEIGHT > {out}\n")
    sub = sbatch(pcluster, str(script))
    assert sub.returncode == 0, sub.stderr
    wait_until(lambda: out.exists() and out.read_text().endswith("\n"), "the step's output")
    assert out.read_text() == "0.75\n"


@pytest.mark.system
@pytest.mark.slurm_release
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--unicorn-weight=3", "between 0.5 and 2.0"),
        ("--unicorn-weight=0.49", "between 0.5 and 2.0"),
        ("--unicorn-weight=abc", "between 0.5 and 2.0"),
        ("--unicorn-weight=0x1p0", "between 0.5 and 2.0"),
        ("--unicorn-weight=nan", "between 0.5 and 2.0"),
        ("--unicorn-min-gpus=0", "between 1 and 1000000"),
        ("--unicorn-min-gpus=1.5", "between 1 and 1000000"),
        ("--unicorn-min-gpus=-4", "between 1 and 1000000"),
    ],
)
def test_spank_rejects_bad_values_before_submission(
    pcluster: DevCluster, tmp_path: Path, option: str, message: str
) -> None:
    script, _ = wrapper_job(pcluster, tmp_path, "bad")
    before = job_count(pcluster)
    sub = sbatch(pcluster, option, str(script))
    assert sub.returncode != 0
    assert f"unicorn: {option}: " in sub.stderr and message in sub.stderr, sub.stderr
    assert job_count(pcluster) == before  # nothing reached the controller


# ------------------------------------------------------------------------ job_submit.lua


@pytest.mark.system
@pytest.mark.slurm_release
@pytest.mark.parametrize("weight", ["2.5", "0.1", "heavy", "1e0"])
def test_job_submit_lua_rejects_a_bad_weight(pcluster: DevCluster, tmp_path: Path, weight: str) -> None:
    # The environment route bypasses the SPANK client check: the controller must catch it.
    script, _ = wrapper_job(pcluster, tmp_path, "envweight")
    before = job_count(pcluster)
    sub = sbatch(pcluster, f"--export=ALL,UNICORN_WEIGHT={weight}", str(script))
    assert sub.returncode != 0
    assert f"unicorn: UNICORN_WEIGHT={weight}: the weight must be a decimal number between 0.5 and 2.0" in (
        sub.stderr
    )
    assert job_count(pcluster) == before


@pytest.mark.system
@pytest.mark.slurm_release
def test_job_submit_lua_enforces_what_unicorn_needs(pcluster: DevCluster, tmp_path: Path) -> None:
    script, _ = wrapper_job(pcluster, tmp_path, "req")
    before = job_count(pcluster)
    cases: list[tuple[list[str], str]] = [
        (["--no-requeue", str(script)], "must stay requeueable"),
        (["--export=ALL,UNICORN_MIN_GPUS=0", str(script)], "UNICORN_MIN_GPUS=0: min GPUs must be an integer"),
    ]
    no_kill = tmp_path / "nokill.sh"
    no_kill.write_text(script.read_text().replace("#SBATCH --no-kill\n", ""))
    cases.append(([str(no_kill)], "must carry '#SBATCH --no-kill'"))
    late = tmp_path / "late.sh"  # sbatch ignores directives after the first command, so does the check
    late.write_text(no_kill.read_text().replace("{ echo", "true\n#SBATCH --no-kill\n{ echo"))
    cases.append(([str(late)], "must carry '#SBATCH --no-kill'"))
    future = tmp_path / "v2.sh"
    future.write_text(script.read_text().replace("#UNICORN-WRAPPER v1", "#UNICORN-WRAPPER v2"))
    cases.append(([str(future)], "wrapper version v2 is not known here"))
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/bash\ntrue\n")
    cases.append((["--unicorn-weight=1.5", str(plain)], "need the unicorn wrapper script"))
    for args, message in cases:
        sub = sbatch(pcluster, *args)
        assert sub.returncode != 0 and message in sub.stderr, (args, sub.stderr)
    assert job_count(pcluster) == before

    # A unicorn job cannot lose requeue later either.
    sub = sbatch(pcluster, "--hold", str(script))
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    upd = pcluster.slurm("scontrol", "update", f"jobid={job_id}", "requeue=0", check=False)
    assert upd.returncode != 0 and job_fields(pcluster, job_id)["Requeue"] == "1"
    pcluster.slurm("scancel", job_id)


@pytest.mark.system
@pytest.mark.slurm_release
def test_job_submit_lua_leaves_other_jobs_untouched(pcluster: DevCluster, tmp_path: Path) -> None:
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/bash\ntrue\n")
    # An inherited out-of-range UNICORN_WEIGHT does not make a job a unicorn job.
    sub = sbatch(pcluster, "--hold", "--no-requeue", "--export=ALL,UNICORN_WEIGHT=7", str(plain))
    assert sub.returncode == 0, sub.stderr
    fields = job_fields(pcluster, sub.stdout.strip())
    assert "AdminComment" not in fields and fields["Requeue"] == "0"
    pcluster.slurm("scancel", sub.stdout.strip())


# ------------------------------------------------------------------------ HealthCheckProgram


def inject_gpu_fault(c: DevCluster, node: str) -> Path:
    fault = c.state_dir / "faults" / f"{node}.jsonl"
    fault.write_text(json.dumps({"gpu": 0, "kind": "xid", "value": 79}) + "\n")
    return fault


@pytest.mark.system
@pytest.mark.slurm_release
def test_healthcheck_drains_the_node_with_an_injected_gpu_fault(pcluster: DevCluster) -> None:
    assert node_fields(pcluster, "n2")["State"] == "IDLE"
    fault = inject_gpu_fault(pcluster, "n2")
    try:
        took = wait_until(lambda: "DRAIN" in node_fields(pcluster, "n2")["State"], "n2 to be drained")
        assert took < HEALTH_CHECK_INTERVAL_S + 10
        reason = node_fields(pcluster, "n2")["Reason"]
        assert reason.startswith("unicorn healthcheck: gpu-injected: gpu 0: injected xid 79"), reason
        # Only the faulty node: the others ran the same check in the same rounds.
        for other in ("n1", "n3"):
            assert "DRAIN" not in node_fields(pcluster, other)["State"]
        log = (pcluster.state_dir / "log" / "healthcheck.log").read_text()
        assert re.search(r"unicorn-healthcheck n2: drained: unicorn healthcheck: gpu-injected", log), log
    finally:
        fault.unlink(missing_ok=True)
        pcluster.slurm("scontrol", "update", "nodename=n2", "state=resume", check=False)


@pytest.mark.system
@pytest.mark.slurm_release
def test_healthcheck_keeps_an_existing_drain_reason(pcluster: DevCluster) -> None:
    log = pcluster.state_dir / "log" / "healthcheck.log"
    pcluster.slurm("scontrol", "update", "nodename=n3", "state=drain", "reason=operator: new DIMMs")
    fault = inject_gpu_fault(pcluster, "n3")
    try:
        wait_until(
            lambda: log.exists() and "n3: unhealthy, already draining/drained" in log.read_text(),
            "a health check round on n3",
        )
        assert node_fields(pcluster, "n3")["Reason"].startswith("operator: new DIMMs")
    finally:
        fault.unlink(missing_ok=True)
        pcluster.slurm("scontrol", "update", "nodename=n3", "state=resume", check=False)


# ------------------------------------------------------------------------ Epilog


@pytest.mark.system
@pytest.mark.slurm_release
def test_epilog_frees_the_memory_tier_of_an_ended_job(pcluster: DevCluster) -> None:
    """A real job on n1 snapshots into the cluster's memory tier; once it ends, slurmd's
    Epilog has removed its folders and logged it, and left another job's alone."""
    shm = Path(pcluster.env["UNICORN_CKPT__SHM_DIR"])
    other = memory_tier(shm, "999999")
    script = (
        'mkdir -p "$SHM/snap/e2e1x0.$SLURM_JOB_ID/it-000000000001" "$SHM/peer/$SLURM_JOB_ID"\n'
        'head -c 1M /dev/zero > "$SHM/snap/e2e1x0.$SLURM_JOB_ID/it-000000000001/shard-00000.bin"\n'
    )
    res = sbatch(pcluster, "--nodelist=n1", f"--export=ALL,SHM={shm}", "--wrap", script)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    log = pcluster.state_dir / "log" / "epilog.log"
    wait_until(lambda: log.exists() and f"job {job}: removed" in log.read_text(), "the epilog of the job")
    assert not (shm / "snap" / f"e2e1x0.{job}").exists() and not (shm / "peer" / job).exists()
    assert all(f.is_dir() for f in other)
    for folder in other:
        shutil.rmtree(folder)


@pytest.mark.system
@pytest.mark.slurm_release
def test_dev_cluster_rejects_a_negative_health_check_interval(tmp_path: Path) -> None:
    res = DevCluster(tmp_path / "c", {}).script("up", "--health-check-interval", "-1", check=False)
    assert res.returncode == 1 and "health check interval must be >= 0 s, got -1" in res.stderr
