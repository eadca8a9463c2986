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
        # the process's own words, though they name a kernel or an Xid
        ("2024-05-01 12:00:00.1: E external/xla/stream.cc:42] Failed to launch CUDA kernel: fusion_12", None),
        ("Failed to launch CUDA kernel: CUDA_ERROR_ECC_UNCORRECTABLE", None),
        ("Kernel: flash_fwd_kernel failed: CUDA error: an illegal memory access was encountered", None),
        ('  File "model.py", line 12, in kernel: x = y', None),
        ("[  123.456] RuntimeError: CUDA error: an illegal memory access was encountered", None),
        ("the health check logged Xid 79 last week", None),
        ("[default0]:[rank0]:|    -> NVLINK system       | Failure                 |", "node tool"),
        ("(RayTrainWorker pid=12, ip=10.0.0.1) NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU off", "kernel log"),
    ],
)
def test_node_report(line: str, origin: str | None) -> None:
    assert node_report(line) == origin


def test_an_exit_is_classified_without_the_copies_of_node_reports_in_its_output() -> None:
    """``dcgmi diag && torchrun ...``: DCGM's false NVLink failure on a PCIe GPU
    (NVIDIA/NVSentinel#1481) in the tail of a command that then failed is not why it ended;
    the process's own error is. The same row in a kernel-log text is still read."""
    from detect import ErrorStatus, load_classifier

    c = load_classifier()
    row = "|    -> NVLINK system       | Failure                                       |"
    ended = c.classify_exit(1, None, f"{row}\nValueError: bad batch size\n")
    assert ended.status is ErrorStatus.OTHER_SOFTWARE_ERROR, ended
    assert c.classify_exit(1, None, row + "\n").status is ErrorStatus.EXITED_ABNORMALLY
    assert c.classify_text(row).status is ErrorStatus.NVLINK_ERROR
