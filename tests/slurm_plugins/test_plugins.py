"""slurm_plugins/ without a cluster: healthcheck.sh and epilog.sh run as slurmd runs them
(fake unicorn-node-check and scontrol), the bounds shared by C, Lua and Python, and
:func:`slurm_plugins.install.install_plugins`.

The same plugins inside a real Slurm cluster: ``tests/system/test_slurm_plugins.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_plugins.install import (
    EPILOG_SOURCE,
    HEALTHCHECK_SOURCE,
    LUA_SOURCE,
    SPANK_HEADER,
    SPANK_SOURCE,
    HealthCheckSettings,
    PluginError,
    build_spank,
    install_plugins,
)
from unicorn_core.taskspec import MAX_WEIGHT, MIN_WEIGHT

# ------------------------------------------------------------------------ healthcheck.sh alone


def fake_tools(tmp_path: Path, node_check_body: str, timeout_s: int = 10) -> tuple[Path, Path]:
    """A healthcheck.conf with a fake unicorn-node-check and a fake scontrol that logs its argv."""
    calls = tmp_path / "scontrol.calls"
    node_check = tmp_path / "unicorn-node-check"
    node_check.write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/node-check.args\n{node_check_body}\n')
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        f'#!/bin/bash\nprintf "%s\\n" "$*" >> {calls}\n'
        'if [[ $1 == -o ]]; then echo "NodeName=$4 Arch=x86_64 State=IDLE Reason=(null)"; fi\n'
    )
    for tool in (node_check, scontrol):
        tool.chmod(0o755)
    conf = tmp_path / "healthcheck.conf"
    conf.write_text(
        f"NODE_CHECK={node_check}\nSCONTROL={scontrol}\nTIMEOUT=/usr/bin/timeout\nTIMEOUT_S={timeout_s}\n"
        f"SLURM_CONF=/nonexistent/slurm.conf\nNODE_CHECK_ARG=--min-free-gib\nNODE_CHECK_ARG=2.5\n"
        f"FAULT_DIR={tmp_path}/faults\n"
    )
    return conf, calls


def run_as_slurmd(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A plugin script as slurmd runs it: no arguments, only ``env`` in the environment."""
    return subprocess.run(
        ["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def run_healthcheck(conf: Path, node: str = "n7") -> subprocess.CompletedProcess[str]:
    """As slurmd runs it: only SLURMD_NODENAME set."""
    return run_as_slurmd(HEALTHCHECK_SOURCE, {"SLURMD_NODENAME": node, "UNICORN_HEALTHCHECK_CONF": str(conf)})


def test_healthcheck_script_drains_on_an_unhealthy_verdict(tmp_path: Path) -> None:
    conf, calls = fake_tools(tmp_path, 'echo "unhealthy: disk:/tmp: 0.1 GiB free < 2.5 GiB" >&2; exit 1')
    res = run_healthcheck(conf)
    assert res.returncode == 1, res.stderr
    assert (tmp_path / "node-check.args").read_text().split() == [
        "--min-free-gib",
        "2.5",
        "--inject-gpu-faults",
        f"{tmp_path}/faults/n7.jsonl",
    ]
    assert calls.read_text().splitlines()[-1] == (
        "update nodename=n7 state=drain reason=unicorn healthcheck: disk:/tmp: 0.1 GiB free < 2.5 GiB"
    )


def test_healthcheck_script_drains_when_the_check_hangs(tmp_path: Path) -> None:
    conf, calls = fake_tools(tmp_path, "exec sleep 20", timeout_s=1)
    res = run_healthcheck(conf)
    assert res.returncode == 1, res.stderr
    drain = calls.read_text().splitlines()[-1]
    assert drain.endswith("reason=unicorn healthcheck: node-check did not finish within 1 s"), drain


@pytest.mark.parametrize(
    ("body", "rc", "logged"),
    [
        ("exit 0", 0, ""),  # healthy
        # The check cannot run: a broken install must not drain every node at once.
        ("echo 'No module named click' >&2; exit 3", 2, "exited 3: No module named click"),
        ("echo 'Traceback: ImportError' >&2; exit 1", 2, "without a verdict: Traceback: ImportError"),
    ],
)
def test_healthcheck_script_drains_nothing_without_an_unhealthy_verdict(
    tmp_path: Path, body: str, rc: int, logged: str
) -> None:
    conf, calls = fake_tools(tmp_path, body)
    res = run_healthcheck(conf)
    assert res.returncode == rc and logged in res.stderr, res.stderr
    assert not calls.exists(), calls.read_text()


def test_healthcheck_script_rejects_a_bad_conf(tmp_path: Path) -> None:
    conf, calls = fake_tools(tmp_path, "exit 1")
    conf.write_text(conf.read_text() + "UNICORN_CTL=/typo\n")
    res = run_healthcheck(conf)
    assert res.returncode == 2 and "unknown key UNICORN_CTL" in res.stderr
    assert not calls.exists()
    res = run_healthcheck(conf, node="n1;rm -rf /")
    assert res.returncode == 2


def constant(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    assert match is not None, f"{pattern!r} not found"
    return match[1]


def test_bounds_are_the_same_in_c_lua_and_python() -> None:
    c_src, lua_src = SPANK_SOURCE.read_text(), LUA_SOURCE.read_text()
    for bound, value in (("MIN", MIN_WEIGHT), ("MAX", MAX_WEIGHT)):
        assert float(constant(rf"#define UNICORN_{bound}_WEIGHT ([\d.]+)", c_src)) == value
        assert float(constant(rf"local {bound}_WEIGHT = ([\d.]+)", lua_src)) == value
    max_gpus = constant(r"#define UNICORN_MAX_MIN_GPUS (\d+)L", c_src)
    assert constant(r"local MAX_MIN_GPUS = (\d+)", lua_src) == max_gpus
    assert os.access(HEALTHCHECK_SOURCE, os.X_OK)  # installed by copying, mode included


# ------------------------------------------------------------------------ Epilog


def memory_tier(shm: Path, job: str) -> list[Path]:
    """What ranks and agents of ``job`` leave in a memory tier (scoped and unscoped names)."""
    folders = [shm / "snap" / f"e2e1x0.{job}" / "it-000000000003", shm / "peer" / job / "it-000000000003"]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "shard-00000.bin").write_bytes(b"x" * 4096)
    return [f.parent for f in folders]


def run_epilog(conf: Path, job: str) -> subprocess.CompletedProcess[str]:
    """As slurmd runs it: SLURM_JOB_ID set."""
    return run_as_slurmd(EPILOG_SOURCE, {"SLURM_JOB_ID": job, "UNICORN_EPILOG_CONF": str(conf)})


def epilog_conf(tmp_path: Path, job_state: str, extra: str = "") -> Path:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/bash\necho "JobId=$4 JobName=x JobState={job_state} Reason=None"\n')
    scontrol.chmod(0o755)
    conf = tmp_path / "epilog.conf"
    conf.write_text(
        f"SCONTROL={scontrol}\nTIMEOUT=/usr/bin/timeout\nSHM_DIR={tmp_path}/shm\n"
        f"SHM_DIR={tmp_path}/absent\nLOG_FILE={tmp_path}/epilog.log\n{extra}"
    )
    return conf


def test_epilog_script_removes_only_the_ended_jobs_folders(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    mine = memory_tier(shm, "12")
    others = memory_tier(shm, "112") + memory_tier(shm, "120")
    outside = tmp_path / "outside.12"
    outside.mkdir()
    (shm / "snap" / "link.12").symlink_to(outside)  # never followed
    res = run_epilog(epilog_conf(tmp_path, "COMPLETING"), "12")
    assert res.returncode == 0, res.stderr
    assert not any(f.exists() for f in mine)
    assert all(f.is_dir() for f in others) and outside.is_dir() and (shm / "snap" / "link.12").is_symlink()
    assert "unicorn-epilog job 12: removed" in (tmp_path / "epilog.log").read_text()


@pytest.mark.parametrize("state", ["PENDING", "REQUEUED", "REQUEUE_HOLD"])
def test_epilog_script_keeps_a_requeued_jobs_memory_tier(tmp_path: Path, state: str) -> None:
    mine = memory_tier(tmp_path / "shm", "12")
    res = run_epilog(epilog_conf(tmp_path, state), "12")
    assert res.returncode == 0 and f"requeued ({state}): memory tier kept" in res.stderr, res.stderr
    assert all(f.is_dir() for f in mine)


@pytest.mark.parametrize(
    ("job", "extra", "said"),
    [
        ("", "", "SLURM_JOB_ID '' is not a job id"),
        ("12; rm -rf /", "", "is not a job id"),
        ("12", "COLOR=blue\n", "unknown key 'COLOR'"),
    ],
)
def test_epilog_script_removes_nothing_on_bad_input_and_never_fails(
    tmp_path: Path, job: str, extra: str, said: str
) -> None:
    """Slurm drains a node whose Epilog fails: every problem is logged, the exit stays 0."""
    mine = memory_tier(tmp_path / "shm", "12")
    res = run_epilog(epilog_conf(tmp_path, "COMPLETING", extra), job)
    assert res.returncode == 0 and said in res.stderr, res.stderr
    assert all(f.is_dir() for f in mine)


# ------------------------------------------------------------------------ install


def test_install_skips_what_it_cannot_build_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no gcc, no scontrol, no timeout
    node_check = tmp_path / "unicorn-node-check"
    node_check.write_text("#!/bin/sh\n")
    node_check.chmod(0o755)
    result = install_plugins(
        tmp_path / "etc", tmp_path / "plugins", HealthCheckSettings(node_check=node_check, interval_s=60)
    )
    assert not any(line.startswith(("PlugStackConfig", "HealthCheck")) for line in result.conf_lines)
    assert any("SPANK plugin" in why and "gcc" in why for why in result.skipped), result.skipped
    assert any("HealthCheckProgram" in why for why in result.skipped), result.skipped
    assert not (tmp_path / "plugins" / "unicorn_spank.so").exists()


def test_install_never_overwrites_a_sites_own_job_submit_lua(tmp_path: Path) -> None:
    site = tmp_path / "etc" / "job_submit.lua"
    site.parent.mkdir()
    site.write_text("function slurm_job_submit(j, p, u) return slurm.SUCCESS end\n")
    with pytest.raises(PluginError, match="not written by unicorn"):
        install_plugins(tmp_path / "etc", tmp_path / "plugins", None)
    assert site.read_text().startswith("function slurm_job_submit")
    assert sorted(p.name for p in site.parent.iterdir()) == ["job_submit.lua"]  # nothing else placed
    assert not (tmp_path / "plugins").exists()


@pytest.mark.skipif(shutil.which("gcc") is None or not SPANK_HEADER.exists(), reason="needs gcc and spank.h")
def test_spank_build_is_reused_until_its_inputs_change(tmp_path: Path) -> None:
    so = build_spank(tmp_path)
    first = so.stat().st_mtime_ns
    assert build_spank(tmp_path) == so and so.stat().st_mtime_ns == first
    (tmp_path / "unicorn_spank.so.key").write_text("stale")
    assert build_spank(tmp_path).stat().st_mtime_ns != first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
