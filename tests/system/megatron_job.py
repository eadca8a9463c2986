"""A real Megatron-LM job for the system tests and benches: ``pretrain_gpt.py`` (tiny GPT,
mock data, gloo) as a user submits it, and readers of Megatron-LM's own log.

Megatron-LM is used unmodified from ../shared/third_party/megatron-lm (the release of the
megatron-core wheel; set UNICORN_MEGATRON_LM to use another checkout). On this CPU-only
machine its ranks run under the test-only CUDA-to-CPU shim, loaded through
``PYTHONPATH`` (tests/launcher/mcore/megatron_lm/sitecustomize.py), so the submitted
command is exactly a user's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from launcher.render import megatron_args
from tests.conftest import REPO
from unicorn_core.layout import Layout
from unicorn_core.model import ModelSpec

MEGATRON_LM = Path(
    os.environ.get("UNICORN_MEGATRON_LM", REPO.parent / "shared" / "third_party" / "megatron-lm")
)
SHIM = REPO / "tests" / "launcher" / "mcore" / "megatron_lm"

MODEL = ModelSpec(layers=2, hidden=32, heads=4, sequence=512, vocabulary=128, global_batch=12)
"""The tiny GPT the jobs train, as the planner sees it (the dev cluster's GPUs are A100s to
the planner): sequences of 512 tokens, so its compute outweighs the gradient all-reduce
and the planner spreads it over every node it gets (DP 1, 2, 3, 4: each better than the
one before; with 64-token sequences one GPU would be its best layout). About 0.35 s an
iteration on 4 CPU ranks of this machine."""
PLAN_ENV: Final = {"UNICORN_PLAN__DISTRIBUTED_OPTIMIZER": "false"}
"""unicornd's setting for these jobs: Megatron-LM's distributed optimizer needs CUDA tensors
(its buffers check ``torch.cuda.FloatTensor``), which the CPU ranks do not have."""
ITERATIONS = 60
SAVE_INTERVAL = 5

_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*? lm loss: ([0-9.E+-]+)")
_START = re.compile(r"(?=^.*\bmegatron checkpoints\s+memory_tier=)", re.MULTILINE)
_LOADED = re.compile(
    r"successfully loaded checkpoint from .* at iteration\s+(\d+)"
    r"|megatron checkpoint restored from the tiers iteration=(\d+)"
)
_TIERS = re.compile(r"megatron checkpoint restored from the tiers.*")
_WORLD = re.compile(
    r"using world size: \d+, data-parallel size: (\d+), .*?"
    r"tensor-model-parallel size: (\d+), pipeline-model-parallel size: (\d+)"
)


def user_args(save: Path | None, iterations: int = ITERATIONS) -> list[str]:
    """What a user's job script passes to pretrain_gpt.py: model, data, optimiser, logging,
    checkpoints (the settings Megatron-LM needs on CPU: ../shared/third_party/megatron-lm/README.md)."""
    args = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(MODEL.vocabulary),
        "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--eval-iters", "0", "--eval-interval", "1000", "--clip-grad", "0", "--log-interval", "1",
        "--num-layers", str(MODEL.layers), "--hidden-size", str(MODEL.hidden),
        "--num-attention-heads", str(MODEL.heads), "--seq-length", str(MODEL.sequence),
        "--max-position-embeddings", str(MODEL.sequence), "--global-batch-size", str(MODEL.global_batch),
        "--lr", "1e-3", "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--train-iters", str(iterations),
    ]  # fmt: skip
    if save is not None:
        args += ["--save", str(save), "--save-interval", str(SAVE_INTERVAL)]
    return args


def job_env(**extra: str) -> dict[str, str]:
    """The submitting shell's variables the ranks need: Megatron-LM and the CPU shim on the
    path, and one compute thread per rank (the nodes of the dev cluster share two cores)."""
    path = os.pathsep.join([str(REPO), str(SHIM), str(MEGATRON_LM)])
    return {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def model_file(tmp: Path) -> Path:
    path = tmp / "model.toml"
    fields = ("layers", "hidden", "heads", "sequence", "vocabulary", "global_batch")
    path.write_text("".join(f"{f} = {getattr(MODEL, f)}\n" for f in fields))
    return path


@dataclass(frozen=True)
class Step:
    iteration: int
    consumed: int
    loss: float


@dataclass(frozen=True)
class Run:
    """One start of Megatron-LM in a node's train.log: where it resumed and what it printed."""

    loaded: int | None
    steps: tuple[Step, ...]
    tiers: str
    layout: str = ""
    """``TP1.PP1.DP4`` from Megatron's start-up line (rank 0's node only)."""


def runs(log: str) -> list[Run]:
    """The starts of the training in a node's log (the agent appends every start to it; each
    rank's runner says ``megatron checkpoints memory_tier=...`` first). Where it resumed
    from: Megatron's "successfully loaded" line (rank 0 only) or the memory tier's restore
    line (every rank)."""
    out: list[Run] = []
    for chunk in _START.split(log):
        steps = tuple(Step(int(m[1]), int(m[2]), float(m[3])) for m in _ITER.finditer(chunk))
        loaded = _LOADED.search(chunk)
        tiers = _TIERS.search(chunk)
        world = _WORLD.search(chunk)
        if steps or loaded or world:
            at = None if loaded is None else int(loaded[1] or loaded[2])
            layout = f"TP{world[2]}.PP{world[3]}.DP{world[1]}" if world else ""
            out.append(Run(at, steps, tiers[0] if tiers else "", layout))
    return out


def tiers_env(tmp: Path) -> dict[str, str]:
    """unicornd's checkpoint tiers for one test: its own folders, and per node ({node}), as
    on real nodes: a killed node's memory is gone to the others, who restore its shards
    from the peer that holds its backup."""
    return {
        "UNICORN_CKPT__SHM_DIR": str(tmp / "shm" / "{node}"),
        "UNICORN_CKPT__LOCAL_DIR": str(tmp / "local" / "{node}"),
    }


def reference(layout: Layout, iterations: int, tmp: Path) -> dict[int, float]:
    """lm loss per iteration of an uninterrupted run at ``layout`` (same seed and mock data),
    plain torchrun on this machine."""
    cmd = [
        str(Path(sys.executable).parent / "torchrun"), f"--nproc-per-node={layout.world_size}",
        "--master-port=29591", "-m", "launcher.mcore_ckpt", str(MEGATRON_LM / "pretrain_gpt.py"),
        *user_args(None, iterations), *megatron_args(layout),
    ]  # fmt: skip
    env = {**os.environ, **job_env(), "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TMPDIR": str(tmp)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {s.iteration: s.loss for s in runs(done.stdout + done.stderr)[0].steps}


_TIER_NAMES = {"shm": "memory", "peer": "peer", "local": "disk", "remote": "remote"}


def restored_from(tiers_line: str) -> list[str]:
    """The tiers a restore read from (memory, peer, disk, remote), from the memory-tier
    loader's log line ("" or no tiers: a file checkpoint)."""
    found = re.findall(r"'(shm|peer|local|remote)\b", tiers_line)
    return sorted({_TIER_NAMES[t] for t in found})


def task_command(save: Path, iterations: int = ITERATIONS) -> tuple[str, ...]:
    """The task's command as unicornd stores it: the script and the user's arguments."""
    return (str(MEGATRON_LM / "pretrain_gpt.py"), *user_args(save, iterations))
