"""The adapter's resharding claim against real megatron-core (0.16.1, the newest for Python 3.11).

Unmodified megatron-core runs on this CPU-only torch through a test-only shim
(``tests/train/mcore/cpu_shim.py``). A tiny GPTModel trains at TP2.PP2 and saves a
``dist_checkpointing`` (torch_dist) checkpoint, which then loads at TP1.PP2 (2 ranks)
and at DP4: the loss of a fixed batch must match to float32 rounding (rel 1e-6),
because loading only moves the same numbers into differently split tensors.
Skipped where megatron-core is not installed (it is a test-only dependency).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.train.torchrun import REPO, TORCHRUN, finish

pytest.importorskip("megatron.core")

EVAL = re.compile(r"EVAL_LOSS ([0-9.e+-]+)")


def mcore(nproc: int, *args: str) -> float:
    cmd = [
        str(TORCHRUN),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "tests.train.mcore.worker",
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICORN_")}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    launch = finish(proc, timeout_s=150)
    assert launch.returncode == 0, launch.output[-3000:]
    match = EVAL.search(launch.output)
    assert match is not None, launch.output[-3000:]
    return float(match[1])


def test_megatron_dist_checkpoint_saved_at_tp2_pp2_loads_at_tp1_pp2_and_dp4(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "mcore-ckpt")
    trained = mcore(4, "train", "--tp=2", "--pp=2", "--steps=3", f"--ckpt={ckpt}")
    assert mcore(2, "eval", "--tp=1", "--pp=2", f"--ckpt={ckpt}") == pytest.approx(trained, rel=1e-6)
    assert mcore(4, "eval", "--tp=1", "--pp=1", f"--ckpt={ckpt}") == pytest.approx(trained, rel=1e-6)
