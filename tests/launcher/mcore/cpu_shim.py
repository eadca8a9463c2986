"""TEST-ONLY shim: let unmodified megatron-core run on a CPU-only torch with gloo.

megatron-core hard-codes CUDA in RNG seeding, buffer allocation, schedules and p2p.
This module redirects those CUDA requests to the CPU before megatron is imported. It
patches torch for the whole process, so it lives in tests/ and is imported only by the
test worker; nothing in the product imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


class _NullStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class _NullEvent(_NullStream):
    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return _CPU
    if isinstance(value, str) and value.startswith("cuda"):
        return _CPU
    return value


class _CudaToCpu(TorchFunctionMode):
    """Rewrites every ``device=cuda...`` (and ``.to("cuda")``) in torch calls to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


_MODE = _CudaToCpu()


def install() -> None:
    """Patch torch.cuda so megatron-core's CUDA calls land on the CPU (whole process, test only)."""
    replacements: dict[str, Any] = {
        "current_device": lambda: _CPU,
        "set_device": lambda *a, **k: None,
        "device_count": lambda: 1,
        "synchronize": lambda *a, **k: None,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: None,
        "Stream": _NullStream,
        "Event": _NullEvent,
        "current_stream": lambda *a, **k: _NullStream(),
        "stream": lambda *a, **k: _NullStream(),
        "empty_cache": lambda: None,
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
    }
    for name, value in replacements.items():
        setattr(torch.cuda, name, value)
    setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # noqa: B010 - patching on purpose
    _MODE.__enter__()  # type: ignore[no-untyped-call]  # stays active for the rest of the process

    from megatron.core.tensor_parallel import random as mrandom  # type: ignore[import-untyped]

    setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())  # noqa: B010
    setattr(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: None)  # noqa: B010


class _Properties:
    """What Megatron-LM reads of ``torch.cuda.get_device_properties``: a Hopper-class device."""

    major, minor = 9, 0
    name = "cpu-shim"
    total_memory = 0
    multi_processor_count = 1


def install_for_megatron_lm() -> None:
    """:func:`install` plus what Megatron-LM's training loop (``pretrain_gpt.py``) asks of CUDA
    at start-up: a device that exists, its properties and memory statistics, and no fused
    kernels to build (see ../shared/third_party/megatron-lm/README.md). Test only."""
    install()
    replacements: dict[str, Any] = {
        "is_available": lambda: True,
        "get_device_properties": lambda *a, **k: _Properties(),
        "get_device_name": lambda *a, **k: _Properties.name,
        "get_device_capability": lambda *a, **k: (_Properties.major, _Properties.minor),
        "set_stream": lambda *a, **k: None,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_reserved": lambda *a, **k: 0,
        "memory_stats": lambda *a, **k: {},
        "reset_peak_memory_stats": lambda *a, **k: None,
        "reset_max_memory_allocated": lambda *a, **k: None,
    }
    for name, value in replacements.items():
        setattr(torch.cuda, name, value)
    from megatron.legacy import fused_kernels  # type: ignore[import-untyped]

    setattr(fused_kernels, "load", lambda *a, **k: None)  # noqa: B010
