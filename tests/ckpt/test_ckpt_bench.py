"""The checkpoint bench runs end to end at a small size and cleans up after itself."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    path = REPO / "scripts" / "bench" / "ckpt.py"
    spec = importlib.util.spec_from_file_location("bench_ckpt", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bench_reports_every_ratio_and_leaves_nothing(shm_root: Path, tmp_path: Path) -> None:
    bench = _bench()
    result = bench.bench_size(16, shm_root, tmp_path, 2, "fadvise")
    for key in (
        "restore_over_memcpy",
        "restore_over_torch_load_mmap",
        "restore_over_torch_load_cold",
        "dcp_restore_over_memcpy",
        "persist_over_disk",
        "stall_over_memcpy",
    ):
        assert result[key] > 0, key
    assert list(shm_root.iterdir()) == [] and list(tmp_path.iterdir()) == []
