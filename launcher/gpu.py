"""GPU health monitoring through NVML (nvidia-ml-py), one thread per GPU.

Each thread waits on NVML's Xid event set (blocking with a timeout, which is why every
GPU gets its own thread) and, between waits, polls counters and reports *increases*
over the values seen at start: volatile uncorrectable ECC errors, retired pages
(double-bit), remapped rows (uncorrectable, pending, failed), NVLink CRC/replay/recovery
errors, and the temperature crossing ``max_temp_c``. A counter a GPU does not support is
skipped silently. On a machine without NVML the monitor says so once and monitors
nothing.

:class:`FaultFile` is the test path for CPU machines: JSON lines appended to a file
become :class:`GpuHealthEvent` with ``injected=True``. It is enabled only by the agent's
``--inject-gpu-faults FILE`` option, never by default.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from unicorn_core.logs import get_logger
from unicorn_core.protocol import GpuFaultKind

log = get_logger(__name__)

GpuCallback = Callable[[int, GpuFaultKind, float, str, bool], None]
"""(gpu_index, kind, value, detail, injected) -> None; called from monitor threads."""

_NVLINK_COUNTERS: Final = ("CRC_FLIT", "CRC_DATA", "REPLAY", "RECOVERY")


class GpuMonitor:
    """NVML watcher threads; :meth:`start` returns the number of GPUs monitored (0 without NVML)."""

    def __init__(self, on_event: GpuCallback, *, poll_s: float = 1.0, max_temp_c: float = 90.0) -> None:
        self._on_event = on_event
        self._poll_s = poll_s
        self._max_temp_c = max_temp_c
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._nvml: Any = None

    def start(self) -> int:
        try:
            import pynvml

            pynvml.nvmlInit()
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception as e:  # NVMLError, ImportError, missing libnvidia-ml.so
            log.info("nvml_unavailable", reason=str(e) or type(e).__name__, monitoring="nothing")
            return 0
        self._nvml = pynvml
        for index in range(count):
            t = threading.Thread(target=self._watch, args=(index,), name=f"gpu-{index}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("nvml_monitoring", gpus=count)
        return count

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self._poll_s + 1)
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception as e:
                log.debug("nvml_shutdown_failed", error=str(e))

    def _read(self, handle: Any) -> dict[str, float]:
        """Every supported counter of one GPU; unsupported ones are absent."""
        nv = self._nvml
        out: dict[str, float] = {}

        def attempt(name: str, fn: Callable[[], float]) -> None:
            try:
                out[name] = float(fn())
            except Exception:  # NVMLError_NotSupported and friends: counter absent
                return

        attempt(
            "ecc",
            lambda: nv.nvmlDeviceGetTotalEccErrors(
                handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
        )
        attempt(
            "retired",
            lambda: len(
                nv.nvmlDeviceGetRetiredPages(handle, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
            ),
        )

        def remapped() -> float:
            _corr, unc, pending, failure = nv.nvmlDeviceGetRemappedRows(handle)
            return float(unc) + float(bool(pending)) + float(bool(failure)) * 1000

        attempt("remapped", remapped)
        attempt("temp", lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))

        def nvlink() -> float:
            total = 0
            for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
                for counter in _NVLINK_COUNTERS:
                    try:
                        total += int(
                            nv.nvmlDeviceGetNvLinkErrorCounter(
                                handle, link, getattr(nv, f"NVML_NVLINK_ERROR_DL_{counter}")
                            )
                        )
                    except Exception:
                        break
            return float(total)

        attempt("nvlink", nvlink)
        return out

    def _watch(self, index: int) -> None:
        nv = self._nvml
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:
            self._on_event(index, GpuFaultKind.DRIVER_ERROR, 0.0, f"cannot open GPU: {e}", False)
            return
        events: Any = None
        try:
            events = nv.nvmlEventSetCreate()
            nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
        except Exception as e:
            log.info("nvml_xid_events_unsupported", gpu=index, reason=str(e))
            events = None
        baseline = self._read(handle)
        hot = False
        while not self._stop.is_set():
            if events is not None:
                try:
                    data = nv.nvmlEventSetWait_v2(events, int(self._poll_s * 1000))
                    xid = int(data.eventData)
                    self._on_event(index, GpuFaultKind.XID, float(xid), f"Xid {xid}", False)
                except Exception:  # noqa: S110 - NVML_ERROR_TIMEOUT: no event within the poll period
                    pass
            else:
                self._stop.wait(self._poll_s)
            now = self._read(handle)
            for name, kind in (
                ("ecc", GpuFaultKind.ECC_UNCORRECTABLE),
                ("retired", GpuFaultKind.RETIRED_PAGES),
                ("remapped", GpuFaultKind.REMAPPED_ROWS),
                ("nvlink", GpuFaultKind.NVLINK_ERROR),
            ):
                if name in now and now[name] > baseline.get(name, 0.0):
                    self._on_event(
                        index, kind, now[name], f"{name} {baseline.get(name, 0):g} -> {now[name]:g}", False
                    )
                    baseline[name] = now[name]
            temp = now.get("temp")
            if temp is not None and (temp >= self._max_temp_c) != hot:
                hot = temp >= self._max_temp_c
                if hot:
                    self._on_event(index, GpuFaultKind.TEMPERATURE, temp, f"{temp:g} C", False)
        if events is not None:
            try:
                nv.nvmlEventSetFree(events)
            except Exception as e:
                log.debug("nvml_event_set_free_failed", error=str(e))


class FaultFile:
    """Test-only GPU fault source: JSON lines ``{"gpu": 0, "kind": "xid", "value": 79}``.

    Lines appended to ``path`` after start are delivered once each; a malformed line is
    logged and skipped (it changes nothing).
    """

    def __init__(self, path: Path, on_event: GpuCallback, *, poll_s: float = 0.1) -> None:
        self._path = path
        self._on_event = on_event
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._offset = path.stat().st_size if path.exists() else 0
        self._thread = threading.Thread(target=self._run, name="gpu-fault-file", daemon=True)
        self.rejected = 0

    def start(self) -> None:
        log.warning("gpu_fault_injection_enabled", path=str(self._path))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                with self._path.open("rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self._offset += end + 1
            for raw in data[: end + 1].splitlines():
                if raw.strip():
                    self._deliver(raw)

    def _deliver(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
            gpu = int(doc["gpu"])
            kind = GpuFaultKind(doc["kind"])
            value = float(doc.get("value", 0.0))
            detail = str(doc.get("detail", f"injected {kind.value}"))
            if gpu < 0:
                raise ValueError("gpu must be >= 0")
        except (ValueError, KeyError, TypeError) as e:
            self.rejected += 1
            log.warning("gpu_fault_line_rejected", line=raw[:200].decode(errors="replace"), error=str(e))
            return
        self._on_event(gpu, kind, value, detail, True)
