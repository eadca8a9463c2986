"""etc/unicornd.service and scripts/install (into a temporary root)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install"
UNIT = REPO / "etc" / "unicornd.service"
VENV = Path(sys.executable).parent.parent


def parse_unit(text: str) -> configparser.ConfigParser:
    """A systemd unit as INI (our unit repeats no key, so a strict parser fits)."""
    unit = configparser.ConfigParser(interpolation=None, comment_prefixes=("#", ";"))
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string(text)
    return unit


def install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(INSTALL),
            "--root",
            str(root),
            "--service-user",
            "slurm",
            "--venv",
            str(VENV),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_unit_orders_restarts_and_hardens() -> None:
    unit = parse_unit(UNIT.read_text())
    after, wants = unit["Unit"]["After"].split(), unit["Unit"]["Wants"].split()
    assert {"slurmctld.service", "redis-server.service"} <= set(after) & set(wants)
    svc = unit["Service"]
    assert svc["Restart"] == "on-failure" and float(svc["RestartSec"].removesuffix("s")) > 0
    assert svc["ExecStart"].split()[1:] == ["--config", "/etc/unicorn/unicorn.toml"]
    assert svc["ExecStart"].split()[0].endswith("/bin/unicornd")
    assert svc["EnvironmentFile"] == "-/etc/unicorn/unicornd.env"
    assert svc["User"] not in ("", "root") and svc["Group"] == "unicorn"
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    assert svc["ProtectHome"] == "yes" and svc["PrivateTmp"] == "yes"
    assert int(svc["LimitNOFILE"]) >= 4096
    assert svc["ReadWritePaths"] == "/var/lib/unicorn" and svc["StateDirectory"] == "unicorn"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_install_places_the_tree_and_is_idempotent(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = install(root)
    assert first.returncode == 0, first.stderr
    unit_path = root / "etc/systemd/system/unicornd.service"
    config = root / "etc/unicorn/unicorn.toml"
    assert config.read_text() == (REPO / "etc/unicorn.toml").read_text()
    assert (config.stat().st_mode & 0o777) == 0o640
    svc = parse_unit(unit_path.read_text())["Service"]
    assert svc["ExecStart"].split()[0] == f"{VENV}/bin/unicornd" and svc["User"] == "slurm"
    for wrapper in (REPO / "etc").glob("*.sbatch"):
        placed = root / "usr/local/share/unicorn" / wrapper.name
        assert placed.read_text() == wrapper.read_text() and placed.stat().st_mode & 0o111
    include = (root / "etc/unicorn/slurm-unicorn.conf").read_text().splitlines()
    for line in include[1:]:  # what the plugins installed, e.g. HealthCheckProgram=<root>/...
        key, _, value = line.partition("=")
        if key in ("PlugStackConfig", "HealthCheckProgram"):
            assert Path(value).is_file() and str(root) in value
    if shutil.which("scontrol") and shutil.which("timeout"):  # the Epilog frees the default memory tier
        epilog = root / "usr/local/lib/unicorn/epilog.sh"
        assert f"Epilog={epilog}" in include and epilog.stat().st_mode & 0o111
        conf = (epilog.parent / "epilog.conf").read_text().splitlines()
        assert "SHM_DIR=/dev/shm/unicorn-ckpt" in conf, conf
    secrets = {n: root / "etc/unicorn" / f"redis-{n}.pass" for n in ("unicornd", "operator", "user")}
    modes = {n: p.stat().st_mode & 0o777 for n, p in secrets.items()}
    assert modes == {"unicornd": 0o600, "operator": 0o640, "user": 0o644}
    values = {n: p.read_text() for n, p in secrets.items()}
    assert len(set(values.values())) == 3 and all(len(v.strip()) >= 32 for v in values.values())
    acl_line = (root / "etc/unicorn/redis-unicornd.acl").read_text()
    assert acl_line.startswith("user unicornd reset on #") and "~unicorn:* +@all -@dangerous" in acl_line
    assert values["unicornd"].strip() not in acl_line  # only the digest
    second = install(root)
    assert second.returncode == 0, second.stderr
    ours = [line for line in second.stdout.splitlines() if line.startswith(("installed /", "unchanged /"))]
    assert ours and all(line.startswith("unchanged") for line in ours), second.stdout
    assert {n: p.read_text() for n, p in secrets.items()} == values  # never rotated by a rerun


def test_an_existing_config_is_never_overwritten(tmp_path: Path) -> None:
    root = tmp_path / "root"
    config = root / "etc/unicorn/unicorn.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[redis]\nkey_prefix = "site"\n')
    res = install(root, "--no-plugins")
    assert res.returncode == 0, res.stderr
    assert config.read_text() == '[redis]\nkey_prefix = "site"\n'
    assert f"kept {config} (edited; not overwritten)" in res.stdout
    default = root / "usr/local/share/unicorn/unicorn.toml.default"
    assert default.read_text() == (REPO / "etc/unicorn.toml").read_text()


def test_epilog_follows_the_installed_memory_tier(tmp_path: Path) -> None:
    """The Epilog frees what ``[ckpt] shm_dir`` names; none without a memory tier; a
    relative path is refused. The script's default matches the config's."""
    from unicorn_core.config import CkptConfig

    text = INSTALL.read_text()
    assert f'DEFAULT_SHM_DIR = "{CkptConfig().shm_dir}"' in text
    config = tmp_path / "root/etc/unicorn/unicorn.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[ckpt]\nshm_dir = ""\n')
    res = install(tmp_path / "root")
    assert res.returncode == 0, res.stderr
    assert "skipped Epilog: no checkpoint memory tier" in res.stdout
    assert not (tmp_path / "root/usr/local/lib/unicorn/epilog.sh").exists()
    config.write_text('[ckpt]\nshm_dir = "shm"\n')
    res = install(tmp_path / "root")
    assert res.returncode != 0 and "[ckpt] shm_dir must be an absolute path" in res.stderr


def test_every_sbatch_wrapper_in_etc_is_installed(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    shutil.copytree(REPO / "etc", etc, ignore=shutil.ignore_patterns("*.sbatch"))
    (etc / "a.sbatch").write_text("#!/bin/bash\n#SBATCH --no-kill\n")
    res = install(tmp_path / "root", "--no-plugins", "--etc", str(etc))
    assert res.returncode == 0, res.stderr
    placed = tmp_path / "root/usr/local/share/unicorn/a.sbatch"
    assert placed.read_text().startswith("#!/bin/bash") and (placed.stat().st_mode & 0o777) == 0o755
    (etc / "a.sbatch").unlink()
    res = install(tmp_path / "root2", "--no-plugins", "--etc", str(etc))
    assert "skipped sbatch wrapper" in res.stdout


def test_a_missing_virtualenv_fails_before_placing_anything(tmp_path: Path) -> None:
    root = tmp_path / "root"
    res = subprocess.run(
        [sys.executable, str(INSTALL), "--root", str(root), "--venv", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1 and "unicornd is missing" in res.stderr
    assert not root.exists()


def test_installed_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    res = install(tmp_path / "root", "--no-plugins")
    assert res.returncode == 0, res.stderr
    unit = tmp_path / "root/etc/systemd/system/unicornd.service"
    verify = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert verify.returncode == 0, verify.stderr
    assert "unicornd.service" not in verify.stderr  # no warning about our unit
