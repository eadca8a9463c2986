"""Classifier: whole texts, process exits, exceptions and GPU events."""

from __future__ import annotations

import json
import signal

import pytest

from detect.classify import (
    BENIGN,
    EVIDENCE_CHARS,
    MAX_LINE_CHARS,
    Classification,
    Classifier,
    load_classifier,
)
from detect.statuses import ErrorStatus, Severity, worst
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import GpuFaultKind


@pytest.fixture(scope="module")
def c() -> Classifier:
    return load_classifier()


# hiyouga/LlamaFactory#7396 style: a rank's stderr tail after a watchdog timeout kills it
WATCHDOG_TAIL = """\
[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.
[rank0]:[E321 02:07:08.465150152 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 1580, last enqueued NCCL work: 1582, last completed NCCL work: 1579.
[rank0]:[E321 02:07:08.465 ProcessGroupNCCL.cpp:627] [Rank 0] To avoid data inconsistency, we are taking the entire process down.
terminate called after throwing an instance of 'c10::DistBackendError'
"""  # noqa: E501

# meta-llama/llama-cookbook#290: the CUDA cause appears after a generic terminate line
LAUNCH_FAILURE_TAIL = """\
terminate called after throwing an instance of 'std::runtime_error'
  what():  [Rank 0] NCCL watchdog thread terminated with exception: CUDA error: unspecified launch failure
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1.
"""  # noqa: E501


def test_text_picks_specific_then_most_severe_then_first(c: Classifier) -> None:
    text = (
        "NCCL WARN NET/IB : Got async event : port error\nRuntimeError: CUDA error: uncorrectable ECC error\n"
    )
    assert c.classify_text(text).status is ErrorStatus.ECC_ERROR
    # the specific CUDA rule beats the generic terminate line before it
    assert c.classify_text(LAUNCH_FAILURE_TAIL).rule == "cuda_launch_failure"
    # even a less severe specific cause beats a generic summary line (SEV3 over SEV2)
    assert c.classify_text(WATCHDOG_TAIL).rule == "nccl_watchdog_timeout"
    assert c.classify_text("terminate called after throwing an instance of 'x'\n").rule == "cpp_terminate"
    # equal severity and both specific: the first line wins
    two = "Segmentation fault (core dumped)\nRuntimeError: CUDA error: device-side assert triggered\n"
    assert c.classify_text(two).rule == "segfault"
    assert c.classify_text("all good\nloss 1.0\n") == BENIGN


def test_long_lines_cost_bounded_time_and_evidence_is_cut(c: Classifier) -> None:
    late = "x" * (MAX_LINE_CHARS + 10) + " CUDA error: an illegal memory access was encountered"
    assert c.classify_line(late) == BENIGN  # beyond the matched prefix
    early = "CUDA error: an illegal memory access was encountered " + "y" * 5000
    result = c.classify_line(early)
    assert result.status is ErrorStatus.ILLEGAL_MEMORY_ACCESS and len(result.evidence) == EVIDENCE_CHARS


def test_classification_invariants_and_json() -> None:
    with pytest.raises(InvalidArgument):
        Classification(ErrorStatus.NONE, Severity.SEV1, "x")
    with pytest.raises(InvalidArgument):
        Classification(ErrorStatus.ECC_ERROR, None, "x")
    doc = Classification(ErrorStatus.ECC_ERROR, Severity.SEV1, "r", "e").to_json()
    assert json.loads(json.dumps(doc)) == {
        "status": "ecc_error",
        "severity": "SEV1",
        "rule": "r",
        "evidence": "e",
    }
    assert BENIGN.to_json()["severity"] is None and BENIGN.to_json()["status"] == "none"


def test_severity_order() -> None:
    assert Severity.SEV1.is_worse_than(Severity.SEV2) and not Severity.SEV3.is_worse_than(Severity.SEV2)
    assert worst([None, Severity.SEV3, Severity.SEV1, Severity.SEV2]) is Severity.SEV1
    assert worst([None]) is None
    assert min([Severity.SEV3, Severity.SEV1]) is Severity.SEV1  # string order agrees with level


# --------------------------------------------------------------------------- exits


def test_clean_exit_is_benign_even_with_scary_stderr(c: Classifier) -> None:
    assert c.classify_exit(0, None, "NCCL WARN something").status is ErrorStatus.NONE


def test_exit_fallbacks(c: Classifier) -> None:
    plain = c.classify_exit(3, None)
    assert (plain.status, plain.severity, plain.rule) == (
        ErrorStatus.EXITED_ABNORMALLY,
        Severity.SEV2,
        "exit_nonzero",
    )
    assert c.classify_exit(None, None).rule == "exit_status_unknown"
    aborted = c.classify_exit(None, int(signal.SIGABRT))
    assert aborted.rule == "killed_by_signal" and "SIGABRT" in aborted.evidence


def test_exit_signals_and_shell_codes(c: Classifier) -> None:
    assert c.classify_exit(None, int(signal.SIGKILL)).rule == "killed_sigkill"
    shell = c.classify_exit(137, None)  # 128 + SIGKILL, as a shell reports it
    assert shell.rule == "killed_sigkill" and "SIGKILL" in shell.evidence and "137" in shell.evidence
    assert c.classify_exit(139, None).rule == "crashed_sigsegv"
    term = c.classify_exit(None, int(signal.SIGTERM))
    assert term.rule == "terminated" and term.secondary


def test_exit_cause_from_stderr_is_raised_to_sev2_and_keeps_secondary(c: Classifier) -> None:
    # the watchdog takes the process down with SIGABRT: the timeout is the cause, and a
    # consequence of a failure elsewhere
    result = c.classify_exit(None, int(signal.SIGABRT), WATCHDOG_TAIL)
    assert (result.status, result.severity, result.rule) == (
        ErrorStatus.NCCL_TIMEOUT,
        Severity.SEV2,
        "nccl_watchdog_timeout",
    )
    assert result.secondary and result.evidence.startswith("killed by SIGABRT: ")


def test_exit_more_severe_cause_wins_over_signal(c: Classifier) -> None:
    result = c.classify_exit(
        None, int(signal.SIGSEGV), "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    )
    assert (result.status, result.severity) == (ErrorStatus.ECC_ERROR, Severity.SEV1)


def test_exit_primary_signal_beats_secondary_text(c: Classifier) -> None:
    # SIGKILL (likely the OOM killer) is a cause; a timeout line in the tail is not
    result = c.classify_exit(None, int(signal.SIGKILL), WATCHDOG_TAIL)
    assert result.rule == "killed_sigkill" and not result.secondary and "Watchdog" in result.evidence


def test_exit_oom_text_explains_sigkill(c: Classifier) -> None:
    tail = "Out of memory: Killed process 25315 (python3) total-vm:53312244kB"
    assert c.classify_exit(137, None, tail).rule == "host_oom_kill"


def test_exit_reads_torchelastic_error_file(c: Classifier) -> None:
    doc = {
        "message": {
            "message": "RuntimeError: CUDA error: an illegal memory access was encountered",
            "extraInfo": {
                "py_callstack": "Traceback (most recent call last):\n  ...",
                "timestamp": "1700000000",
            },
        }
    }
    result = c.classify_exit(1, None, "", json.dumps(doc))
    assert result.status is ErrorStatus.ILLEGAL_MEMORY_ACCESS
    old = c.classify_exit(1, None, "", json.dumps({"message": "RuntimeError: Connection reset by peer"}))
    assert (old.status, old.severity) == (ErrorStatus.CONNECTION_REFUSED_RESET, Severity.SEV2)
    raw = c.classify_exit(1, None, "", "Segmentation fault")
    assert raw.rule == "segfault"


@pytest.mark.parametrize(("code", "sig"), [(1, 9), (256, None), (-1, None), (None, 0), (None, 99)])
def test_exit_rejects_impossible_status(c: Classifier, code: int | None, sig: int | None) -> None:
    with pytest.raises(InvalidArgument):
        c.classify_exit(code, sig)


# --------------------------------------------------------------------------- exceptions


def test_exceptions(c: Classifier) -> None:
    oom = c.classify_exception("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert oom.rule == "cuda_out_of_memory_exception"
    assert c.classify_exception("builtins.SystemExit", "0").status is ErrorStatus.NONE
    assert c.classify_exception("builtins.SystemExit", "2").status is ErrorStatus.OTHER_SOFTWARE_ERROR
    net = c.classify_exception(
        "torch.distributed.DistBackendError",
        "NCCL error in: x, remote process exited or there was a network error, NCCL version 2.21.5",
    )
    assert net.rule == "nccl_remote_error" and net.secondary
    plain = c.classify_exception("builtins.ValueError", "bad shape")
    assert (plain.status, plain.rule) == (ErrorStatus.OTHER_SOFTWARE_ERROR, "python_exception")
    assert plain.evidence == "ValueError: bad shape"
    odd = c.classify_exception("weird", "")
    assert odd.rule == "uncaught_exception"


def test_exception_cause_deep_in_traceback(c: Classifier) -> None:
    tb = (
        'Traceback (most recent call last):\n  File "train.py", line 3, in step\n'
        "RuntimeError: CUDA error: uncorrectable ECC error encountered\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\nValueError: cleanup failed\n"
    )
    result = c.classify_exception("builtins.ValueError", "cleanup failed", tb)
    assert result.status is ErrorStatus.ECC_ERROR and "ECC" in result.evidence


# --------------------------------------------------------------------------- GPU events


@pytest.mark.parametrize(
    ("kind", "value", "status", "rule"),
    [
        (GpuFaultKind.XID, 79, "gpu_driver_error", "xid_79"),
        (GpuFaultKind.XID, 48, "ecc_error", "xid_48"),
        (GpuFaultKind.XID, 74, "nvlink_error", "xid_74"),
        (GpuFaultKind.XID, 999, "cuda_error", "xid_other"),
        (GpuFaultKind.ECC_UNCORRECTABLE, 2, "ecc_error", "gpu_ecc_uncorrectable"),
        (GpuFaultKind.ECC_UNCORRECTABLE, 0, "none", ""),
        (GpuFaultKind.RETIRED_PAGES, 1, "ecc_error", "gpu_retired_pages"),
        (GpuFaultKind.REMAPPED_ROWS, 3, "ecc_error", "gpu_remapped_rows"),
        (GpuFaultKind.NVLINK_ERROR, 5, "nvlink_error", "gpu_nvlink_errors"),
        (GpuFaultKind.TEMPERATURE, 92, "gpu_driver_error", "gpu_overheat"),
        (GpuFaultKind.DRIVER_ERROR, 0, "gpu_driver_error", "gpu_driver_unusable"),
    ],
)
def test_gpu_events(c: Classifier, kind: GpuFaultKind, value: float, status: str, rule: str) -> None:
    result = c.classify_gpu(kind, value)
    assert (result.status.value, result.rule) == (status, rule)


def test_gpu_event_xid_94_is_contained(c: Classifier) -> None:
    result = c.classify_gpu(GpuFaultKind.XID, 94)
    assert (result.status, result.severity) == (ErrorStatus.ECC_ERROR, Severity.SEV2)
    assert result.evidence.startswith("xid = 94: ")


@pytest.mark.parametrize(
    ("kind", "value"),
    [(GpuFaultKind.XID, 1.5), (GpuFaultKind.XID, -1), (GpuFaultKind.TEMPERATURE, float("nan"))],
)
def test_gpu_event_rejects_bad_values(c: Classifier, kind: GpuFaultKind, value: float) -> None:
    with pytest.raises(InvalidArgument):
        c.classify_gpu(kind, value)


def test_rule_lookup_by_name(c: Classifier) -> None:
    rule = c.rule_named("nccl_watchdog_timeout")
    assert rule is not None and rule.secondary and rule.status is ErrorStatus.NCCL_TIMEOUT
    assert c.rule_named("no_such_rule") is None
