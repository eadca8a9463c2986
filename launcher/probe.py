"""``unicorn-probe``: what unicornd asks a node over SSH when the node's agent fell silent.

Prints one JSON object: the node's view of the job's agent (processes found by their
command line, and their state) and the kernel-log lines that point at hardware (GPU Xid
events, ECC/MCE, hung tasks, the OOM killer). It reads only; it never changes the node.
The coordinator decides from the answer (:mod:`unicornd.oob`): no answer at all means a
dead node, an answer without a live agent means a dead agent.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from launcher.supervisor import process_state

KERNEL_PATTERN = re.compile(
    r"NVRM: Xid|Xid \(PCI|GPU has fallen off the bus|NVRM:.*(?:ECC|row remap|fatal)|"
    r"Machine check|mce: \[Hardware Error\]|EDAC .*(?:UE|CE)|Hardware Error|"
    r"blocked for more than \d+ seconds|soft lockup|Out of memory: Killed process|"
    r"mlx5_core.*(?:fatal|error)|NETDEV WATCHDOG",
    re.IGNORECASE,
)
"""Kernel lines worth attaching to an incident (drivers' and the kernel's own words)."""

MAX_KERNEL_LINES = 50
"""The newest matching lines kept: enough for the story, small enough for an incident."""

DMESG_TIMEOUT_S = 5.0

_STATES = {"R": "running", "S": "sleeping", "D": "disk-wait", "T": "stopped", "t": "traced", "Z": "zombie"}


@dataclass(frozen=True)
class AgentProcess:
    pid: int
    state: str


@dataclass
class ProbeReport:
    """The probe's answer (its JSON form is what unicornd parses)."""

    node: str
    job_id: int
    agents: list[AgentProcess] = field(default_factory=list)
    kernel_source: str = ""
    kernel_lines: list[str] = field(default_factory=list)
    kernel_error: str = ""
    uptime_s: float | None = None


def _is_agent_of(argv: list[str], job_id: int, node: str) -> bool:
    """``unicorn-agent --job-id J --node N ... -- COMMAND`` (run directly or by a Python)."""
    head = argv[: argv.index("--")] if "--" in argv else argv
    if not any(Path(a).name == "unicorn-agent" for a in head[:2]):
        return False
    opts = dict(itertools.pairwise(head))
    return opts.get("--job-id") == str(job_id) and opts.get("--node") == node


def find_agents(job_id: int, node: str) -> list[AgentProcess]:
    """Processes running the agent of ``job_id`` on ``node``, with their scheduler state."""
    found: list[AgentProcess] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if not _is_agent_of(argv, job_id, node):
            continue
        code = process_state(int(entry.name))
        if code is not None:
            found.append(AgentProcess(int(entry.name), _STATES.get(code, code)))
    return sorted(found, key=lambda a: a.pid)


def kernel_lines(source: str) -> tuple[list[str], str]:
    """Matching lines from ``source`` (a file path, or "" for dmesg), newest last, and an error."""
    try:
        if source:
            text = Path(source).read_text(errors="replace")
        else:
            out = subprocess.run(
                ["dmesg"], capture_output=True, text=True, timeout=DMESG_TIMEOUT_S, check=False
            )
            if out.returncode != 0:
                return [], f"dmesg exited {out.returncode}: {out.stderr.strip()[:200]}"
            text = out.stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"{type(e).__name__}: {e}"
    lines = [line.strip() for line in text.splitlines() if KERNEL_PATTERN.search(line)]
    return lines[-MAX_KERNEL_LINES:], ""


def probe(job_id: int, node: str, kernel_log: str) -> ProbeReport:
    source = kernel_log.replace("{node}", node)
    lines, error = kernel_lines(source)
    uptime: float | None = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    return ProbeReport(
        node=node,
        job_id=job_id,
        agents=find_agents(job_id, node),
        kernel_source=source or "dmesg",
        kernel_lines=lines,
        kernel_error=error,
        uptime_s=uptime,
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--job-id", type=click.IntRange(min=0), required=True, help="The job whose agent to look for.")
@click.option("--node", required=True, help="The Slurm node name this probe runs for.")
@click.option(
    "--kernel-log",
    default="",
    show_default=True,
    help='Kernel log file ({node} = node name); "" reads dmesg.',
)
def cli(job_id: int, node: str, kernel_log: str) -> None:
    """Report this node's view of JOB's agent and hardware kernel messages, as JSON."""
    if not node or "/" in node or any(c.isspace() for c in node):
        raise click.UsageError(f"--node must be a node name, got {node!r}")
    report = probe(job_id, node, kernel_log)
    json.dump(asdict(report), sys.stdout)
    sys.stdout.write("\n")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
