"""detect.origin: which lines of a rank's output are copies of a node's own reports."""

from __future__ import annotations

import pytest

from detect.origin import node_report


@pytest.mark.parametrize(
    ("line", "origin"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.", "kernel log"),
        ("[rank2]: NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.", "kernel log"),
        ("[ 4711.123456] NVRM: GPU at PCI:0000:3b:00: GPU-1234 has fallen off the bus.", "kernel log"),
        ("Feb 14 05:03:41 gpu-1 kernel: mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link DOWN", "kernel log"),
        ("nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 37 egress", "kernel log"),
        ("|    -> NVLINK system       | Failure                                       |", "node tool"),
        ("[default0]:| Memory                    | Fail - All                          |", "node tool"),
        ("RuntimeError: CUDA error: uncorrectable NVLink error detected during the execution", None),
        ("[rank0]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970", None),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", None),
        ("| distributed init rank 0", None),
    ],
)
def test_node_report(line: str, origin: str | None) -> None:
    assert node_report(line) == origin
