"""TEST-ONLY: run unmodified Megatron-LM (``pretrain_gpt.py``) on a CPU-only machine.

A directory on ``PYTHONPATH`` of the test jobs (with ../shared/third_party/megatron-lm),
so the training command stays exactly what a user submits. Python imports this module
at start-up in every process of such a job (agents, torchrun, ranks); it only registers
an import hook, and the CPU shim is installed (importing torch) in the one kind of
process that imports ``megatron.training``: a rank of Megatron-LM's training loop.

Fault injection for the system tests, from the job's environment (not ``UNICORN_*``: the
sbatch wrapper keeps those from the ranks). Megatron-LM itself is not changed; its
``train_step`` is wrapped in the rank's memory: ``TEST_MEGATRON_RAISE_AT=K`` with
``TEST_MEGATRON_RAISE_RANK=R`` raises a RuntimeError on global rank R as iteration K+1
starts, once (``TEST_MEGATRON_RAISE_ONCE``: a marker file made when it fires; a relaunch
that finds it trains on). ``TEST_MEGATRON_NAN_AT=K`` corrupts the data of iteration K: the
data set's sample at position ``(K-1) x global batch`` (the first sample of K's global
batch, drawn by data-parallel rank 0) gets a NaN loss mask, every time it is read, so
its loss is NaN whenever that batch is trained on and harmless when it is skipped.
Nothing in the product imports this module.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

_TRIGGER = "megatron.training"
_TRAINING = "megatron.training.training"
_DATASET = "megatron.core.datasets.gpt_dataset"


def _raising(train_step: Callable[..., Any]) -> Callable[..., Any]:
    at, rank = int(os.environ["TEST_MEGATRON_RAISE_AT"]), os.environ.get("TEST_MEGATRON_RAISE_RANK", "0")
    marker = Path(os.environ["TEST_MEGATRON_RAISE_ONCE"])

    @functools.wraps(train_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        iteration = kwargs.get("iteration")
        if iteration == at and os.environ.get("RANK") == rank and not marker.exists():
            marker.write_text(f"raised at iteration {at + 1} on rank {rank}\n")
            raise RuntimeError(f"injected by the test: iteration {at + 1}, rank {rank}")
        return train_step(*args, **kwargs)

    return step


def _poisoned(getitem: Callable[..., Any]) -> Callable[..., Any]:
    at = int(os.environ["TEST_MEGATRON_NAN_AT"])

    @functools.wraps(getitem)
    def item(self: Any, idx: int | None) -> Any:
        sample = getitem(self, idx)
        from megatron.training.global_vars import get_args

        if idx is not None and idx == (at - 1) * get_args().global_batch_size:
            sample["loss_mask"] = sample["loss_mask"] * float("nan")
        return sample

    return item


def _patched(
    fullname: str, path: Sequence[str] | None, patch: Callable[[ModuleType], None]
) -> importlib.machinery.ModuleSpec | None:
    """The module's own spec, whose loader runs ``patch`` on the module after executing it."""
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return spec
    execute = spec.loader.exec_module

    def exec_module(module: ModuleType) -> None:
        execute(module)
        patch(module)

    spec.loader.exec_module = exec_module  # type: ignore[method-assign]
    return spec


def _raise_in_train_step(module: ModuleType) -> None:
    setattr(module, "train_step", _raising(getattr(module, "train_step")))  # noqa: B009, B010


def _nan_in_data(module: ModuleType) -> None:
    dataset = module.GPTDataset
    dataset.__getitem__ = _poisoned(dataset.__getitem__)


class _Hooks(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.shimmed = False
        self.pending = {
            name: patch
            for name, variable, patch in (
                (_TRAINING, "TEST_MEGATRON_RAISE_AT", _raise_in_train_step),
                (_DATASET, "TEST_MEGATRON_NAN_AT", _nan_in_data),
            )
            if variable in os.environ
        }

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == _TRIGGER and not self.shimmed:
            self.shimmed = True
            from tests.launcher.mcore import cpu_shim

            cpu_shim.install_for_megatron_lm()
            return None  # the normal finders import megatron.training itself
        patch = self.pending.pop(fullname, None)
        if patch is not None:
            return _patched(fullname, path, patch)
        return None


os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.meta_path.insert(0, _Hooks())
