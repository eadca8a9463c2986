"""The checkpoint bench runs end to end at a small size and cleans up after itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_script import load_bench


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bench_reports_every_ratio_and_leaves_nothing(shm_root: Path, tmp_path: Path) -> None:
    bench = load_bench("ckpt")
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
