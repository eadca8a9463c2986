"""The job environment the sbatch wrapper captures and the agents apply."""

from __future__ import annotations

import pytest

from unicorn_core.errors import InvalidArgument
from unicorn_core.jobenv import MAX_BYTES, JobEnvironment, capture


def test_capture_keeps_the_jobs_variables_and_drops_the_steps() -> None:
    environ = {
        "PATH": "/home/u/venv/bin:/usr/bin",
        "HF_HOME": "/scratch/hf",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_DEBUG": "WARN",
        "SLURM_JOB_ID": "7",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SBATCH_ACCOUNT": "a",
        "UNICORN_REDIS__URL": "redis://:secret@h",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "RANK": "3",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RUN_ID": "x",
        "PWD": "/somewhere",
        "BASH_FUNC_module%%": "() { :; }",
        "bad name": "x",
    }
    got = capture(environ, "/home/u/run")
    assert got.cwd == "/home/u/run"
    assert dict(got.env) == {
        "PATH": "/home/u/venv/bin:/usr/bin",
        "HF_HOME": "/scratch/hf",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_DEBUG": "WARN",
    }
    assert JobEnvironment.from_json(got.to_json()) == got


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"cwd": "relative", "env": {}}, "absolute"),
        ({"cwd": "/x", "env": {"A B": "1"}}, "invalid variable name"),
        ({"cwd": "/x", "env": {"A": 1}}, "must be a string"),
        ({"cwd": "/x", "env": {"A": "a\0b"}}, "without NUL"),
        ({"cwd": "/x", "env": {"SLURM_JOB_ID": "9"}}, "step's own"),
        ({"cwd": "/x", "env": {"LD_PRELOAD": "x" * MAX_BYTES}}, "at most"),
        ({"cwd": "/x", "env": []}, "env must be"),
        ({"cwd": "/x"}, "exactly 'cwd' and 'env'"),
        ([], "exactly 'cwd' and 'env'"),
    ],
)
def test_malformed_environments_are_refused(doc: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        JobEnvironment.from_dict(doc)


def test_not_json_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="not JSON"):
        JobEnvironment.from_json(b"{")
