"""Where a line of a rank's output comes from: the process itself, or a copy of a node report.

A rank's output is first-hand evidence of what happened in that process: the CUDA and
NCCL runtimes' errors, Python's exceptions. A line in the kernel's words (``NVRM: Xid``,
``kernel: mlx5_core``, a ``dmesg`` timestamp) or a row of a node tool's table
(``dcgmi health``/``diag``, ``nvidia-smi``) cannot come from the process: the training
code ran the tool or printed the text. The node agent reads those sources first-hand (its
NVML monitor and the kernel-log probe), so a copy in a rank's output adds nothing but
the chance of a false alarm: DCGM's "NVLINK system | Failure" on a PCIe GPU without
NVLink (NVIDIA/NVSentinel#1481) is one. :func:`node_report` names such a line; the agent
(:meth:`launcher.agent.Agent._on_line`) records it at SEV3 and acts on nothing.
"""

from __future__ import annotations

import re
from typing import Final

LAUNCHER_PREFIX: Final = re.compile(r"^(?:\[(?:rank|default)\d+\]:|\(\S+ pid=\d+\))[ \t]?")
"""The prefix a launcher puts before each line of a rank (torchrun's ``[rank3]:`` and
``--tee``'s ``[default3]:``, Ray's ``(RayWorker pid=12)``). Classification reads the rank's
own line: anchored rules (log levels, torchrun's failure summary) would otherwise miss a
prefixed one (a rank's ``WARNING:`` line was a fault only when torchrun prefixed it)."""

_KERNEL: Final = re.compile(
    r"\bNVRM: |\bS?Xid\b|\bkernel: |^\s*\[\s*\d+\.\d+\] |\bmlx5_core\b|\bnvidia-nvswitch\d*:",
    re.IGNORECASE,
)
"""The kernel's log: the NVIDIA driver (NVRM, Xid, NVSwitch SXid), a dmesg or syslog line."""

_TOOL_TABLE_ROW: Final = re.compile(r"^\s*\|.*\|\s*$")
"""A row of a node tool's table (``dcgmi diag``/``health``, ``nvidia-smi``): ``| ... |``."""


def node_report(line: str) -> str | None:
    """``"kernel log"`` or ``"node tool"`` when ``line`` (one line of a rank's output, a
    launcher's rank prefix allowed) is a copy of a node's report, else None."""
    prefix = LAUNCHER_PREFIX.match(line)
    text = line[prefix.end() :] if prefix is not None else line
    if _KERNEL.search(text):
        return "kernel log"
    if _TOOL_TABLE_ROW.match(text):
        return "node tool"
    return None
