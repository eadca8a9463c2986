"""The adapter's resharding claim against real megatron-core (0.16.1, the newest for Python 3.11).

Unmodified megatron-core runs on this CPU-only torch through a test-only shim
(``tests/launcher/mcore/cpu_shim.py``). A tiny GPTModel trains at TP2.PP2 and saves a
``dist_checkpointing`` (torch_dist) checkpoint, which then loads at TP1.PP2 (2 ranks)
and at DP4: the loss of a fixed batch must match to float32 rounding (rel 1e-6),
because loading only moves the same numbers into differently split tensors.
Skipped where megatron-core is not installed (it is a test-only dependency).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.torchrun import REPO, TORCHRUN, finish

pytest.importorskip("megatron.core")

EVAL = re.compile(r"EVAL_LOSS ([0-9.e+-]+)")


def mcore(nproc: int, *args: str, env: dict[str, str] | None = None, ok: bool = True) -> float | str:
    """One torchrun of the worker: the fixed batch's loss, or (``ok=False``) its output."""
    cmd = [
        str(TORCHRUN),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "tests.launcher.mcore.worker",
        *args,
    ]
    base = {k: v for k, v in os.environ.items() if not k.startswith("UNICORN_")}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**base, **(env or {}), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    launch = finish(proc, timeout_s=150)
    if not ok:
        assert launch.returncode != 0, launch.output[-3000:]
        return launch.output
    assert launch.returncode == 0, launch.output[-3000:]
    match = EVAL.search(launch.output)
    assert match is not None, launch.output[-3000:]
    return float(match[1])


def test_megatron_dist_checkpoint_saved_at_tp2_pp2_loads_at_tp1_pp2_and_dp4(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "mcore-ckpt")
    trained = mcore(4, "train", "--tp=2", "--pp=2", "--steps=3", f"--ckpt={ckpt}")
    assert mcore(2, "eval", "--tp=1", "--pp=2", f"--ckpt={ckpt}") == pytest.approx(trained, rel=1e-6)
    assert mcore(4, "eval", "--tp=1", "--pp=1", f"--ckpt={ckpt}") == pytest.approx(trained, rel=1e-6)


def test_megatron_checkpoint_in_the_memory_tier_reshards_from_memory(tmp_path: Path) -> None:
    """Megatron-LM's save path (the registry's torch_dist strategy) with unicorn's strategies
    installed: the tensors go to the memory tier only (the checkpoint folder keeps
    megatron-core's metadata.json and common.pt), and the checkpoint loads from memory at
    TP1.PP2 and DP4 with the same loss. A shard corrupted after sealing, with no other copy,
    fails the load loudly, naming the shard."""
    snap = tmp_path / "shm" / "snap"
    env = {"UNICORN_CKPT_SNAP_DIR": str(snap), "UNICORN_CKPT_JOB": "mcore"}
    ckpt = tmp_path / "save" / "iter_0000003"
    trained = mcore(4, "train", "--tp=2", "--pp=2", "--steps=3", f"--ckpt={ckpt}", "--memory", env=env)
    assert sorted(p.name for p in ckpt.iterdir()) == ["common.pt", "metadata.json"]
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "unicorn_mem"
    shards = sorted(p.name for p in (snap / "mcore" / "it-000000000003").glob("shard-*.bin"))
    assert shards == [f"shard-{r:05d}.bin" for r in range(4)]
    for args in (("--tp=1", "--pp=2"), ("--tp=1", "--pp=1")):
        loss = mcore(2 if "--pp=2" in args else 4, "eval", *args, f"--ckpt={ckpt}", "--memory", env=env)
        assert loss == pytest.approx(trained, rel=1e-6)
    bin_1 = snap / "mcore" / "it-000000000003" / "shard-00001.bin"
    assert bin_1.with_suffix(".done").exists()  # sealed (checksummed) by the first restore
    with bin_1.open("r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = mcore(2, "eval", "--tp=1", "--pp=2", f"--ckpt={ckpt}", "--memory", env=env, ok=False)
    assert isinstance(out, str) and "corrupt" in out and "shard-00001.bin" in out, out[-3000:]


def test_memory_tier_runner_reads_the_agents_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt.errors import InvalidArgument
    from launcher.mcore_ckpt import iteration_of, main, options_from_env

    assert iteration_of("/save/iter_0000100") == 100
    with pytest.raises(InvalidArgument, match="release"):
        iteration_of("/save/release")
    assert options_from_env({}) is None
    opts = options_from_env(
        {
            "UNICORN_CKPT_SNAP_DIR": "/dev/shm/u/snap",
            "UNICORN_CKPT_JOB": "site.42",
            "UNICORN_CKPT_LOCAL_DIR": "/var/tmp/u",
            "UNICORN_CKPT_PEERS": "n2=10.0.0.2:27001",
        }
    )
    assert opts is not None and opts.job == "site.42" and opts.local_dir == "/var/tmp/u"
    assert [(p.node, p.host, p.port) for p in opts.peers] == [("n2", "10.0.0.2", 27001)]
    with pytest.raises(InvalidArgument, match="NODE=HOST:PORT"):
        options_from_env({"UNICORN_CKPT_SNAP_DIR": "/s", "UNICORN_CKPT_JOB": "j", "UNICORN_CKPT_PEERS": "n2"})
    script = tmp_path / "pretrain.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').write(__name__ + ' ' + ' '.join(sys.argv))\n")
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() replaces it, as python -m would
    for name in ("UNICORN_CKPT_SNAP_DIR", "UNICORN_CKPT_JOB"):
        monkeypatch.delenv(name, raising=False)
    main([str(script), str(out), "--tp", "2"])  # no memory tier in this environment: runs untouched
    assert out.read_text() == f"__main__ {script} {out} --tp 2"


def test_a_version_no_rank_can_restore_moves_the_tracker_back_to_one_all_can(tmp_path: Path) -> None:
    """A node killed between its save into memory and its shard's copy to a peer takes the
    only copy with it; Megatron-LM's tracker already names that version, and Megatron loads
    nothing else. The load fails on every rank, says why, and points the tracker at the newest
    version every rank can restore, which the next launch loads (same loss as when saved).
    Found by a CI run of the node-kill system test, whose relaunch and restart both died."""
    snap = tmp_path / "shm" / "snap"
    env = {"UNICORN_CKPT_SNAP_DIR": str(snap), "UNICORN_CKPT_JOB": "mcore"}
    save = tmp_path / "save"
    at_3 = mcore(
        4, "train", "--tp=2", "--pp=2", "--steps=3", f"--ckpt={save / 'iter_0000003'}", "--memory", env=env
    )
    mcore(4, "train", "--tp=2", "--pp=2", "--steps=5", f"--ckpt={save / 'iter_0000005'}", "--memory", env=env)
    tracker = save / "latest_checkpointed_iteration.txt"
    tracker.write_text("5\n")  # what Megatron-LM's rank 0 writes once every rank has saved
    lost = sorted((snap / "mcore" / "it-000000000005").glob("shard-00001.*"))
    assert lost
    for path in lost:  # rank 1's node died before its agent copied the shard anywhere
        path.unlink()
    args = ("eval", "--tp=1", "--pp=2", "--memory")
    out = mcore(2, *args, f"--ckpt={save / 'iter_0000005'}", env=env, ok=False)
    assert isinstance(out, str) and "now names 3" in out, out[-3000:]
    assert tracker.read_text() == "3\n"
    assert mcore(2, *args, f"--ckpt={save / 'iter_0000003'}", env=env) == pytest.approx(at_3, rel=1e-6)
    # Nothing older to move to: the tracker stays, and the error says so.
    for path in (snap / "mcore" / "it-000000000003").glob("shard-00002.*"):
        path.unlink()
    out = mcore(2, *args, f"--ckpt={save / 'iter_0000003'}", env=env, ok=False)
    assert isinstance(out, str) and "no older version" in out and tracker.read_text() == "3\n", out[-3000:]
