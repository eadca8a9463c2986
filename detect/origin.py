"""Where a line of a rank's output comes from: the process itself, or a copy of a node report.

A rank's output is first-hand evidence of what happened in that process: the CUDA and
NCCL runtimes' errors, Python's exceptions. A line in the kernel's words (``NVRM: Xid``,
``kernel: mlx5_core``, a ``dmesg`` timestamp) or a row of a node tool's table
(``dcgmi health``/``diag``, ``nvidia-smi``) cannot come from the process: the training
code ran the tool or printed the text. The node agent reads those sources first-hand (its
NVML monitor and the kernel-log probe), so a copy in a rank's output adds nothing but
the chance of a false alarm: DCGM's "NVLINK system | Failure" on a PCIe GPU without
NVLink (NVIDIA/NVSentinel#1481) is one. :func:`node_report` names such a line; the agent
(:meth:`launcher.agent.Agent._on_line`) logs and counts it and sends no report, and a
process's exit is classified without such lines of its output (:meth:`Classifier.classify_exit`).

Limits: the agent's first-hand readers are NVML (critical Xid events, ECC, row remapping,
NVLink error counters) and, when its agent goes silent, the kernel-log probe; an NVSwitch
SXid or an InfiniBand link message has no first-hand reader while the agent is alive.
"""

from __future__ import annotations

import re
from typing import Final

LAUNCHER_PREFIX: Final = re.compile(
    r"^(?:(?:\[(?:rank|default)\d+\]:|\(\S+ pid=\d+(?:, ip=[^)\s]+)?\)|std(?:err|out):|\^C)[ \t]?)+"
)
"""The prefix a launcher puts before each line of a rank (torchrun's ``[rank3]:`` and
``--tee``'s ``[default3]:``, Ray's ``(RayWorker pid=12)``, the stream Accelerate's and other
launchers name: ``stderr: ``; a terminal's echo of Ctrl-C, ``^C``, in a copied log).
Classification reads the rank's own line: anchored rules (log levels, torchrun's failure
summary, Slurm's ``srun: error:``) would otherwise miss a prefixed one (a rank's ``WARNING:``
line was a fault only when torchrun prefixed it). Prefixes may stack (``[default0]:[rank0]:``,
``stderr: [rank0]:``); Ray's may name the worker's address. One character of blank after a
prefix is its own; more is the line's indentation."""

_KERNEL: Final = re.compile(
    r"\bNVRM: "  # the NVIDIA driver, Xids included ("NVRM: Xid (PCI:...): 79, ...")
    r"|\bnvidia-nvswitch\d*: "  # the NVSwitch driver, SXids included
    r"|^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT\S+) \S+ kernel: "  # syslog, journal
    r"|^kernel: "
    r"|^\[\s*\d+\.\d+\] (?:NVRM|nvidia|mlx5_core|nvidia-nvswitch\d*|pcieport|EDAC|mce|infiniband)\b"  # dmesg
)
"""The kernel's log: the NVIDIA and NVSwitch drivers, a syslog/journal or dmesg line of a
kernel subsystem. Case-sensitive and anchored: a library's "Failed to launch CUDA kernel: ..."
or a line that merely mentions an Xid is the process's own."""

_TOOL_TABLE_ROW: Final = re.compile(r"^\s*\|.*\|\s*$")
"""A row of a node tool's table (``dcgmi diag``/``health``, ``nvidia-smi``): ``| ... |``."""

_PROCESS_OWN: Final = re.compile(r"CUDA error|CUDA_ERROR_|cudaError|NCCL error|ncclSystemError|Traceback")
"""Text only the process's runtimes write: a line with it is never a copy."""


def node_report(line: str) -> str | None:
    """``"kernel log"`` or ``"node tool"`` when ``line`` (one line of a rank's output, a
    launcher's rank prefix allowed) is a copy of a node's report, else None."""
    prefix = LAUNCHER_PREFIX.match(line)
    text = line[prefix.end() :] if prefix is not None else line
    if _PROCESS_OWN.search(text):
        return None
    if _KERNEL.search(text):
        return "kernel log"
    if _TOOL_TABLE_ROW.match(text):
        return "node tool"
    return None
