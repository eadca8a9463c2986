"""The CLI backend's error paths, with stand-in Slurm tools in a private bin_dir."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from unicorn_core.errors import CommandFailed, CommandNotFound, CommandTimeout, InvalidArgument
from unicorn_core.slurm.backend import ResizeUnsupported
from unicorn_core.slurm.cli import CliSlurm, client_env
from unicorn_core.slurm.parse import SlurmParseError

DATA = Path(__file__).parent / "data"


def tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


async def test_hung_slurm_command_times_out(tmp_path: Path) -> None:
    tool(tmp_path, "sinfo", "echo '{\"nodes\": ['; sleep 30")
    slurm = CliSlurm(timeout_s=3, bin_dir=tmp_path)  # time to print the first line, even loaded
    with pytest.raises(CommandTimeout) as ei:
        await slurm.list_nodes()
    assert ei.value.command == (str(tmp_path / "sinfo"), "--json")
    assert ei.value.stdout.startswith('{"nodes"') and ei.value.temporary


async def test_grouped_sinfo_switches_to_scontrol_once(tmp_path: Path) -> None:
    """A Slurm whose ``sinfo --json`` prints grouped records (24.11's recorded output) is
    read with ``scontrol show node --json`` from then on: sinfo is asked once only."""
    data = Path(__file__).parent / "data"
    calls = tmp_path / "calls"
    tool(tmp_path, "sinfo", f"echo sinfo >> {calls}; cat {data / 'sinfo-24.11.json'}")
    tool(tmp_path, "scontrol", f'echo "scontrol $*" >> {calls}; cat {data / "scontrol-node-24.11.json"}')
    slurm = CliSlurm(timeout_s=5, bin_dir=tmp_path)
    for _ in range(2):
        nodes = await slurm.list_nodes()
        assert [n.name for n in nodes] == ["n1", "n2", "n3", "n4"]
    by_scontrol = "scontrol show node --json"
    assert calls.read_text().splitlines() == ["sinfo", by_scontrol, by_scontrol]


async def test_failing_command_is_typed(tmp_path: Path) -> None:
    tool(tmp_path, "scontrol", "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1")
    with pytest.raises(CommandFailed) as ei:
        await CliSlurm(timeout_s=5, bin_dir=tmp_path).get_job(5)
    assert ei.value.exit_code == 1 and "Unable to contact" in ei.value.stderr


async def test_garbage_output_is_a_parse_error(tmp_path: Path) -> None:
    tool(tmp_path, "squeue", "echo 'this is not json'")
    with pytest.raises(SlurmParseError):
        await CliSlurm(timeout_s=5, bin_dir=tmp_path).list_jobs()


async def test_missing_tools(tmp_path: Path) -> None:
    with pytest.raises(CommandNotFound):
        await CliSlurm(timeout_s=5, bin_dir=tmp_path).list_nodes()


async def test_invalid_arguments_run_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for name in ("scontrol", "sbatch", "srun", "scancel"):
        tool(tmp_path, name, f"touch {marker}")
    slurm = CliSlurm(timeout_s=5, bin_dir=tmp_path)
    with pytest.raises(InvalidArgument):
        await slurm.drain("bad name", "x")
    with pytest.raises(InvalidArgument):
        await slurm.drain("n1", "")
    with pytest.raises(InvalidArgument):
        await slurm.submit_batch("sleep 1")  # no shebang
    with pytest.raises(InvalidArgument):
        await slurm.launch_step(1, [], ["true"])
    with pytest.raises(InvalidArgument):
        await slurm.cancel(-3)
    with pytest.raises(InvalidArgument):
        CliSlurm(timeout_s=0)
    assert not marker.exists()


async def test_a_rack_is_drained_in_one_scontrol_call(tmp_path: Path) -> None:
    args = tmp_path / "args"
    tool(tmp_path, "scontrol", f'echo "$@" >> {args}')
    slurm = CliSlurm(timeout_s=5, bin_dir=tmp_path)
    await slurm.drain_nodes(["n1", "n2", "n3", "n7"], "unicorn: operator: rack 7")
    await slurm.down_nodes(["n1", "n2"], "dead")
    assert args.read_text().splitlines() == [
        "update nodename=n[1-3,7] state=drain reason=unicorn: operator: rack 7",
        "update nodename=n[1-2] state=down reason=dead",
    ]
    with pytest.raises(InvalidArgument):
        await slurm.drain_nodes([], "x")
    with pytest.raises(InvalidArgument):
        await slurm.drain_nodes(["n1", "bad name"], "x")
    assert len(args.read_text().splitlines()) == 2


async def test_a_shrink_off_the_batch_host_is_refused_before_slurm_is_asked(tmp_path: Path) -> None:
    """slurmctld refuses it with only "Invalid node name specified" (found in CI on 24.11): the
    adapter names the batch host and asks nothing; unicornd then requeues instead. A shrink
    that keeps the batch host is sent."""
    record = (DATA / "scontrol-job-22.05.txt").read_text().splitlines()[0]
    wanted = {"NodeList": "n[3-4]", "BatchHost": "n4"}
    for field in record.split():
        key = field.split("=")[0]
        if key in wanted:
            record = record.replace(field, f"{key}={wanted[key]}")
    args = tmp_path / "args"
    job = tmp_path / "job.txt"
    job.write_text(record + "\n")
    tool(tmp_path, "scontrol", f'echo "$@" >> {args}; case "$*" in *"show job"*) cat {job};; esac')
    slurm = CliSlurm(timeout_s=5, bin_dir=tmp_path)
    assert (await slurm.get_job(9)).batch_host == "n4"
    with pytest.raises(ResizeUnsupported, match="n4"):
        await slurm.shrink(9, ["n3"])
    assert not [a for a in args.read_text().splitlines() if a.startswith("update")]
    await slurm.shrink(9, ["n4"])
    assert args.read_text().splitlines()[-1] == "update jobid=9 NodeList=n4"


def test_client_env_strips_slurm_job_variables() -> None:
    env = client_env(
        {"PATH": "/bin", "SLURM_JOB_ID": "5", "SBATCH_PARTITION": "x", "SLURM_CONF": "/a", "HOME": "/root"},
        slurm_conf="/b",
    )
    assert env == {"PATH": "/bin", "SLURM_CONF": "/b", "HOME": "/root"}
