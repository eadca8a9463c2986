"""Node health checks and ``unicorn-node-check``, the command that runs them on a compute node.

Local checks: GPUs (NVML), disk space, stuck processes. ``unicorn-node-check`` runs them
for Slurm's HealthCheckProgram (``slurm_plugins/healthcheck.sh``), for unicornd before a
returning node rejoins a task, and for operators' diagnosis (``unicornctl node-check`` is
an alias that runs :func:`run_node_check`). Every check returns a :class:`CheckResult`;
the node is healthy when none failed. A check that cannot apply (no NVML on a CPU
machine) is ``skipped``, not failed. ``--paired NODES`` runs the two-round paired check
across nodes instead (:mod:`launcher.paircheck`).

``fault_file`` is the test path for CPU machines: JSON lines as read by
:class:`launcher.gpu.FaultFile` (``{"gpu": 0, "kind": "xid", "value": 79}``); any line
present fails the GPU check. Never used unless passed explicitly.
"""

from __future__ import annotations

import asyncio
import enum
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from launcher.paircheck import PairedCheckReport, paired_check
from unicorn_core.config import load_config
from unicorn_core.errors import ConfigError, UnicornError
from unicorn_core.logs import configure_logging
from unicorn_core.protocol import GpuFaultKind
from unicorn_core.slurm import make_backend
from unicorn_core.slurm.hostlist import expand


class Outcome(enum.StrEnum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class CheckResult:
    name: str
    outcome: Outcome
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "outcome": self.outcome.value, "detail": self.detail}


def check_gpus(max_temp_c: float = 90.0) -> list[CheckResult]:
    """One result per GPU: uncorrectable ECC, pending/failed row remapping, temperature."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:
        if any(Path("/dev").glob("nvidia[0-9]*")):
            return [CheckResult("gpu", Outcome.FAILED, f"GPU devices present but NVML fails: {e}")]
        return [CheckResult("gpu", Outcome.SKIPPED, "no NVML and no /dev/nvidia* (CPU node)")]
    results: list[CheckResult] = []
    try:
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            results.append(_check_one_gpu(pynvml, index, max_temp_c))
    except Exception as e:
        results.append(CheckResult("gpu", Outcome.FAILED, f"NVML error: {e}"))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as e:  # shutting down a half-broken NVML: report, do not mask
            results.append(CheckResult("gpu", Outcome.FAILED, f"nvmlShutdown: {e}"))
    return results or [CheckResult("gpu", Outcome.SKIPPED, "NVML reports 0 GPUs")]


def _check_one_gpu(nv: Any, index: int, max_temp_c: float) -> CheckResult:
    name = f"gpu{index}"
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    problems: list[str] = []
    try:
        ecc = int(
            nv.nvmlDeviceGetTotalEccErrors(
                handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            )
        )
        if ecc:
            problems.append(f"{ecc} volatile uncorrectable ECC errors")
    except nv.NVMLError:
        pass  # ECC not supported/enabled on this GPU
    try:
        _corr, _unc, pending, failure = nv.nvmlDeviceGetRemappedRows(handle)
        if failure:
            problems.append("row remapping failed")
        elif pending:
            problems.append("row remapping pending (reset the GPU)")
    except nv.NVMLError:
        pass  # pre-Ampere GPUs use page retirement instead
    temp = float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
    if temp >= max_temp_c:
        problems.append(f"temperature {temp:g} C >= {max_temp_c:g} C")
    if problems:
        return CheckResult(name, Outcome.FAILED, "; ".join(problems))
    return CheckResult(name, Outcome.OK, f"{temp:g} C")


def check_injected(fault_file: Path) -> CheckResult:
    """TEST ONLY: fail when ``fault_file`` holds any valid injected GPU fault."""
    try:
        lines = fault_file.read_text().splitlines()
    except FileNotFoundError:
        return CheckResult("gpu-injected", Outcome.OK, f"{fault_file} absent")
    for line in lines:
        try:
            doc = json.loads(line)
            kind = GpuFaultKind(doc["kind"])
            return CheckResult(
                "gpu-injected",
                Outcome.FAILED,
                f"gpu {int(doc['gpu'])}: injected {kind.value} {doc.get('value', '')}",
            )
        except (ValueError, KeyError, TypeError):
            continue
    return CheckResult("gpu-injected", Outcome.OK, "no injected fault")


def check_disk(paths: Sequence[Path], min_free_gib: float) -> list[CheckResult]:
    out: list[CheckResult] = []
    for path in paths:
        try:
            usage = shutil.disk_usage(path)
        except OSError as e:
            out.append(CheckResult(f"disk:{path}", Outcome.FAILED, f"cannot stat: {e}"))
            continue
        free = usage.free / 2**30
        ok = free >= min_free_gib
        out.append(
            CheckResult(
                f"disk:{path}",
                Outcome.OK if ok else Outcome.FAILED,
                f"{free:.1f} GiB free" + ("" if ok else f" < {min_free_gib:g} GiB"),
            )
        )
    return out


def check_stuck_processes() -> CheckResult:
    """Fail when a process is in uninterruptible sleep (D) on a GPU device or is a GPU zombie."""
    stuck: list[str] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        state = stat[stat.rfind(")") + 2 :][:1]
        if state != "D":
            continue
        try:
            fds = [str(fd.readlink()) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if any(target.startswith("/dev/nvidia") for target in fds):
            stuck.append(proc.name)
    if stuck:
        return CheckResult("processes", Outcome.FAILED, f"GPU processes stuck in D state: {', '.join(stuck)}")
    return CheckResult("processes", Outcome.OK, "no GPU process stuck in D state")


def run_local_checks(
    *, disk_paths: Sequence[Path], min_free_gib: float, fault_file: Path | None = None
) -> list[CheckResult]:
    results = check_gpus()
    if fault_file is not None:
        results.append(check_injected(fault_file))
    results.extend(check_disk(disk_paths, min_free_gib))
    results.append(check_stuck_processes())
    return results


# --- the command ------------------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])


def node_check_options(f: _F) -> _F:
    """The options of ``unicorn-node-check`` (and of its alias ``unicornctl node-check``)."""
    options = [
        click.option(
            "--disk",
            "disk_paths",
            multiple=True,
            type=click.Path(path_type=Path),
            default=("/tmp",),  # noqa: S108 - checked for free space, never written
            show_default=True,
            help="Paths that need free space (repeatable).",
        ),
        click.option("--min-free-gib", type=click.FloatRange(min=0), default=1.0, show_default=True),
        click.option(
            "--inject-gpu-faults",
            "fault_file",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="TEST ONLY: a GPU fault file (JSON lines); any fault in it fails the check.",
        ),
        click.option(
            "--paired",
            "paired",
            default=None,
            metavar="NODES",
            help="Instead: the two-round paired check across NODES (a Slurm hostlist, e.g. n[1-4]).",
        ),
        click.option("--job", "job_id", type=int, default=None, help="--paired: run as steps of this job."),
        click.option(
            "--master-addr", default=None, help="--paired: rendezvous address (default: first node)."
        ),
        click.option("--timeout-s", type=click.FloatRange(min=5), default=60.0, show_default=True),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


NODE_CHECK_HELP = """Check this node (GPUs through NVML, disk space, stuck GPU processes).

    Exits 0 when healthy, 1 with the failed checks as the reason otherwise (for Slurm's
    HealthCheckProgram and for unicornd before a node rejoins). With ``--paired NODES``
    runs a small all-gather and matmul per pair of nodes, re-pairs suspects with
    healthy nodes, and exits 1 naming the bad node(s); exit 2 for bad usage (an unknown
    node).
"""


def run_node_check(
    *,
    config_path: Path | None,
    disk_paths: tuple[Path, ...],
    min_free_gib: float,
    fault_file: Path | None,
    paired: str | None,
    job_id: int | None,
    master_addr: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """The command's body: prints the checks, exits 1 when one failed (see NODE_CHECK_HELP).
    ``config_path``: unicorn.toml (None: ``$UNICORN_CONFIG``), read only by ``--paired``."""
    if paired is not None:
        _paired_check(
            config_path, paired, job_id=job_id, master_addr=master_addr, timeout_s=timeout_s, as_json=as_json
        )
        return
    results = run_local_checks(disk_paths=list(disk_paths), min_free_gib=min_free_gib, fault_file=fault_file)
    failed = [r for r in results if r.outcome == Outcome.FAILED]
    if as_json:
        click.echo(json.dumps({"healthy": not failed, "checks": [r.to_json() for r in results]}, indent=2))
    else:
        for r in results:
            click.echo(f"{r.outcome.value:<8} {r.name:<16} {r.detail}")
    if failed:
        reason = "; ".join(f"{r.name}: {r.detail}" for r in failed)
        click.echo(f"unhealthy: {reason}", err=True)
        sys.exit(1)


def _paired_check(
    config_path: Path | None,
    hostlist: str,
    *,
    job_id: int | None,
    master_addr: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    configure_logging(
        cfg.log.level, "console" if cfg.log.format == "auto" else cfg.log.format, stream=sys.stderr
    )
    try:
        nodes = expand(hostlist)
    except UnicornError as e:
        raise click.BadParameter(str(e), param_hint="--paired") from None
    if len(nodes) < 2:
        raise click.BadParameter("needs at least 2 nodes", param_hint="--paired")

    async def go() -> PairedCheckReport:
        slurm = await make_backend(cfg.slurm)
        known = {n.name for n in await slurm.list_nodes()}
        unknown = [n for n in nodes if n not in known]
        if unknown:
            raise click.BadParameter(f"unknown node(s) {unknown}", param_hint="--paired")
        return await paired_check(slurm, nodes, master_addr=master_addr, timeout_s=timeout_s, job_id=job_id)

    try:
        report = asyncio.run(go())
    except UnicornError as e:
        raise click.ClickException(f"paired check failed to run: {e}") from None
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for r in report.results:
            click.echo(f"{'ok' if r.ok else 'FAILED':<7} {','.join(r.nodes):<16} {r.detail}")
        d = report.diagnosis
        click.echo(f"bad: {', '.join(d.bad) or '-'}   unresolved: {', '.join(d.unresolved) or '-'}")
    if report.diagnosis.bad or report.diagnosis.unresolved:
        sys.exit(1)


@click.command("unicorn-node-check", help=NODE_CHECK_HELP)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="unicorn.toml, read by --paired (default: $UNICORN_CONFIG, else built-in defaults).",
)
@node_check_options
def node_check_command(config_path: Path | None, **options: Any) -> None:
    run_node_check(config_path=config_path, **options)


def main() -> None:
    """``unicorn-node-check``."""
    node_check_command(prog_name="unicorn-node-check")
