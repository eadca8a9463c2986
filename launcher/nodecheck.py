"""Local node health checks: GPUs (NVML), disk space, stuck processes.

Used by ``unicornctl node-check`` (diagnosis, and Slurm's HealthCheckProgram) and by
unicornd before a returning node rejoins a task. Every check returns a
:class:`CheckResult`; the node is healthy when none failed. A check that cannot apply
(no NVML on a CPU machine) is ``skipped``, not failed.

``fault_file`` is the test path for CPU machines: JSON lines as read by
:class:`launcher.gpu.FaultFile` (``{"gpu": 0, "kind": "xid", "value": 79}``); any line
present fails the GPU check. Never used unless passed explicitly.
"""

from __future__ import annotations

import enum
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unicorn_core.protocol import GpuFaultKind


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
