"""The built-in rule table: evidence from PyTorch, NCCL, CUDA, the NVIDIA driver, the
kernel, the launchers and Slurm, mapped to Unicron's statuses (schema: :mod:`detect.rules`).

Order is priority (first match wins per line), grouped so that the most specific and
most severe explanation of a line comes first:

1. benign lines (status ``none``), before everything else, so that they veto every rule
   below: the line's own log level is INFO or WARNING (NCCL ``INFO``, glog/c10d
   ``[W ...]``/``[I ...]``, Python logging, ``UserWarning``), it states a zero count or a
   healthy state, it reports a retry that follows, or an exception that was ignored;
2. NVIDIA Xid codes: every code of NVIDIA's Xid catalogue, with the catalogue's meaning
   and resolution (see ``_XID_CATALOG``);
3. hardware and driver (SEV1): ECC, GPU lost or off the bus, driver failures, DMA/IOMMU,
   NVLink;
4. CUDA errors raised in the process (SEV2);
5. the process or node itself: crashes, OOM kills, launchers' failure summaries
   (torchrun, DeepSpeed, Accelerate), Slurm;
6. network and collectives (SEV3): NCCL timeouts and errors, resets, link flaps;
7. generic catch-alls (a Python exception line, a C++ terminate, any ``NCCL WARN``).

Every line rule is exercised by a line in ``tests/detect``: a real line with its public
source (``data/real-log-lines.toml``, the corpus's train and dev sets) or, where none
exists yet, a constructed example marked as such. Accuracy on real lines is measured by
``scripts/bench/classify.py`` on the corpus's blind set (``corpus/blind8/``, collected in
session 31): no rule was written from it. The earlier blind sets (``corpus/fresh/``,
``corpus/blind2/`` to ``corpus/blind7/``) were read for rules once a newer one existed
(BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Final

_ERRORS = r"(?:errors?|failures?|faults?)"
"""The nouns whose count a line may state."""


def _each(template: str, *words: str) -> str:
    """``template`` with ``@`` replaced by each word, as top-level alternatives.

    Spelled out this way (not ``(?:a|b)`` inside), every alternative keeps a literal at
    the top level, which the prefilter (:mod:`detect.literals`) needs to skip the regex.
    """
    return "|".join(template.replace("@", word) for word in words)


_NOUNS = ("errors?", "failures?", "faults?")
_LEVELS = ("WARNING", "INFO", "DEBUG")

_CATALOG = "NVIDIA Xid catalog, docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
_ARCHIVE = "NVIDIA Xid errors for older GPUs, docs.nvidia.com/deploy/xid-errors/archive/index.html"


def _described(description: str, *codes: int) -> dict[int, str]:
    """``{code: description}`` for codes that share the catalogue's description."""
    return dict.fromkeys(codes, description)


_XidEntry = tuple[str, dict[int, str], str, str | None, str, dict[str, object]]
"""(name suffix, {code: the catalogue's description}, status, severity (None: the
status's), why this status and severity, extra rule keys). Each code becomes one rule,
``xid_<code><suffix>``."""

_NVLINK5: Final = {
    144: "NVLINK: SAW Error",
    145: "NVLINK: RLW Error",
    146: "NVLINK: TLW Error",
    147: "NVLINK: TREX Error",
    148: "NVLINK: NVLPW_CTRL Error",
    149: "NVLINK: NETIR Error",
    150: "NVLINK: MSE Error",
}
"""NVLink5 Xids: one table for the Nonfatal and the Fatal rules below."""

_XID_CATALOG: Final[tuple[_XidEntry, ...]] = (
    # Severity follows the catalogue's "Resolution Bucket (Immediate Action)":
    # RESET_GPU / RESTART_BM / CHECK_MECHANICALS -> SEV1 (the GPU or node must be serviced),
    # RESTART_APP -> SEV2, IGNORE -> SEV3 (recorded, no action) or none for test events.
    (
        "_after_xid",
        {13: "Graphics Engine Exception", 31: "GPU memory page fault"},
        "illegal_memory_access",
        None,
        "an application fault the line itself says an earlier Xid caused: a consequence, the named "
        "Xid's own line is the cause",
        {"secondary": True, "message": r"(?:caused by|due to|after) (?:an? )?(?:previous |earlier )?Xid\b"},
    ),
    (
        "",
        {13: "Graphics Engine Exception", 31: "GPU memory page fault (MMU fault)"},
        "illegal_memory_access",
        None,
        "an application fault, typically an out-of-bounds access or illegal instruction (13) or an "
        "illegal address (31); RESTART_APP",
        {},
    ),
    (
        "",
        {43: "GPU stopped processing", 45: "Preemptive cleanup, due to previous errors"},
        "cuda_error",
        None,
        "the application's channel was torn down: it hit a software-induced fault (43; the GPU stays "
        "healthy) or it was aborted by Ctrl-C, SIGKILL, a GPU reset or another Xid (45): a consequence",
        {"secondary": True},
    ),
    (
        "",
        {
            48: "Double Bit ECC Error",
            64: "GPU memory remapping (page retirement) failure",
            95: "Uncontained memory error",
            140: "ECC Unrecovered Error",
            168: "Errors found in WPR (reduced GPU memory capacity)",
            171: "Uncorrectable DRAM error (details of an Xid 48)",
            172: "Uncorrectable SRAM error (details of an Xid 48)",
        },
        "ecc_error",
        None,
        "an uncorrectable memory error the GPU cannot contain or repair; a GPU reset or node reboot is "
        "needed (WORKFLOW_XID_48, RESET_GPU)",
        {},
    ),
    (
        "",
        {94: "Contained memory error"},
        "ecc_error",
        "SEV2",
        "contained to one application, which must restart; the GPU keeps serving others (RESTART_APP)",
        {},
    ),
    (
        "",
        {
            63: "GPU memory remapping (page retirement) event",
            92: "High single-bit ECC error rate",
        },
        "ecc_error",
        "SEV3",
        "memory errors the GPU handled (a row marked for remapping at the next reset, corrected "
        "single-bit errors); the catalogue's immediate action is IGNORE",
        {},
    ),
    (
        "",
        {
            46: "GPU stopped processing (GPU timeout)",
            61: "Internal micro-controller breakpoint/warning (Unused on Ampere and newer; older GPUs: "
            "docs.nvidia.com/deploy/xid-errors/archive/index.html)",
            62: "Internal micro-controller halt",
            79: "GPU has fallen off the bus",
            109: "Context Switch Timeout Error",
            110: "Security Fault Error",
            119: "GSP RPC Timeout",
            120: "GSP Error",
            143: "GPU Initialization Error",
            156: "Resource Retirement Event",
            158: "GPU Fatal Timeout",
            167: "PCIE_FATAL_TIMEOUT",
            169: "Internal micro-controller halt (SEC2)",
        },
        "gpu_driver_error",
        None,
        "the GPU or its firmware stopped working; RESET_GPU (79: RESTART_BM)",
        {},
    ),
    (
        "",
        {
            54: "Auxiliary power is not connected to the GPU board (CHECK_MECHANICALS)",
            78: "vGPU Start Error (UPDATE_SWFW)",
            151: "Key rotation Error (RESTART_VM)",
        },
        "gpu_driver_error",
        None,
        "the GPU cannot serve until someone acts on the node",
        {},
    ),
    (
        "",
        {
            37: "Driver firmware error",
            38: "Driver firmware error",
            44: "Graphics Engine fault during context switch",
            66: "Illegal access by driver",
            67: "Illegal access by driver",
            93: "Non-fatal violation of provisioned InfoROM wear limit",
            157: "Resource Retirement Failure",
            159: "CHI Non-Data Error (CHECK_UVM: IGNORE without UVM/vGPU)",
            163: "Power Smoothing HW Circuitry capability disengaged",
            164: "Power Smoothing HW Circuitry low lifetime reached",
            165: "Power Smoothing HW Circuitry lifetime exhausted",
        },
        "gpu_driver_error",
        "SEV3",
        "driver or firmware events the catalogue marks IGNORE (no immediate action)",
        {},
    ),
    (
        "",
        {
            74: "NVLINK Error",
            136: "Link Training Failed",
            155: "NVLINK: SW Defined Error (link down flagged intentional)",
        },
        "nvlink_error",
        None,
        "an NVLink connection to another GPU or NVSwitch failed; a GPU reset or node reboot is needed "
        "(74: WORKFLOW_NVLINK_ERR; 136, 155: RESET_GPU)",
        {},
    ),
    (
        "_nonfatal",
        _NVLINK5,
        "nvlink_error",
        "SEV3",
        "the line marks the NVLink5 error Nonfatal; the catalogue's 'XID 144-150 Decode' gives non-fatal "
        "sub-codes IGNORE or XID_154_EVAL, not a reset",
        {"message": r"\bNon-?fatal\b", "ignore_case": True},
    ),
    (
        "",
        _NVLINK5,
        "nvlink_error",
        None,
        "an NVLink5 error, Fatal or Link Fatal (WORKFLOW_NVLINK5_ERR: the decode says RESET_GPU)",
        {},
    ),
    (
        "",
        {
            108: "NVLINK_REMOTE_TRANSLATION_ERROR (Unused)",
            121: "C2C Error (corrected errors on the C2C NVLink to a Grace CPU)",
            166: "CC traffic seen prior to link properly being configured for encrypted traffic",
            170: "Interrupt seen in CC mode",
        },
        "nvlink_error",
        "SEV3",
        "NVLink or C2C events with no immediate action (IGNORE, or confidential-computing mode only)",
        {},
    ),
    (
        "_reset",
        {154: "GPU Recovery Action Changed"},
        "gpu_driver_error",
        None,
        "the recovery action the other Xids need became GPU Reset Required (newer drivers: PF FLR, a "
        "function-level reset), Node Reboot Required or Drain and Reset",
        {
            "message": r"\b(?:GPU Reset Required|Node Reboot Required|Drain and Reset|PF FLR)\b",
            "ignore_case": True,
        },
    ),
    (
        "_drain_p2p",
        {154: "GPU Recovery Action Changed"},
        "nvlink_error",
        None,
        "the recovery action became Drain P2P: peer-to-peer (NVLink) traffic must stop",
        {"message": r"\bDrain P2P\b", "ignore_case": True},
    ),
    (
        "",
        {
            14: "ROBUST_CHANNEL_FAKE_ERROR (fake or injected error)",
            106: "SMBPBI Test Message",
            107: "SMBPBI Test Message Silent",
            154: "GPU Recovery Action Changed (to None)",
            162: "Power Smoothing HW Circuitry capability reengaged",
        },
        "none",
        None,
        "not a fault: a test event, or information about another Xid",
        {},
    ),
    (
        "",
        {
            8: "GPU stopped processing",
            11: "Invalid or corrupted push buffer stream",
            25: "Invalid or illegal push buffer stream",
            32: "Invalid or corrupted push buffer stream",
            60: "Video processor exception",
            69: "Graphics Engine class error",
            80: "Corrupted data sent to GPU",
            86: "OFA Exception",
            139: "OFA1 Error",
            142: "NVENC3 Error",
            **_described("Copy Engine Exception", 39, 40, 41),
            **_described("Copy Engine: Unknown Error", 70, 71, 72, 75, 76, 77, 85, *range(126, 136)),
            **_described("NVDEC Error", 68, 83, 84, 88, 89, 96, 97, 98),
            **_described("NVJPG Error", 82, 99, 100, 101, 102, 103, 104, 105),
        },
        "cuda_error",
        None,
        "a fault in one application's channel or engine; RESTART_APP",
        {},
    ),
    (
        "",
        {137: "NVLink Privilege Error"},
        "illegal_memory_access",
        None,
        "the remote MMU rejected an illegal NVLink peer-to-peer access, typically an application bug "
        "(XID_137_FLOW)",
        {},
    ),
    (
        "",
        {
            141: "CUDA Fast Path Error",
            152: "DLA SMMU Error",
            153: "DLA timeout Error",
            160: "Channel Retirement Event",
            161: "Channel Retirement Failure",
        },
        "cuda_error",
        "SEV3",
        "channel events the catalogue marks IGNORE",
        {},
    ),
)
"""Every code of NVIDIA's Xid catalogue (1-172) that is in use on current GPUs, with the
catalogue's description; the codes it lists as Unused fall to ``xid_other``. Source:
``_CATALOG``."""

_XID_RULES: Final = tuple(
    {
        "name": f"xid_{code}{suffix}",
        "status": status,
        "xid": [code],
        "doc": f"Xid {code}, {description}: {why} ({_CATALOG})",
        **({"severity": severity} if severity is not None else {}),
        **extra,
    }
    for suffix, codes, status, severity, why, extra in _XID_CATALOG
    for code, description in codes.items()
)

BUILTIN_RULES: Final[tuple[dict[str, object], ...]] = (
    # 1. benign lines (status none): they veto every rule below
    {
        "name": "nccl_info",
        "status": "none",
        "pattern": r"\bNCCL INFO\b",
        "doc": "NCCL informational output (including 'connect returned Connection refused, retrying')",
    },
    {
        "name": "log_level_glog",
        "status": "none",
        # [IWD] first, then a look back at the character before it: a pattern that starts with a
        # character set is scanned for in C, one that starts with a look-behind is tried everywhere
        "pattern": r"[IWD](?<![^\s:\]\[][IWD])(?:\d{3,4} \d\d:\d\d:\d\d[.\d]*\s+(?:\d+\s+)?[^\s\]]+:\d+\]|"
        r"(?<=\[[IWD]) [^\s\]]+:\d+\])",
        # glog's failure-signal handler, which some programs log at WARNING level (PaddlePaddle)
        "unless": r"\] \*\*\* SIG(?:ABRT|SEGV|BUS|ILL|FPE) \(@0x[0-9a-f]+\) received by PID \d+",
        "doc": "an INFO or WARNING line of glog/c10d (PyTorch's C++ log: '[W1206 18:44:12.7 "
        "socket.cpp:752]', "
        "'[W socket.cpp:558]', 'W0325 20:57:27.62 2606 api.py:869]'): the failure, if any, is reported at "
        "ERROR level (e.g. c10d's connect warnings while rendezvous retries)",
    },
    {
        "name": "log_level_python",
        "status": "none",
        "pattern": _each(
            r"^\s*@:[\w.]+:|\[@\s*[]|]|\| @\s+\||\s- @ -\s|^@ \d\d-\d\d |\b@: [a-z_]\w*(?:\.\w+)+:", *_LEVELS
        ),
        "doc": "a Python logging line at INFO or WARNING level (logging's 'WARNING:name:' or, behind a "
        "prefix, 'WARNING: torch.distributed.x:', DeepSpeed's "
        "'[INFO]', torch.distributed.run's '[WARNING]', loguru's '| INFO |', vLLM's 'INFO 03-07')",
    },
    {
        "name": "python_warning",
        "status": "none",
        "pattern": r"\b[A-Z]\w*Warning: |^\s*warnings\.warn\(|^\s*(?:\[[^\]]*\]:?\s*)?Warning: ",
        "doc": "a Python warning (UserWarning, FutureWarning, DeprecationWarning, ...) or a line printed as "
        "'Warning: ...' (e.g. 'Warning: NaN or Inf found in input tensor.' while the loss scaler adjusts): "
        "not a failure",
    },
    {
        "name": "zero_count",
        "status": "none",
        # (not a PCI address's function number, 'amdgpu 0000:05:00.0 failed with error -22'; not UCX's
        # 'no error callback is installed')
        "pattern": _each(
            r"\b(?:no|zero|(?<!:[0-9a-fA-F]{2}\.)0)\s+(?:[\w.-]+\s+){0,2}@\b(?!\s+(?:callback|handler)s?\b)",
            *_NOUNS,
        )
        + "|"
        + _each(r"\b@(?:\s+count)?\s*[:=]?\s*(?:0|none)\b(?![.\d])", *_NOUNS)
        + "|"
        + _each(r"\b@\s*[:=]?\s*0\b(?![.\d])", r"exit\s*code", "exit status", "return code")
        + "|"
        + _each(r"\b@\w*\b(?: \w+)?\s*:\s*(?:No|False|None)\s*$", "error", "fail", "fault", "pending")
        + r"|\bUncorr\w*\.?\s+ECC\b\D*\b0\b(?![.\d])"
        # a report's key-value row whose value is 0 (nvidia-smi -q: 'Double Bit ECC   : 0')
        + r"|^\s*[A-Za-z][\w .()/-]*?\s:\s*0\s*$",
        "unless": rf"\b{_ERRORS}(?:\s+count)?\s*[:=]?\s*[1-9]|\b[1-9]\d*\s+(?:[\w.-]+\s+)?{_ERRORS}\b"
        # CUDA's error string for a status that is an error ("...: No error" is its text for 0)
        r"|no CUDA-capable device is detected"
        # gloo prints the errno's text, "no error" when errno was 0, after the failure
        r"|connectFullMesh failed"
        # a status row whose exit code 0 is the container's, killed by the OOM killer (its reason,
        # not a flag 'OOMKilled: false'); a failed check whose condition reads '>= 0'
        r"|\breason:\s*OOMKilled\b|\bCheck failed: ",
        "ignore_case": True,
        "doc": "a zero count ('NVLink errors: 0', '0 errors', 'no errors', 'error count 0', "
        "'Uncorr. ECC ... 0', "
        "'exit code 0', 'Remapping Failure Occurred : No', a row 'Double Bit ECC : 0'), unless the "
        "same line also states a non-zero count",
    },
    {
        "name": "benign_phrasing",
        "status": "none",
        "pattern": r"\brunning fine\b|\bno (?:problems?|issues?) (?:found|detected)\b|\bwithout "
        r"(?:any )?errors?\b|"
        r"\berror[- ]free\b|\brecovery was successful\b|\b(?:recovered|reconnected) successfully\b|"
        r"\bsuccessfully (?:recovered|reconnected)\b|\ball (?:checks|tests) passed\b",
        "ignore_case": True,
        "doc": "a line that says things are fine (a health report, a recovery that worked)",
    },
    {
        "name": "retrying",
        "status": "none",
        "pattern": r"\bretrying\b|\bwill (?:be )?retr(?:y|ied)\b|\bretry(?:ing)? in \d",
        "unless": r"giving up|gave up|\b(?:max(?:imum)?|all) (?:number of )?(?:retries|attempts)|"
        r"retries exhausted|no more retries|after \d+ (?:retries|attempts|tries)|failed after|last attempt",
        "ignore_case": True,
        "doc": "an operation that failed and will be retried: only the final failure (giving up) is evidence",
    },
    {
        "name": "ignored_exception",
        "status": "none",
        "pattern": r"\bException ignored\b|\(ignored\)|\bignor(?:ed|ing) (?:the )?(?:above |following )?"
        r"(?:error|exception)s?\b",
        "ignore_case": True,
        "doc": "an exception Python or the program reports as ignored (e.g. in __del__ at shutdown)",
    },
    {
        "name": "interpreter_shutdown_noise",
        "status": "none",
        "pattern": r"can only test a child process|Can't get attribute '\w+' on None\b|"
        r"Python is likely shutting down|during interpreter shutdown|after interpreter shutdown"
        r"|can only join a child process|'NoneType' object has no attribute 'python_exit_status'",
        "doc": "exceptions raised in __del__ or atexit while Python tears modules down (DataLoader "
        "workers at exit: 'can only test a child process', globals already None): Python ignores them",
    },
    {
        "name": "cancellation",
        "status": "none",
        "pattern": r"\bCancelledError(?::|\s*$)",
        "doc": "an operation cancelled (TensorFlow's queues closing as a session ends, asyncio's tasks at "
        "shutdown): a reaction to a stop or to another failure, whose own line is the evidence; a rank "
        "that dies of it is classified by its exit",
    },
    {
        "name": "metric_description",
        "status": "none",
        # dcgm-exporter's counters file ('DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, counter, Total
        # number of NVLink flow-control CRC errors.'), Prometheus' '# HELP name text'
        "pattern": r"^\s*(?:DCGM_FI_\w+\s*,\s*(?:counter|gauge|label)\s*,|#\s*HELP\s+\S+\s)",
        "doc": "a metric's definition, which names the errors it would count: no count, no evidence",
    },
    {
        "name": "torchelastic_closing_signal",
        "status": "none",
        "pattern": r"Sending process \d+ closing signal SIG\w+",
        "doc": "torchrun stopping the remaining workers after a failure: a reaction, not evidence",
    },
    {
        "name": "srun_terminated_the_rest",
        "status": "none",
        "pattern": r"srun: error: \S+: tasks? [\d\-,\[\]]+: Terminated\s*$",
        "doc": "srun ending the job's other tasks (SIGTERM) after one failed or the step was cancelled: a "
        "reaction; the task that failed has a line of its own ('task 58: Exited with exit code 1')",
    },
    {
        "name": "srun_forcing_termination",
        "status": "none",
        "pattern": r"^srun: forcing job termination\s*$"
        r"|(?:^|\s)srun: Force Terminated (?:job \d+|StepId=[\d.]+)\s*$",
        "doc": "srun ending the step after a task failed (its own line names it) or a second interrupt "
        "or a cancel ('Force Terminated job 6050'): a reaction, not evidence",
    },
    {
        "name": "xla_cpu_fallback_probe",
        "status": "none",
        "pattern": r"\bcuda_driver\.cc:\d+\] failed call to cuInit: CUDA_ERROR_NO_DEVICE\b",
        "doc": "TensorFlow's or JAX's stream executor probing CUDA in a process that sees no GPU (a CPU "
        "host, or CUDA_VISIBLE_DEVICES emptied for a helper process) and going on with the CPU: printed "
        "at E level by healthy programs; a job that needed the GPU fails on its own device error or exit",
    },
    {
        "name": "nccl_no_ib_fallback",
        "status": "none",
        "pattern": r"NCCL WARN Failed to open libibverbs"
        r"|NCCL WARN Missing \"\w+=\w+\" from kernel command line"  # RCCL's start-up advisory
        r"|NCCL WARN Could not find a path for pattern \d+, falling back to simple order\b",
        "doc": "NCCL found no InfiniBand verbs library and uses sockets instead, or its topology search "
        "settles for a simpler ring: a setup notice, not a fault",
    },
    # 2. NVIDIA Xid codes
    *_XID_RULES,
    {
        "name": "xid_other",
        "status": "cuda_error",
        "xid": [],
        "generic": True,
        "doc": "an Xid the catalogue lists as Unused on current GPUs, or one it does not list: a GPU-side "
        f"error of unknown kind; restart the process ({_CATALOG})",
    },
    # 3. hardware and driver
    {
        "name": "ecc_uncorrectable",
        "status": "ecc_error",
        "pattern": r"uncorrectable ECC|ECC_UNCORRECTABLE|cudaErrorECCUncorrectable|double[- ]bit ECC|"
        r"\bDBE\b|Row Remapper: New row marked|row remapp?ing (?:failure|failed)|Remapping failure|"
        r"retired pages? pending|page retirement (?:failure|failed)|uncorrectable (?:memory|DRAM|SRAM) error|"
        r"\bECC errors? (?:detected|encountered|occurred)"
        r"|Uncorr\w*\.?\s+ECC\b\D*[1-9]"
        r"|^\s+Uncorrectable Error\s+: [1-9]\d*\s*$"
        # CUDA's code 214 (CUDA_ERROR_ECC_UNCORRECTABLE) as a runtime prints the failed call
        r"|\bcu[A-Z]\w* returned error 214\b|\bCUDA error \(214\)|\bCUDA error code \(214\)"
        r"|\bCheck failed: \w+ == (?:cuda|hip)Success \(214 vs\. 0\)",
        "ignore_case": True,
        "doc": "an uncorrectable GPU memory error, or a row remap or page retirement it caused",
    },
    {
        "name": "ecc_corrected",
        "status": "ecc_error",
        "severity": "SEV3",
        "pattern": r"single[- ]bit ECC|\bSBE\b|\bcorrect(?:ed|able) ECC|EDAC \w+: \d+ CE\b"
        r"|Corrected error, no action required",
        "ignore_case": True,
        "doc": "a corrected memory error (GPU single-bit, host EDAC CE): recorded, no action needed",
    },
    {
        "name": "host_memory_error",
        "status": "ecc_error",
        # APEI/GHES prints '[Hardware Error]' on each of a report's ~10 lines, corrected ones too:
        # only the lines that say it was not corrected
        "pattern": r"EDAC \w+: \d+ UE\b|Machine check events logged|"
        r"\[Hardware Error\]:.*\b(?:event severity: (?:fatal|recoverable)|uncorrected|uncorrectable)\b|"
        r"\bmce: .*(?:uncorrected|fatal)|Uncorrected hardware memory error|Memory failure: 0x[0-9a-f]+"
        r"|HANDLING MCE MEMORY ERROR",
        # the GPU driver's RAS report (drm_gpu_fault); APEI/GHES's words for an error the hardware
        # corrected (the same '[Hardware Error]' prefix)
        "unless": r"\bamdgpu\b|\bcorrected by h/w\b|\bevent severity: (?:corrected|info)\b",
        "ignore_case": True,
        "doc": "the host's memory or CPU reported a hardware error (EDAC uncorrectable, machine check, an "
        "APEI record that was not corrected), not one it corrected",
    },
    {
        "name": "gpu_fallen_off_bus",
        "status": "gpu_driver_error",
        "pattern": r"fallen off the bus",
        "ignore_case": True,
    },
    {
        "name": "gpu_lost",
        "status": "gpu_driver_error",
        "pattern": r"GPU_IS_LOST|GPU is lost|GPU requires reset|Unable to determine the device "
        r"handle for GPU|"
        r"RmInitAdapter failed|probe routine failed|rm_init_adapter failed|GPU \S+ is lost|"
        r"GPU has been removed|failed to initialize the GPU|GPU crash dump has been created|"
        r"GSP-FMC reported an error|kgspBootstrap\w*: .*error"
        r"|RmInitAdapter\b.*\b(?:fail|Cannot|error)"
        r"|config space inaccessible"
        # nvidia-docker on the host: the driver's unified-memory module does not load (not modprobe's
        # own words: run in a container, it reads the container's /lib/modules)
        r"|\bCould not load UVM kernel module\b"
        r"|can't change power state from \w+ to D0"
        r"|Unable to change power state from \w+ to D0, device inaccessible"
        r"|Detected Critical Xid Error"
        r"|\|\s*ERR!\s*\|"
        r"|\bGPU [0-9A-Fa-f:.]+: (?:Unknown Error|GPU is lost)"
        r"|nvidia: probe of \S+ failed"
        r"|nvidia-modeset: ERROR"
        r"|\[drm:nv\w*\] \*ERROR\*"
        r"|PCI I/O region assigned to your NVIDIA device is invalid"
        r"|NVRM: BAR\d is 0M @ 0x0"
        r"|BIOS may have misconfigured your GPU"
        r"|NVIDIA probe routine was not called"
        r"|No NVIDIA devices probed"
        r"|'nvidia\.com/gpu' device marked unhealthy"
        r"|NVRM: .*\bCannot attach gpu",
        "ignore_case": True,
        "doc": "the driver lost the GPU or could not bring it up (NV_ERR_GPU_IS_LOST, RmInitAdapter)",
    },
    {
        "name": "gsp_failure",
        "status": "gpu_driver_error",
        "pattern": r"_kgspLogXid\d+|kflcnCoreDump|_kgspRpc\w*|GSP RPC timeout|kgspDumpGspLogs|"
        r"_issueRpcAndWait\w*: rpc\w* failed"
        r"|kgsp\w*: .*\b(?:cannot|fail\w*|error)\b"
        r"|NVRM: GPU\d+ (?:GSP )?RPC (?:event )?(?:history|buffer contains)"
        r"|NVRM:\s+-?\d+\s+\d+\s+GSP_RM_\w+"
        r"|NVRM:\s+entry\s+function\s+data0"
        r"|Timeout after \d+s of waiting for RPC response"
        r"|rpcRecvPoll timedout"
        r"|GSP-CrashCat Report"
        r"|GSP-RM boot attempts exceeded",
        "ignore_case": True,
        "doc": "the driver's report of a failed GPU System Processor (the banner and crash dump it prints "
        "with Xid 119/120, RPC timeouts)",
    },
    {
        "name": "nvidia_driver_unusable",
        "status": "gpu_driver_error",
        "pattern": r"Driver/library version mismatch|couldn't communicate with the NVIDIA driver|"
        r"NVIDIA driver on your system is too old|Found no NVIDIA driver|no CUDA-capable device is detected|"
        r"CUDA driver initialization failed|CUDA-capable devices? (?:\(s\) )?(?:is|are|is/are) busy "
        r"or unavailable|"
        r"CUDA_ERROR_NO_DEVICE|cudaErrorNoDevice|No CUDA GPUs are available|Failed to initialize NVML|"
        r"driver version is insufficient for CUDA runtime|unsupported display driver / cuda driver "
        r"combination"
        r"|API mismatch: the client has the version"
        r"|installed in this system is not supported"
        r"|No NVIDIA GPU found|no ROCm-capable device is detected"
        r"|^\s*No devices were found\s*$"
        r"|cudaErrorDevicesUnavailable"
        r"|Unexpected error from cudaGetDeviceCount"
        r"|GPU does not have the necessary power cables"
        r"|nvml error: driver not loaded"
        r"|cudaErrorInsufficientDriver"
        r"|CUDA_ERROR_NOT_INITIALIZED"
        r"|\bprobe with driver nvidia failed with error"
        r"|NVRM: No NVIDIA (?:graphics adapter|devices?) probed",
        "ignore_case": True,
        "doc": "the node's driver cannot serve CUDA (missing, mismatched, too old, or no usable GPU; the "
        "kernel's probe of the GPU failed)",
    },
    {
        "name": "fabric_manager_down",
        "status": "gpu_driver_error",
        "pattern": r"Fabric ?Manager (?:is )?not running|nvidia-fabricmanager\S* .*\bfail|"
        r"cudaErrorSystemNotReady|system not yet initialized|CUDA_ERROR_SYSTEM_NOT_READY"
        r"|\bcuda[A-Z]\w* returned 802\b",  # the CUDA samples' report of the same error
        "ignore_case": True,
        "doc": "NVSwitch systems: without the fabric manager CUDA reports 'system not yet initialized' (802)",
    },
    {
        "name": "gpu_overheat_line",
        "status": "gpu_driver_error",
        "pattern": r"\bGPU \S* ?(?:is )?over ?(?:heat(?:ing|ed)?|temperature)\b|thermal (?:shutdown|"
        r"violation)|"
        r"HW Thermal Slowdown\s*: Active|HW Slowdown\s*: Active",
        "ignore_case": True,
        "doc": "the GPU overheats: it throttles, then shuts down (the line form of gpu_overheat)",
    },
    {
        "name": "nvrm_assert",
        "status": "gpu_driver_error",
        "pattern": r"NVRM: nvAssert\w*Failed|NVRM: .*Assertion failed|\bGPU \S+ (?:is )?broken\b",
        "doc": "the NVIDIA driver's own consistency check failed, or a GPU tool reports the GPU broken",
    },
    {
        "name": "pcie_fatal",
        "status": "gpu_driver_error",
        "pattern": r"AER: Uncorrected \((?:Fatal|Non-Fatal)\) error|PCIe Bus Error: severity=Uncorrected",
        "ignore_case": True,
        "doc": "an uncorrectable PCIe error on the node (GPU or NIC link): the device may be lost",
    },
    {
        "name": "iommu_dma_fault",
        "status": "invalid_dma_mapping",
        "pattern": r"DMAR: \[DMA (?:Read|Write)|DMAR: DRHD: handling fault|dmar_fault|"
        r"AMD-Vi: Event logged \[(?:IO_PAGE_FAULT|(?:DEV|PAGE)_TAB_HARDWARE_ERROR|COMMAND_HARDWARE_ERROR|"
        r"ILLEGAL_COMMAND_ERROR|IOTLB_INV_TIMEOUT)|"
        r"IO_PAGE_FAULT|DMA mapping error|dma_map\w* failed|"
        r"invalid DMA mapping|IOMMU (?:page )?fault|\bsmmu\w*: .*\b(?:fault|event 0x)"
        r"|\[fault reason \w+\]"
        r"|\[VT-D\]DMAR:\s*\[DMA (?:Read|Write)\] Request device \[[\da-f:.]+\] fault addr",  # Xen's
        "ignore_case": True,
        "doc": "the IOMMU rejected a device DMA: a bad mapping between GPU/NIC and host memory",
    },
    {
        "name": "sxid_nonfatal",
        "status": "nvlink_error",
        "severity": "SEV3",
        "pattern": r"\bSXid\b.*\bNon-?fatal\b",
        "ignore_case": True,
        "doc": "an NVSwitch error (SXid) the switch driver marks non-fatal (Fabric Manager User Guide, SXid "
        "errors): the fabric keeps working",
    },
    {
        "name": "nvswitch_fatal",
        "status": "nvlink_error",
        "pattern": r"\bSXid\b|NVSwitch fatal error|detected NVSwitch (?:fatal|non-fatal) error",
        "ignore_case": True,
        "doc": "an NVSwitch error (SXid) or Fabric Manager's 'detected NVSwitch fatal error': the "
        "NVLink fabric "
        "of the node is degraded",
    },
    {
        "name": "nvlink_counter",
        "status": "nvlink_error",
        "severity": "SEV3",
        "pattern": r"^\s*Link \d+: (?:\w+ )*(?:CRC|Replay|Recovery)\w* Errors?: [1-9]",
        "ignore_case": True,
        "doc": "nvidia-smi nvlink error counters: CRC, replay and recovery errors are corrected by the link "
        "layer (retransmission), so a non-zero count alone is recorded, not acted on",
    },
    {
        "name": "nvrm_nvlink_failure",
        "status": "nvlink_error",
        "pattern": r"NVRM: \w*nvlink\w*.*\b(?:fail\w*|errors?|fatal|timeout|timed out)\b",
        "ignore_case": True,
        "doc": "the driver's NVLink code reports a failure (e.g. 'knvlinkDiscoverPostRxDetLinks_GH100: "
        "Getting peer0's postRxDetLinkMask failed!')",
    },
    {
        "name": "nvlink_failure",
        "status": "nvlink_error",
        "pattern": r"NVLink\b.*\b(?:errors?|fail\w*|fatal|down|inactive|fault)\b",
        "ignore_case": True,
        "doc": "an NVLink link or error report (zero counts and healthy reports are vetoed above)",
    },
    {
        "name": "drm_gpu_fault",
        "status": "gpu_driver_error",
        "pattern": r"\b(?:nouveau|amdgpu)(?:\b|_job_timedout\]).*(?:\bmmu (?:page )?fault\b|"
        r"\bchannel \d+ killed\b|\b[Rr]ing [\w.]+ (?:timeout|test failed|reset failed)\b|\bGPU reset begin\b"
        r"|\bGPU HANG\b"
        r"|\bIB test failed on (?:gfx|comp|sdma|kiq)\w*"  # a compute/graphics/DMA ring, not a video engine
        # the power-management firmware (SMU/SMC) silent; an IP block that fails its init (not a
        # firmware load's status, which amdgpu only warns of: optional TAs fail it on working GPUs)
        r"|\bSMU: No response msg_reg: |\bFailed to setup smc hw\b"
        r"|\bhw_init of IP block <\w+> failed -\d+|\bamdgpu_device_ip_init failed\b"
        r"|\bMES(?:\(\d+\))? failed to respon(?:d to|se) msg=|\bsuspend of IP block <\w+> failed"
        r"|\bFatal error during GPU init\b|\bamdgpu_discovery_init failed\b"
        r"|: probe (?:of \S+|with driver amdgpu) failed with error -\d+"
        r"|\b(?:MES|cp) might be in (?:an? )?unrecoverable state\b"
        r"|\[Hardware [Ee]rror\]:? Accelerator Check Architecture)"
        r"|^HW Exception by GPU node-\d+ .*reason ?:\s*GPU Hang"  # ROCm's runtime
        # (FreeBSD's drm-kmod, or amdgpu built into the kernel: no 'amdgpu' on the line)
        # (not msg=MISC: kernel 6.10's regression printed it in bursts on working GPUs)
        r"|\bmes_v\d+_\d+_\w+\](?:\s+\*ERROR\*)?\s+MES failed to respon(?:d to|se) msg=(?!MISC\b)"
        # the firmware scheduler failing a queue operation (not its register waits, which a firmware
        # bug fails after resume, nor its bookkeeping: a doorbell, a pasid lock, a buffer)
        r"|\[drm:amdgpu_mes_\w+ \[amdgpu\]\] \*ERROR\* failed to (?:add hardware queue"
        r"|remove hardware queue|unmap legacy queue|map legacy queue|suspend all gangs|resume all gangs"
        r"|add ring)\b",
        # amdgpu's soft recovery of a ring timeout worked, or its reset did: the GPU runs on
        "unless": r"\bbut soft recovered\b|\breset succeeded\b",
        "doc": "a compute GPU's kernel driver other than NVIDIA's (nouveau, amdgpu) reporting an MMU "
        "fault (nouveau), a killed channel, a ring timeout or a ring that fails its test in a reset, a "
        "reset, a firmware scheduler (MES) or command processor that stopped answering or a hardware "
        "error (ROCm's runtime: a GPU hang) (not a display or mobile GPU's: a host's integrated graphics "
        "is no reason to drain it)",
    },
    {
        "name": "gpu_reset_lost_memory",
        "status": "gpu_driver_error",
        "severity": "SEV2",
        "pattern": r"\bVRAM is lost due to GPU reset\b",
        "doc": "amdgpu's reset lost the GPU's memory: every process on it must restart (SEV2); the reset's "
        "cause (a ring timeout, a hang) is drm_gpu_fault's line, and a reset that succeeds prints this too",
    },
    {
        "name": "nvrm_failure",
        "status": "gpu_driver_error",
        "pattern": r"NVRM: .*\b(?:fail(?:ed|ure)?|error|timed out|timeout|Check failed)\b",
        "ignore_case": True,
        "generic": True,
        "doc": "the NVIDIA kernel driver reports a failure that no specific rule names",
    },
    # 4. CUDA errors in the process
    {
        "name": "amdgpu_vm_fault",
        "status": "illegal_memory_access",
        "pattern": r"\bamdgpu\b.*(?:\[(?:gfx|mm)hub\d*\] (?:[\w-]+ )?page fault\b|VM_L2_PROTECTION_FAULT)"
        # the fault report's second line, naming the faulting process (the driver's own VM names none)
        r"|\bamdgpu:\s+for process \S+ pid [1-9]\d* thread \S+ pid [1-9]\d*\)"
        r"|^Memory access fault by GPU node-\d+"  # ROCm's runtime, as the process aborts
        r"|\bHSA_STATUS_ERROR_MEMORY_(?:APERTURE_VIOLATION|FAULT)\b",
        "doc": "a GPU page fault of one process's address space (amdgpu logs the vmid/pasid of the faulting "
        "queue; ROCm's runtime aborts that process): AMD's counterpart of Xid 31, the application's "
        "bad access, the GPU stays usable",
    },
    {
        "name": "cuda_illegal_address",
        "status": "illegal_memory_access",
        "pattern": r"illegal memory access|CUDA_ERROR_ILLEGAL_ADDRESS|cudaErrorIllegalAddress|"
        r"misaligned address"
        r"|Warp (?:Illegal|Out-of-range|Misaligned) Address|Warp Misaligned Register"
        r"|\bIllegal address in (?:cu[A-Z]\w*|CUDA)\b"
        r"|\bCuError\(code=700\b"  # CUDA.jl's error object: 700 is CUDA_ERROR_ILLEGAL_ADDRESS
        # the same code as other programs print it
        r"|\breturned error 700\b|\bCUDA error \(700\)|\berror code \(700\)"
        r"|\bCheck failed: \w+ == (?:cuda|hip)Success \(700 vs\. 0\)"
        # cuda-memcheck's and compute-sanitizer's report of a bad access ('Address 0x10a8 is misaligned')
        r"|^=+\s+Address 0x[0-9a-f]+ is (?:misaligned|out of bounds)"
        r"|^=+\s+Misaligned shared or local address"
        r"|^=+\s+Invalid __(?:global|shared|local)__ (?:read|write|atomic)",
        "ignore_case": True,
    },
    {
        "name": "cuda_out_of_memory",
        "status": "other_software_error",
        "pattern": r"CUDA out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|"
        r"CUBLAS_STATUS_ALLOC_FAILED|CUDA(?:RT| driver)? [Ee]rror: out of memory|"
        r"Cuda failure '?out of memory|"
        r"\bOut of memory error on GPU \d+\. Cannot allocate\b|"  # PaddlePaddle's
        r"Failed to CUDA calloc|^GPUassert: out of memory\b"
        r"|\bFailed during cuda\w+: out of memory\b|\bHSA_STATUS_ERROR_OUT_OF_RESOURCES\b"
        r"|\bHIP error: out of memory\b|\bhipErrorOutOfMemory\b"
        r"|\b(?:Resource exhausted|RESOURCE_EXHAUSTED): "
        r"(?:Failed to allocate request for|Out of memory while trying to allocate"
        r"|Attempting to reserve \S+ at the bottom of memory"
        # XLA on a TPU's HBM
        r"|(?:Error (?:allocating device buffer|loading program[^:]*): )?"
        r"Attempting to allocate \S+\. That was not possible\.)"
        r"|\bCheck failed: \w+ == (?:cuda|hip)Success \(2 vs\. 0\)"
        r"|\bOOM when allocating tensor with shape\[",  # TensorFlow's allocator
        # Ray's memory monitor: host memory, a process it killed (host_oom_kill); XLA's autotuner
        # trying an algorithm that does not fit, then another (training goes on)
        "unless": r"\bray\.exceptions\.OutOfMemoryError\b"
        r"|\bProfiling failure on\b|\bconvolution algorithm\b|\bperformance may be suboptimal\b",
        "doc": "the job asked for more GPU memory than exists: a configuration problem, the node is fine",
    },
    {
        "name": "cuda_launch_failure",
        "status": "cuda_error",
        "pattern": r"unspecified launch failure|cudaErrorLaunchFailure|CUDA_ERROR_LAUNCH_FAILED",
        "ignore_case": True,
    },
    {
        "name": "cuda_device_assert",
        "status": "cuda_error",
        "pattern": r"device-side assert triggered"
        r"|\.cu:\d+: .{1,300}?: block: \[\d+"
        r"|\.cu:\d+: block: \[\d+,\d+,\d+\], thread: \[\d+,\d+,\d+\] Assertion"
        r"|cudaErrorAssert",
    },
    {
        "name": "nccl_cuda_failure",
        "status": "cuda_error",
        "pattern": r"Cuda failure \d*\s*'|NCCL WARN Cuda failure|ncclUnhandledCudaError|unhandled cuda error",
        "ignore_case": True,
    },
    {
        "name": "cuda_runtime_failure",
        "status": "cuda_error",
        # the CUDA runtime's error as a library raises it ('RuntimeError: CUDART error: ...': the
        # exception's own name must not make it a user's error); TensorFlow's words for a cuDNN
        # that could not start
        "pattern": r"\bCUDART error: "
        # ROCm's runtime error as raised (PyTorch's 'torch.AcceleratorError: HIP error: ...'), not a help
        # text or a status echo
        r"|(?:^\s*|\b\w*(?:Error|Exception): |what\(\):\s+)HIP error: "
        r"(?!hipSuccess\b|no error\b|hipErrorNotReady\b)"
        # (2, 214 and 700: out of memory, an uncorrectable ECC error, an illegal address, read by those rules)
        r"|\bCheck failed: \w+ == (?:hip|cuda)Success\b(?! \((?:2|214|700) vs\. 0\))"
        r"|\bFailed to get convolution algorithm\. This is probably because cuDNN failed to initialize\b",
    },
    {
        "name": "cuda_error",
        "status": "cuda_error",
        "pattern": r"CUDA error\b|CUDA_ERROR_\w+|cudaError\w+|cuda runtime error|CUDNN_STATUS_(?!SUCCESS)\w+|"
        r"CUBLAS_STATUS_(?!SUCCESS)\w+|cuDNN error"
        r"|CUDA driver error"
        r"|CUDA call failed"
        r"|NVML_SUCCESS == .* INTERNAL ASSERT FAILED"
        r"|instance of 'c10::CUDAError'"
        r"|Error \[CUDA\]"
        r"|CUDA Exception"
        r"|DeferredCudaCallError"
        r"|nvrtc: error|NVRTC_ERROR"
        r"|\bcuda[A-Z]\w*(?:\(\))? failed"
        r"|^!!!! kernel execution error\."
        r"|^GPUassert: |\bTHCudaCheck FAIL\b"  # the usual CUDA check macro, legacy PyTorch's
        r"|Exception raised from create\w*Handle\b"  # c10's context line: a handle pool's CUDA call failed
        r"|Failed to (?:create CUDA context|load CUDA kernel)\b"
        r"|\bFailed to create cu(?:solver|blas|dnn|sparse|fft|rand)\w*(?: dn)? handle\b"  # MindSpore's
        r"|\bFailed during cuda[A-Z]\w*: "  # a GPU test's report of a failed CUDA call
        r"|\bHSA_STATUS_ERROR_\w+"  # ROCm's runtime: the HIP counterpart of a CUDA error
        # glog's FATAL line from a CUDA source file (TensorFlow's stream executor), which aborts
        r"|^(?:\d+: |\d{4}-\d\d-\d\d [\d:.]+: )?F(?:\d{4} [\d:.]+\s+\d+)? \S*cuda\w*\.cc:\d+\] ",
        "ignore_case": True,
        "generic": True,
    },
    {
        "name": "cuda_async_hint",
        "status": "cuda_error",
        "pattern": r"CUDA kernel errors might be asynchronously reported|For debugging consider "
        r"passing CUDA_LAUNCH_BLOCKING|Compile with `TORCH_USE_CUDA_DSA`",
        "generic": True,
        "doc": "the hint PyTorch prints only after a CUDA error: evidence of one, but the error line itself "
        "(a specific rule) names it",
    },
    # 5. the process and the node
    {
        "name": "slurm_node_failure",
        "status": "lost_connection",
        "pattern": r"DUE TO NODE FAILURE|Node failure on \S+|NODE_FAIL\b"
        r"|Communication connection failure"
        r"|due to failure of node \S+"
        r"|on failed node \S+"
        r"|\bjob (?:preempted|requeued|killed|aborted) \(node failure\)",
        "ignore_case": True,
        "doc": "Slurm lost a node of the job (slurmd unreachable; also a cloud scheduler's node_fail event)",
    },
    {
        "name": "memory_limit_reached",
        "status": "exited_abnormally",
        "pattern": r"Exceeded (?:step|job) memory limit at some point",
        "severity": "SEV3",
        "doc": "slurmstepd at a step's end: its memory cgroup reached the limit at some point (page cache "
        "counts), which the kernel may have met by reclaiming or swapping: steps that finished well print "
        "it too. SEV3: a task the OOM killer ended has its own line ('oom_kill event') and its exit",
    },
    {
        "name": "host_oom_kill",
        "status": "exited_abnormally",
        "pattern": r"Out of memory: Kill(?:ed)? process|invoked oom-killer|\boom-kill:|oom_reaper: reaped|"
        r"Memory cgroup out of memory|Detected \d+ oom[-_]kill event"
        r"|\bTask in /\S+ killed as a result of limit of /"
        r"|Exceeded (?:step|job) memory limit(?! at some point)"
        r"|\bKilled process \d+ \([^)]*\),? (?:UID \d+, )?total-vm:"
        r"|\b[1-9]\d* Workers? \(tasks / actors\) killed due to memory pressure \(OOM\)"
        r"|\bTask was killed due to the node running low on memory\b|\bRay killed this worker \(ID: "
        r"|\bcontainer init was OOM-killed\b"  # runc, through the kubelet
        r"|\bRefer to the documentation on how to address the out of memory issue: https://docs\.ray\.io/",
        "doc": "the kernel's OOM killer (host memory) killed a process",
    },
    {
        "name": "segfault",
        "status": "exited_abnormally",
        "pattern": r"Segmentation fault|segmentation fault (?:encountered|\(core dumped\))|SIGSEGV|"
        r"^!+ Segfault encountered !+\s*$|"
        r"segfault at [0-9a-f]+",
    },
    {
        "name": "bus_error",
        "status": "exited_abnormally",
        "pattern": r"\bBus error\b|SIGBUS",
        "ignore_case": True,
    },
    {
        "name": "process_aborted",
        "status": "exited_abnormally",
        # glibc's heap checks abort the process with these words (malloc_printerr)
        "pattern": r"^(?:free|munmap_chunk|malloc|realloc|malloc_consolidate|_int_free|_int_malloc)\(\): "
        r"(?:invalid|corrupted|double free|unaligned|memory corruption)"
        r"|^double free or corruption\b|^corrupted size vs\. prev_size\b"
        # glog's and folly's fatal-signal handlers
        r"|^\*\*\* Aborted at \d+ \(unix time\)|\bSIG(?:ABRT|SEGV|BUS|ILL|FPE)\(\d+\), PID: \d+"
        r"|(?:^|\] )\*\*\* SIG(?:ABRT|SEGV|BUS|ILL|FPE) \(@0x[0-9a-f]+\) received by PID \d+"
        # absl's FailureSignalHandler; the coredump hook a fatal signal runs
        r"|^\*\*\* SIG(?:ABRT|SEGV|BUS|ILL|FPE) received by PID \d+ \(TID \d+\)"
        r"|\bcoredump_hook\.cc:\d+\] RAW: Skipping coredump\b"
        # glibc before 2.26 named the program: "*** Error in `python': double free or corruption"
        r"|^\*\*\* Error in `[^`']*': "
        r"(?:double free|free\(\)|malloc\(\)|realloc\(\)|munmap_chunk\(\)|corrupted)"
        r"|^Command terminated by signal (?!(?:1|2|15)\b)\d+"  # GNU time; HUP, INT, TERM: a stop
        r"|^Aborted \(Signal sent by tkill\(\)"  # the shell's report of a raise(SIGABRT)
        # Go's runtime (and programs that mimic it) naming the fatal signal
        r"|^SIG(?:ABRT|SEGV|BUS|ILL|FPE): (?:abort\b|segmentation violation\b|bus error\b"
        r"|illegal instruction\b|floating-point exception\b)"
        # systemd's for a service: killed by a signal other than a stop, or by the OOM killer
        r"|\b[Mm]ain process exited, code=(?:killed|dumped), status=\d+/(?!TERM\b|INT\b|HUP\b)[A-Z]+"
        r"|\.service: Failed with result '(?:oom-kill|core-dump|signal)'"
        r"|\bsystemd-coredump\[\d+\]: Process \d+ \(.*\) of user \d+ "
        r"(?:terminated abnormally with signal (?!(?:1|2|3|15)/)\d+|dumped core)"
        r"|\bsystemd\[1\]: Caught <(?:BUS|SEGV|ABRT|ILL|FPE)>"
        r"|^Signal Received: \d+ \((?:Aborted|Bus error|Segmentation fault|Floating point exception"
        r"|Illegal instruction)\)\s*$"
        # MPICH/Hydra's BAD TERMINATION banner (signals other than a stop)
        r"|\bYOUR APPLICATION TERMINATED WITH THE EXIT STRING: (?!Terminated\b|Hangup\b|Interrupt\b)\w"
        r"|^=+\s+KILLED BY SIGNAL: (?!(?:1|2|15)\b)\d+"
        r"|^memory allocation of \d+ bytes failed\s*$",  # Rust's allocator, as it aborts
        "doc": "a process aborted by the C library (heap corruption) or a fatal signal as glog, folly, "
        "absl, GNU time, systemd or MPICH report it",
    },
    {
        "name": "launcher_process_exit",
        "status": "exited_abnormally",
        "pattern": r"\bABORT!!! Out of all \d+ trainers\b"  # PaddlePaddle's launcher
        r"|\bProcess \d+ exit with status code [1-9]\d*"  # Horovod's
        r"|\bprocess \d+ exit with exception\b"  # MindSpore's
        r"|\bExecuteUserScriptError\b"  # SageMaker: the user's script exited non-zero
        r"|\bWorker proc \S+ died unexpectedly\b"  # vLLM's multiprocessing executor
        r"|Executor got fatal signal from worker processes\b"
        r"|\bterminated with an error exit status \([1-9]\d*\)"  # Nextflow's
        r"|\bThe exit status of the task that caused the workflow execution to fail was: [1-9]"
        r"|\brunning the test CRASHED with signal (?:4|6|7|8|9|11)\b"  # pytest-forked
        r"|^LAUNCH INFO [\d-]+ [\d:,]+ Pod failed\s*$"  # PaddlePaddle's launcher
        # Kubeflow's training operator
        r"|\b(?:TF|PyTorch|MPI|XGBoost|Paddle|MX|JAX)Job \S+ has failed because \d+ \w+ replica\(s\) failed\b"
        # dramatiq's (and its kind's) supervisor: a worker killed, not stopped (-15, -2, -1)
        r"|\bWorker with PID \d+ exited unexpectedly \(code (?!-(?:1|2|15)\))-?[1-9]\d*\)",
        "unless": r"-- (?:Execution is retried|Error is ignored)\b",  # Nextflow goes on
        "secondary": True,
        "doc": "a launcher reporting that a worker it started exited with an error",
    },
    {
        "name": "mpi_bad_termination",
        "status": "exited_abnormally",
        "pattern": r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES|^=+\s+EXIT CODE: [1-9]\d*"
        r"|systemd-coredump\[\d+\]: .*\bdumped core\b",
        "doc": "MPICH/Intel MPI's banner for a rank that died (and its exit-code line), or systemd's "
        "core dump record of a crashed process",
    },
    {
        "name": "fatal_python_error",
        "status": "exited_abnormally",
        "pattern": r"Fatal Python error",
    },
    {
        "name": "process_crashed",
        "status": "exited_abnormally",
        "pattern": r"\(core dumped\)|^\s*Killed\s*$|\bline \d+:\s+\d+ (?:Killed|Aborted)|"
        r"Signal \d+ \(SIG\w+\) (?:\(0x[0-9a-f]+\) )?received by PID|terminated with signal SIG\w+|"
        r"\bFloating point exception\b|\bIllegal instruction\b(?! was encountered)|"
        r"DataLoader (?:worker|process) \(pids?\(?s?\)? ?[\d, ]+\) "
        r"(?:exited )?(?:is killed by signal|exited unexpectedly)"
        r"|\*\*\* SIG\w+ received at time"
        r"|\(interrupted by signal \d+: SIG\w+\)"
        r"|\bOOMKilled\b(?![\"']?\s*[:=]\s*[\"']?(?:false|False|FALSE)\b)"  # not docker's healthy flag
        r"|ActorDiedError|RayActorError|WorkerCrashedError|The actor died unexpectedly"
        r"|\bA worker process managed by the executor was unexpectedly terminated\b"  # joblib/loky
        r"|\bCrashLoopBackOff\b"  # Kubernetes: the container keeps dying
        # Kubernetes evicting the pod (kubectl describe): the kubelet killed it for the node's pressure
        r"|^\s*Reason:\s+Evicted\s*$|^\s*(?:Message:\s+)?The node was low on resource: \w[\w-]*\.?"
        r"|\bjob exceeded wallclock limit\b"  # Moab/Torque killed the job at its time limit
        # LSF's time-limit kill, and the subject of its job report
        # (not a stop: the owner's or an administrator's kill, a requeue, a preemption, a checkpoint)
        r"|\bTERM_(?!(?:FORCE_)?(?:OWNER|ADMIN)\b|REQUEUE_|PREEMPT\b|CHKPNT\b|WINDOW\b|BUCKET_KILL\b"
        r"|MC_RECALL\b|OTHER\b)[A-Z_]+: job killed\b"
        r"|^Subject: Job \d+(?:\[\d+\])?: <[^>]*> in cluster <[^>]*> Exited\s*$"
        r"|\bThe exit codes of the workers are \{[^}]*\bSIG(?:KILL|SEGV|ABRT|BUS|ILL|FPE)\b"  # joblib/loky
        r"|\bterminated with signal (?:4|6|7|8|11)\b"
        r"|^\[\d+\]\s+\d+ killed|^\[\d+\]\s+\d+ abort"
        r"|^\s*Aborted\s*$"
        r"|exited on signal \d+"
        r"|returned\s+a non-zero exit code"
        r"|exited with non-zero status"
        r"|Worker group FAILED"
        r"|\*\*\* Process received signal \*\*\*|\] Failing at address: (?:0x[0-9a-f]+|\(nil\))"
        r"|\] Signal code: .*\(-?\d+\)$"
        r"|\] Signal: (?:Aborted|Bus error|Illegal instruction|Floating point exception) \(\d+\)$"  # Open MPI
        # the shell's report, in glibc's zh_CN words, or after a progress bar that ended no line
        r"|^\s*已杀死\s*$|(?<=[\]|])Killed\s*$"
        r"|Per user-direction, the job has been aborted"
        r"|^Core was generated by `"  # gdb's header of a core file a crashed process left
        r"|(?:^|\]:\s?)-- Process \d+ terminated with the following error",
        "doc": "a process died of a signal (the shell's 'Killed' / '(core dumped)', torch.multiprocessing's "
        "'terminated with signal', torchelastic's 'Signal 9 (SIGKILL) received by PID')",
    },
    {
        "name": "ray_worker_died",
        "status": "exited_abnormally",
        "pattern": r"\bWorker exit type: SYSTEM_ERROR\b",
        "unless": r"\bWARNING\b",
        "doc": "Ray: a worker process died (SYSTEM_ERROR: not the user's exception); at WARNING level Ray "
        "retries the task (ray-project/ray#40229), no failure yet",
    },
    {
        "name": "torchelastic_worker_failed",
        "status": "exited_abnormally",
        "pattern": r"failed \(exitcode: -?\d+\) local_rank: \d+|ChildFailedError|"
        r"process \d+ terminated with exit code [1-9]|SignalException: Process \d+ got signal"
        r'|"name": "torchelastic\.worker\.status\.FAILED"'
        r"|(?:^|[:\]] ?)\[\w+\] Worker group failed\s*$",  # the elastic agent's ERROR log
        "secondary": True,
        "doc": "torchrun reporting a worker's death; the worker's own output says why",
    },
    {
        "name": "torchelastic_summary",
        "status": "exited_abnormally",
        # anchored at the start: cheap on every line, so no prefilter needed
        "pattern": r"^\s*(?:Root Cause \(first observed failure\)|<NO_OTHER_FAILURES>|\S+\.py FAILED\s*$|"
        r"Failures:\s*$|(?:time|host|rank)\s{2,}: \S|(?:exitcode|error_file|traceback)\s*: )",
        "secondary": True,
        "doc": "a line of torchrun's failure summary ('Root Cause', 'exitcode  : -9 (pid: 123)', 'host', "
        "'rank', 'error_file', 'traceback : Signal 9 (SIGKILL) received by PID 123'); printed only when "
        "a worker failed",
    },
    {
        "name": "mpi_daemon_lost",
        "status": "lost_connection",
        "pattern": r"ORTE has lost communication with (?:its|a remote) daemon",
        "secondary": True,
        "doc": "Open MPI's launcher lost the daemon of another node (the next lines name it): a node of "
        "the job is gone, but this line is printed elsewhere, so it is secondary",
    },
    {
        "name": "launcher_ssh_unreachable",
        "status": "other_network_error",
        "pattern": r"\bwas not reachable via ssh\b"
        r"|Command '\[?'ssh [^']*'\]?' returned non-zero exit status 255\b"
        r"|Command 'ssh [^']*' returned non-zero exit status 255\b"
        r"|Command '\['ssh',[^\]]*\]' returned non-zero exit status 255\b",
        "doc": "a launcher (DeepSpeed's runner, a hostfile check) could not reach a host over ssh "
        "(ssh exits 255 for its own failures): a network or configuration error before training",
    },
    {
        "name": "launcher_child_failed",
        "status": "exited_abnormally",
        "pattern": r"exits with return code = -?\d+|returned non-zero exit status -?\d+|"
        r"died with <Signals\.SIG\w+|exited with (?:exit )?code (?:[1-9]\d*|-(?:4|6|7|8|11)\b)"
        r"|ssh exited with exit code"
        r"|Received \S+ death signal"
        r"|\bexit (?:code|status)\s*[:=]?\s*(?:[1-9]\d*|-\d+|0x0*[1-9a-f][0-9a-f]*)\b"
        # FfDL's learner (not a stop: 128 + HUP, INT, TERM)
        r"|\b(?:Training process finished\. Exit code|learner_exit_code): (?!(?:129|130|143)\b)[1-9]\d*\b"
        r"|\berror code -(?:4|6|7|8|9|11)\b"
        # PaddlePaddle's launcher (paddle.distributed.launch)
        r"|\bLAUNCH ERROR .*\bContainer failed\b|^\s*Container rank \d+ status failed cmd \["
        r"|\bCHILD PROCESS FAILED WITH NO ERROR_FILE\b"  # torchelastic's record of a failed child
        # Kubernetes' container status (kubectl describe): 128 + a signal other than a stop
        # (137, SIGKILL, is also a stop whose grace period ran out)
        r"|^\s*Exit Code:\s+13[2-69]\s*$",
        "secondary": True,
        "doc": "a launcher reporting that a worker exited with an error (DeepSpeed 'exits with return code "
        "= -9', Accelerate's CalledProcessError 'returned non-zero exit status 1', pdsh)",
    },
    {
        "name": "slurm_task_failed",
        "status": "exited_abnormally",
        "pattern": r"srun: error: \S+: tasks? [\d\-,\[\]]+: (?!Exited with exit code 0\b)|"
        r"slurmstepd: error: \*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT"
        r"|\] error: \*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT \S+ DUE TO"
        r"|slurmstepd: \*\*\* (?:STEP|JOB) \S+ CANCELLED AT \S+ DUE TO TIME LIMIT"
        r"|\*\*\* (?:STEP|JOB) \S+ STEPD TERMINATED ON \S+ AT \S+ DUE TO JOB NOT ENDING"
        r"|_job_complete: JobId=\d+ WTERMSIG \d+"
        r"|_job_complete: JobId=\d+ WEXITSTATUS [1-9]",
        "doc": "srun reporting a task that died ('task 11: Killed', 'Out Of Memory', 'Exited with exit code "
        "1'), or slurmstepd cancelling a step with an error (node failures are matched above)",
    },
    {
        "name": "slurm_node_not_responding",
        "status": "lost_connection",
        "pattern": r"\bNodes? \S+ not responding\b|update_node: node \S+ (?:reason set to|state set to "
        r"(?:DOWN|DRAIN|FAIL))"
        r"|\sdown\*\s.*\sNot responding\s*$",
        "ignore_case": True,
        "doc": "slurmctld lost contact with a node, or took it out of service (update_node: reason set to)",
    },
    {
        "name": "kernel_hung_task",
        "status": "task_hang",
        "pattern": r"task \S+ blocked for more than \d+ seconds|soft lockup - CPU#\d+ stuck|"
        r"self-detected stall on CPU|detected stalls on CPUs",
        "doc": "the kernel saw a task stuck in uninterruptible sleep (often a process waiting on a hung GPU)",
    },
    {
        "name": "slurm_execve_failed",
        "status": "other_software_error",
        "pattern": r"^\s*slurmstepd(?:-\S+)?: error: execve\(\): .*(?:No such file or directory|Permission "
        r"denied|Exec format error)",
        "doc": "the job's own program could not be started (a wrong path, no execute permission, a script "
        "without its interpreter): the user's error, not the node's (an I/O error is left to slurm_error)",
    },
    {
        "name": "cluster_service_unreachable",
        "status": "other_network_error",
        # a provider's completion error to a peer
        "pattern": r"\blibfabric:\d+:\d+::\w+:\w+:\w*(?:handle_error|write_[rt]x_error)\(\)"
        r"|\bnfs: server \S+ not responding\b"
        r"|\bDNS SRV lookup failed\b|\bres_nsearch error\b"  # Slurm's configless lookup of slurmctld
        r"|\bFailed to (?:connect to|get cluster ID from) GCS\b|\bUnable to connect to GCS at\b"
        r"|\bCouldn't reconnect to GCS server\b"  # Ray's head
        r"|Connect failed with error: \w*CONNECTION_FAILED\b",  # PCCL\'s pcclConnect
        "doc": "a service the job needs is unreachable over the network: a libfabric provider's failed "
        "completion to a peer (EFA), the NFS server, Slurm's controller by DNS, Ray's head (GCS), a "
        "collective library's master. SEV3: it waits in place, an exit says more",
    },
    {
        "name": "container_start_failed",
        "status": "other_software_error",
        "pattern": r"\berror: pyxis: |\bpyxis: +(?:\[ERROR\] |\S+: (?:failed|cannot|couldn't)\b)"
        r"|\benroot-\w+: failed to |^\s*pyxis: error: |/enroot: line \d+: (?!warning: )"
        r"|^\s*FATAL:\s+(?:container creation failed: "
        r"|while extracting \S+: root filesystem extraction failed)"
        r"|^ERROR\s+: Failed to create user namespace\b"  # Apptainer/Singularity
        r"|^docker: Error response from daemon: "
        r"|\bspank: required plugin spank_pyxis\.so: \w+\(\) failed\b"  # pyxis, the container plugin
        # Docker without the NVIDIA container toolkit; 'docker start' refusing
        r"|^Error response from daemon: could not select device driver \S* with capabilities: "
        r"|^Error: failed to start containers: ",
        "doc": "the job's container could not be created or started (pyxis/enroot under Slurm, Apptainer): "
        "an image, mount or permission problem of the job's setup, not the node's hardware; SEV2, and "
        "the ladder stops the task when a restart meets the same error",
    },
    {
        "name": "slurm_request_invalid",
        "status": "other_software_error",
        "pattern": r"^\s*(?:srun|sbatch|salloc): fatal: "
        # sbatch, srun or salloc refusing the request itself (not the controller being unreachable)
        r"|^\s*(?:sbatch: error: Batch job submission failed"
        r"|(?:srun|salloc): error: Unable to allocate resources): "
        r"(?:Requested time limit is invalid"
        r"|Invalid (?:account|partition|qos|generic resource|feature|wckey)"
        r"|Requested node configuration is not available|Job violates accounting/QOS policy"
        r"|Node count specification invalid|More processors requested than permitted"
        r"|Memory required by task is not available|Invalid job array specification)"
        r"|\bUnable to create step for job \d+: (?:Invalid (?!job id)"
        r"|Requested node configuration is not available"
        r"|More processors requested than permitted|Memory required by task is not available)"
        r"|^\s*srun: error: (?:Application launch failed: Unable to layout tasks on given cpus"
        r"|JobId=\d+ failed to distribute tasks\b)",
        "doc": "Slurm refusing the job's own request (srun's fatal option errors, a step asking for a GRES "
        "or memory that does not exist): the user's error",
    },
    {
        "name": "slurm_prolog_failed",
        "status": "other_software_error",
        "pattern": r"^\s*(?:salloc|srun|sbatch): Prolog failure on node \S+",
        "doc": "the site's prolog failed on a node of the allocation: Slurm drains that node itself, the job "
        "does not start there (SEV2: unicorn does not drain it a second time)",
    },
    {
        "name": "slurm_error",
        "status": "exited_abnormally",
        "pattern": r"^\s*(?:srun|slurmstepd(?:-\S+)?|salloc|sbatch): error: "
        r"|\berror: spank: required plugin \S+: \w+\(\) failed\b",  # slurmstepd's own log
        # slurmstepd's chdir fallback (the step runs on), and proctrack's race with a process
        # that just ended (it reads /proc of each pid it tracks)
        "unless": r": going to \S+ instead\b|_is_a_lwp: open\(\) /proc/\d+/status failed"
        r"|\bdefaulting to\b",  # sbatch's 'No account specified, defaulting to: cse'
        "generic": True,
        "doc": "Slurm reporting an error that no specific rule names",
    },
    {
        "name": "ray_peer_marked_dead",
        "status": "lost_connection",
        "severity": "SEV3",
        "pattern": r"\bmarked (?:as )?dead because .*\bmissed too many heartbeats"
        r"|\bThe actor is dead because its owner has died\b.*\bOwner's node has crashed\b",
        "secondary": True,
        "doc": "Ray's head declared a node dead after missing its heartbeats: a node of the job may be "
        "lost, but the line names another node than the one that printed it and is Ray's opinion "
        "(lagging heartbeats of a live node read the same), so it is secondary and SEV3: it waits in "
        "place; unicorn's own heartbeats are the first-hand evidence",
    },
    {
        "name": "raylet_died",
        "status": "exited_abnormally",
        # Ray's worker finds its parent gone (getppid() == 1); newer Ray prints 'core_worker.cc:NNN: '
        "pattern": r"\bcore_worker\.cc:\d+[\]:] Raylet failed\. Shutting down\b",
        "secondary": True,
        "doc": "a Ray worker whose node's raylet died (crashed, OOM-killed, stopped): a local process's "
        "death, not the node's (the worker that says so runs there); secondary: the raylet's own end "
        "says why",
    },
    {
        "name": "ray_node_dead",
        "status": "lost_connection",
        # 'beem': Ray's own spelling
        "pattern": r"node_manager\.cc:\d+: This node has bee[nm] marked as dead"
        r"|\bthis node manager has (?:mistakenly )?been marked as dead\b",
        "secondary": True,
        "doc": "a node's own raylet ending because the head marked it dead: this node leaves the Ray "
        "cluster (secondary: why it missed its heartbeats is the cause; isolation needs out-of-band "
        "confirmation)",
    },
    {
        "name": "program_usage_error",
        "status": "other_software_error",
        "pattern": r"^\S+\.py: error: |OutOfResources: out of resource|\bBackendCompilerFailed\b"
        r"|(?:^|\) )An error occurred during the runtime of your JAX program!"  # Equinox
        r"|^Dataset does not exist: "
        # argparse's, whatever the program's name ('torchrun: error: ', or on a line of its own)
        r"|(?:^|: )error: (?:unrecognized arguments: |the following arguments are required: "
        r"|argument [-\w/]+: )"
        r"|\bmixed precision requires PyTorch >= [\d.]+ and a supported device\b"
        # XLA rejecting an executable for the device it was given (the program's, not the GPU's; not
        # FAILED_PRECONDITION, which wraps an upstream failure such as NCCL's)
        r"|\bExecution of replica \d+ failed: (?:Invalid argument|INVALID_ARGUMENT): ",
        "doc": "the program rejected its arguments (argparse), or a compiler (Triton, Inductor) failed",
    },
    {
        "name": "state_dict_mismatch",
        "status": "other_software_error",
        "pattern": r"size mismatch for \S+: copying a param|(?:Missing|Unexpected) key\(s\) in state_dict|"
        r"Error\(s\) in loading state_dict",
        "doc": "a checkpoint that does not fit the model (the lines after 'Error(s) in loading state_dict')",
    },
    {
        "name": "ray_unhandled_error",
        "status": "other_software_error",
        "pattern": r"Unhandled error \(suppress with '?RAY_IGNORE_UNHANDLED_ERRORS"
        r"|RayTaskError\b",
        "doc": "Ray reporting an exception a remote task raised and nobody retrieved",
    },
    {
        "name": "training_nan",
        "status": "nan_loss",
        "pattern": r"found (?:NaN|Inf) in (?:local )?(?:grad norm|forward loss)|\bloss is (?:nan|inf)\b|"
        r"Detected (?:NaN|Inf)\b|Unexpected result -?(?:nan|inf)\b"
        r"|unexpected result is reproducible within the tolerance \(-?(?:nan|inf)\b"
        r"|\bInvalid loss, terminating training\b",  # Keras' TerminateOnNaN
        "ignore_case": True,
        "doc": "a NaN or Inf in the training's numbers (Megatron-LM's rerun state machine: 'Unexpected "
        "result nan on rank 0 at iteration #8 ... (message='found NaN in local forward loss calculation')', "
        "then, re-run, 'iteration #8: First rerun: unexpected result is reproducible within the tolerance "
        "(nan = nan)'; its 'found NaN in local grad norm'); a training-state finding, never the node's "
        "(detect.losshealth.named_iteration reads the iteration it names)",
    },
    # 6. network and collectives
    {
        "name": "nccl_watchdog_timeout",
        "status": "nccl_timeout",
        "pattern": r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*timed out|"
        r"Timeout at NCCL work|Some NCCL operations have failed or timed out|"
        r"Exception \(either an error or timeout\) detected by watchdog|Heartbeat monitor timed out|"
        r"watchdog got stuck for \d+ seconds|collective operation timeout|"
        r"To avoid data inconsistency, we are taking the entire process down|"
        r"Stack trace of the failed collective"
        r"|ProcessGroupNCCL preparing to dump debug info"
        r"|Received a (?:global )?dump signal"
        r"|flight recorder dump signal"
        r"|First PG on this rank to signal dumping"
        r"|First PG on this rank that detected no heartbeat of its watchdog"
        r"|ran for \d+ milliseconds before timing out"
        r"|gloo/transport/\S+\] TIMEOUT\b"  # gloo's pair timing out on a peer
        r"|\bGloo [\w-]+ failed: \[\S*gloo/transport/tcp/\w+\.cc:\d+\] Read timeout\b"
        r"|failure detected by watchdog at work sequence id"
        # Ascend's HCCL: a peer did not send its data in time (EI0006, its socket timeout)
        r"|\bEI0006\)?: .*\bGetting socket times out\b"
        # HCCL's notify wait (a remote rank's record never came) and its task timeout
        r"|\bEI0002: .*\bThe wait execution of the Notify register times out\b"
        r"|\bhccl \w+ task timeout occurred during task execution\b"
        # TensorFlow aborting its collectives on a deadline (not 'Out of range: End of sequence',
        # the end of a dataset)
        r"|\bBaseCollectiveExecutor::StartAbort (?:DEADLINE_EXCEEDED|Deadline exceeded)\b"
        r"|^DeepEP\b[\w ()-]* timeout\b",  # DeepEP's expert-parallel kernels trapping on a timeout
        "doc": "the NCCL watchdog found a collective that failed or timed out, and takes the process down",
    },
    {
        "name": "gloo_timeout",
        "status": "nccl_timeout",
        "pattern": r"Timed out waiting \d+ms for \w+ operation",
        "doc": "a CPU (gloo) collective timed out: the same symptom as an NCCL timeout",
    },
    {
        "name": "terminate_dist_backend",
        "status": "nccl_timeout",
        "pattern": r"instance of 'c10::DistBackendError'",
        "generic": True,
        "secondary": True,
        "doc": "the NCCL watchdog aborting the process (usually after a timeout; the what() line says which)",
    },
    {
        "name": "nccl_comm_aborted",
        "status": "other_network_error",
        "pattern": r"NCCL communicator was aborted",
        "secondary": True,
        "doc": "the communicator was torn down after an error or timeout seen elsewhere",
    },
    {
        "name": "monitored_barrier_peer_error",
        "status": "other_network_error",
        "pattern": r"received errors while waiting for send/recv from rank \d+",
        "doc": "torch.distributed's monitored_barrier reached the barrier but its send/recv with a peer "
        "failed: the peer or the link to it, not this rank's code",
    },
    {
        "name": "nccl_remote_error",
        "status": "other_network_error",
        "pattern": r"ncclRemoteError|remote process exited or there was a network error"
        r"|\bProxy Call to rank \d+ failed\b",  # NCCL's proxy could not reach that peer
        "secondary": True,
        "doc": "a peer of the collective went away (or the network between them did)",
    },
    {
        "name": "nccl_invalid_usage",
        "status": "other_software_error",
        "pattern": r"ncclInvalidUsage|ncclInvalidArgument|invalid usage, NCCL version"
        r"|NCCL Error 5\b",
    },
    {
        "name": "nccl_peer_closed",
        "status": "other_network_error",
        "pattern": r"(?:NCCL|\.h:\d+) WARN .*Connection closed by remote peer",
        "doc": "NCCL's socket to a peer was closed by the other side: the peer (or the network) went "
        "away; a network failure of NCCL's own, not a reset that the caller retries",
    },
    {
        "name": "connection_reset",
        "status": "connection_refused_reset",
        "pattern": r"Connection reset by (?:remote )?peer|ECONNRESET|Broken pipe|\bEPIPE\b|"
        r"Connection closed by (?:remote )?peer",
        "ignore_case": True,
    },
    {
        "name": "connection_refused",
        "status": "connection_refused_reset",
        "pattern": r"Connection refused|ECONNREFUSED|errno: 111\b",
        "ignore_case": True,
    },
    {
        "name": "link_flap",
        "status": "link_flapping",
        # the drivers' own spellings, case and all: a bare "link up" is too common to mean a flap
        "pattern": r"Got async event : port error|IBV_EVENT_PORT_ERR|Link DOWN\b|Link UP\b|Link down\b|"
        r"Link ACTIVE\b|link status definitely (?:down|up)|link status up again|NIC Link is (?:Down|Up)|"
        r"[Ll]ost carrier|carrier (?:lost|off)\b|\blink is (?:down|up)\b|link state changed to (?:UP|DOWN)\b|"
        r"port \d+ state changed to (?:UP|DOWN|ACTIVE)\b|\bstate DOWN physical_state (?!DISABLED)|"
        r"link status down for interface|check_hw_ib:\s+No IB port (?:\S+ )?is ACTIVE"
        r"|\b[Pp]ort \S+ changed state to (?:down|up)\b"
        # a NIC driver's own ('r8169 ... eth1: Link is Down', 'r8168: eth0: link down'), netifd's loss
        r"|: Link is Down\b|: link down\b|\bhas link connectivity loss\b"
        r"|\bTaking down physical NIC \S+ because the link is (?:flapping|unstable)\b",  # ESXi
        "unless": r"\bSATA\b|\bata\d+",
        "doc": "a NIC or InfiniBand port went down or came back up while the job ran: a flap (not a disk's "
        "SATA link)",
    },
    {
        "name": "peer_unreachable",
        "status": "other_network_error",
        "pattern": r"\bsocketStartConnect: exceeded retries\b"
        # NCCL's connect failing with an error it does not retry (refused and timed out are retried)
        r"|\bsocketStartConnect: Connect to \S+ failed : "
        r"|\bCoordination service agent in error status\b"
        r"|\bucp_\w+\(.*\) failed: (?:Destination is unreachable|Connection reset|Endpoint timeout)"
        r"|\bucp_ep_create\(.*\) failed: "
        r"|\bFatal: (?:transport error: Endpoint timeout|UD endpoint \S+(?: to .*)?: unhandled timeout error)"
        r"|\bheartbeat timeout\. This indicates that the remote task has failed\b"
        r"|\bDEADLINE_EXCEEDED: Barrier timed out\b"  # JAX/XLA's coordination service
        # gRPC's detail of a failed poll, heartbeat or barrier (not WatchJobState's: a clean
        # shutdown's receipt)
        r"|\bwhile calling /tensorflow\.CoordinationService/(?:PollForError|Heartbeat|Barrier):"
        r"|\bError encountered progressing operation=Connect\b",
        "doc": "a peer that cannot be reached: NCCL's bootstrap out of retries, UCX's endpoint, JAX's "
        "coordination service losing a task's heartbeat or its barrier timing out",
    },
    {
        "name": "coordination_error_polled",
        "status": "other_network_error",
        "pattern": r"\bcoordination_service_agent\.cc:\d+\] Polled an error from coordination service\b",
        "secondary": True,
        "doc": "JAX's coordination service agent echoing an error of some task (every live task prints it "
        "when any task dies): the task that died says why",
    },
    {
        "name": "nccl_net_failure",
        "status": "other_network_error",
        "pattern": r"NET/(?:IB\w*|OFI|Socket)\s*:?.*\b(?:completion|error|failed|failure)\b|ncclSystemError|"
        r"unhandled system error|ncclInternalError|internal error, NCCL version"
        r"|internal error - please report this issue to the NCCL developers"
        r"|NCCL Error [23]\b"
        r"|got completion with error"
        r"|third_party/gloo/gloo/transport/"
        r"|\bibv_\w+ (?:failed|returned)"
        r"|UCX\s+ERROR"
        r"|\bfi_\w+\b.*\bfailed"
        r"|Gloo connectFullMesh failed"
        r"|\bUnable to write to EQ: .*\berr: "  # libfabric's EFA provider
        r"|\bCheck failed: .*\bIBV_WC_SUCCESS\b"  # a failed RDMA work completion (glog's CHECK)
        # uccl's: a work completion with an error status (not 5, flushed: a queue pair's teardown)
        r"|\bCQE error, .*\bstatus=(?!5 )[1-9]\d* \("
        r"|\bmlx5_\w+(?:/\d+)?: QP \d+ error: "  # the mlx5 kernel driver's queue pair error
        r"|\bUCX endpoint create failed\b"
        # Huawei's HCCL (Ascend) failing to set up RDMA, a socket or a transport to a peer
        r"|\bEI0009: .*\bTransport init error\b"
        r"|^\[ERROR\] HCCL\(\d+,[^)]*\):\S+ \[\w+\.cc:\d+\] .*\b(?:rdma init fail|socket establish timeout)\b"
        r"|^\[ERROR\] HCCL\(\d+,[^)]*\):\S+ \[(?:hccl_socket_manager|transport_manager)\.cc:\d+\] "
        r".*(?:LinksEstablishCompleted|links establish completed failed|Transport init error|time ?out)"
        # Mooncake's transfer engine (KV-cache transfer over RDMA), at E level
        # (not every E-level line there: a slice whose transfer is retried, a configuration error)
        r"|^E\d{4} [\d:.]+\s+\d+ (?:worker_pool\.cpp:\d+\] Worker: Cannot make connection for endpoint\b"
        r"|rdma_endpoint\.cpp:\d+\] \[Handshake\] Failed to modify QP to RT[RS]\b"
        r"|rdma_context\.cpp:\d+\] Context is not active\b"
        r"|rdma_transport\.cpp:\d+\] Device \d+ is not active\b)"
        r"|Bootstrap : no socket interface found|\bWARN Socket creation failed|is neither AF_INET",
        "ignore_case": True,
    },
    {
        "name": "ucx_ib_error",
        "status": "other_network_error",
        "pattern": r"\bib_mlx5_log\.c:\d+\b|Transport retry count exceeded",
        "doc": "UCX's mlx5 transport logs a failed work completion (e.g. the transport retry count "
        "exceeded) and the queue pair it failed on: the InfiniBand/RoCE path to a peer failed",
    },
    {
        "name": "control_plane_node_lost",
        "status": "lost_connection",
        "severity": "SEV3",
        # the taint on the node, not the toleration every pod lists ('node.kubernetes.io/unreachable:NoExecute
        # op=Exists for 300s')
        "pattern": r"\bKubelet stopped posting node status\b"
        r"|^\s*Taints:\s+node\.kubernetes\.io/unreachable\b",
        "secondary": True,
        "doc": "Kubernetes' control plane lost a node (a NotReady condition, the unreachable taint), as an "
        "operator's 'kubectl describe' prints it: like Ray's opinion of a peer (ray_peer_marked_dead), "
        "another component's view of some node, so SEV3; unicorn's own heartbeats decide",
    },
    {
        "name": "nic_tx_hang",
        "status": "other_network_error",
        "pattern": r"Detected (?:Hardware|Tx) Unit Hang|\bNETDEV WATCHDOG: .*\btransmit queue \d+ timed out\b"
        r"|\befa(?:_\d+| [0-9a-f:.]+ \w+): Failed to process command\b",
        "doc": "a NIC driver (e1000e, igb, ixgbe) found its transmit unit hung; the link stalls until the "
        "driver resets the adapter; or EFA's device failed an admin command (the adapter's firmware)",
    },
    {
        "name": "socket_failure",
        "status": "other_network_error",
        "pattern": r"Connection timed out|errno: 110\b|No route to host|Network is unreachable|"
        r"DistNetworkError|DistStoreError|RendezvousTimeoutError|RendezvousConnectionError|Socket Timeout|"
        r"client socket has failed to connect|client socket has timed out|connect\(\) timed out|"
        r"Timed out initializing process group|server socket has failed to (?:listen|bind)|errno: 98\b|"
        r"retry counter exceeded|RETRY_EXC_ERR|Max retries exceeded with url|NewConnectionError|"
        r"Temporary failure in name resolution|Name or service not known|Name does not resolve|"
        r"Timed out after \d+ "
        r"seconds waiting for "
        r"clients"
        r"|Rendezvous\w*Error"
        r"|Address already in use"
        r"|Could not resolve hostname"
        r"|failed to resolve"
        r"|socket\.timeout"
        r"|ConnectionAbortedError"
        r"|Wait timeout (?:after \d+ seconds )?for key\(s\)"
        r"|RuntimeError: Wait timeout$"
        r"|HTTP GET request failed too many times"
        r"|\berrors_impl\.UnavailableError: ",  # TensorFlow raising gRPC's UNAVAILABLE (a worker)
        "ignore_case": True,
    },
    # 7. generic catch-alls
    {
        "name": "nccl_warn",
        "status": "other_network_error",
        "pattern": r"\bNCCL WARN\b",
        "generic": True,
        "doc": "NCCL reported a problem that no specific rule names",
    },
    {
        "name": "nccl_error_other",
        "status": "other_network_error",
        "pattern": r"NCCL error in: |\bDist(?:Backend|Network|Store)?Error\b",
        "generic": True,
        "doc": "an NCCL or torch.distributed error that no specific rule names",
    },
    {
        "name": "cpp_terminate",
        "status": "other_software_error",
        "pattern": r"terminate called after throwing an instance of"
        r"|std::bad_alloc",
        "generic": True,
    },
    {
        "name": "cpp_terminate_after",
        "status": "exited_abnormally",
        "pattern": r"terminate called (?:without an active exception|recursively)",
        "secondary": True,
        "generic": True,
        "doc": "the C++ runtime aborting the process, often after another failure (a watchdog's abort, "
        "an earlier terminate): the process ends, the cause is elsewhere",
    },
    {
        "name": "arrow_exception",
        "status": "other_software_error",
        "pattern": r"\bArrow(?:Invalid|TypeError|NotImplementedError|IOError|KeyError|IndexError|MemoryError"
        r"|CapacityError|SerializationError|Cancelled)(?:'>)?: "
        r"|(?:^|\.)EnforceNotMet: ",  # PaddlePaddle's failed PADDLE_ENFORCE
        "generic": True,
        "doc": "pyarrow's exceptions (a dataset that does not parse: 'pyarrow.lib.ArrowInvalid: JSON parse "
        "error') and PaddlePaddle's EnforceNotMet, whose names python_exception's pattern does not cover",
    },
    {
        "name": "glog_check_failed",
        "status": "other_software_error",
        # glog's own prefix, or TensorFlow's ('2018-09-06 17:28:38.814423: F path/file.cc:211] ')
        "pattern": r"^(?:F\d{4} [\d:.]+\s+\d+ [\w.-]+|\d{4}-\d\d-\d\d [\d:.]+: F \S+)\.(?:cc|cpp|h):\d+\] "
        r"Check failed: ",
        "generic": True,
        "doc": "a failed CHECK at glog's FATAL level (XLA, TensorFlow, PaddlePaddle): the framework aborts "
        "the process on its own invariant; rules for a CUDA status or an RDMA completion come first",
    },
    {
        "name": "rust_panic",
        "status": "other_software_error",
        # Rust 1.73+ ('panicked at src/main.rs:4:37:'), and before ('panicked at 'msg', src/main.rs:4:37')
        "pattern": r"^\s*thread '[^']*' panicked at (?:\S+:\d+:\d+|'.*', \S+:\d+:\d+)",
        "severity": "SEV3",
        "generic": True,
        "doc": "a Rust panic (a Rust extension such as tokenizers, or a Rust program). SEV3: a panic outside "
        "the main thread may be caught (tokio turns a task's panic into an error) and the program go on; "
        "a process that dies of it is classified by its exit",
    },
    {
        "name": "python_exception",
        "status": "other_software_error",
        # the exception's own name, after a separator or its module's dot ('torch.cuda.OutOfMemoryError')
        "pattern": _each(r"[A-Z](?<![^\s\]:>.)][A-Z])\w*@(?::\s|:?$)", "Error", "Exception"),
        "unless": r"^\s*(?:raise|except|from|import|class|def|assert|return)\b|^\s*File \"",
        "generic": True,
        "doc": "an exception line of a Python traceback that no specific rule explains",
    },
    {
        "name": "exception_repr",
        "status": "other_software_error",
        "pattern": r"^[A-Z]\w*(?:Error|Exception)\((?:'|\")",
        "severity": "SEV3",
        "generic": True,
        "doc": "an exception printed as its repr ('TypeError(\"...\")'), as a handler that logs the "
        "object does. SEV3: the handler caught it and the job may go on; if it dies, its exit says so",
    },
    {
        "name": "training_crashed",
        "status": "other_software_error",
        "pattern": r"^Training crashed\b",
        "generic": True,
        "doc": "a training script's own report that it stopped on an error",
    },
    {
        "name": "bare_exception",
        "status": "other_software_error",
        "pattern": r"^Exception: ",
        "generic": True,
        "doc": "an exception of the base class itself ('Exception: Current loss scale already at "
        "minimum'), which python_exception's named-class pattern does not cover",
    },
    {
        "name": "disk_full",
        "status": "other_software_error",
        # a shell's or a coreutil's form: 'mkdir: cannot create directory '/tmp/x': No space left on device',
        # 'slurm_script: line 34: cannot create temp file for here-document: No space left on device'
        # (not tail's 'cannot watch': ENOSPC there is inotify's watch limit, and tail goes on)
        "pattern": r"^\S+: (?:line \d+: )?cannot (?!watch\b)[^:]+(?:: [^:]+)?: No space left on device\s*$",
        "doc": "a program could not write for lack of disk space (the job's output, /tmp): the job stops, "
        "and SEV2 does not drain; a node whose local disk stays full fails the next launch the same way",
    },
    {
        "name": "python_script_missing",
        "status": "other_software_error",
        "pattern": r"\bpython[\d.]*: can't open file '[^']*': \[Errno 2\]"
        # the job's own interpreter or launcher missing (bash, or a batch script's 'slurm_script: line 12: ')
        r"|(?:\b(?:ba)?sh|^\S+): (?:line \d+: )?(?:python[\d.]*|torchrun|deepspeed|accelerate|mpirun): "
        r"command not found\b",
        "doc": "the interpreter cannot open the script it was given (a wrong path in the job's command): "
        "the user's error, and the process exits 2",
    },
    {
        "name": "config_override_error",
        "status": "other_software_error",
        "pattern": r"^Error parsing override '|^Could not override '|\bKey '[^']+' is not in struct\b"
        r"|^mismatched input '.{1,40}' expecting ",  # Hydra's override grammar (ANTLR)
        "generic": True,
        "doc": "Hydra/OmegaConf rejecting a configuration override (a bad key, a value that does not parse): "
        "the user's command line",
    },
    {
        "name": "ddp_unused_parameters",
        "status": "other_software_error",
        "pattern": r"Parameter indices which did not receive grad for rank \d+"
        r"|Expected to have finished reduction in the prior iteration"
        # a parameter reduced twice in one iteration (reentrant checkpointing, shared weights)
        r"|\bhas been marked as ready twice\b",
        "doc": "DistributedDataParallel's error for parameters that got no gradient (the model's code, or "
        "find_unused_parameters): the user's error",
    },
    {
        "name": "hydra_job_error",
        "status": "other_software_error",
        "pattern": r"^Error executing job with overrides: \[",
        "generic": True,
        "doc": "Hydra's report that the training function raised (the exception follows, or is "
        "hidden until HYDRA_FULL_ERROR=1)",
    },
    {
        "name": "error_level_line",
        "status": "other_software_error",
        "pattern": _each(r"^\s*@:[\w.]*:|\[@\]", "ERROR", "CRITICAL", "FATAL")
        + r"|\[Errno \d+\]"
        # logging's and loguru's '%(asctime)s %(levelname)s' formats: '2023-08-16 16:27:36 ERROR [main] ...',
        # '2022-07-06 10:48:08 | ERROR | module:98 - ...'
        + r"|^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\s+(?:\|\s+)?(?:ERROR|CRITICAL|FATAL)\s+[\[|]"
        + r"|^(?:ERROR|CRITICAL|FATAL) - [\w.]+ - "  # '%(levelname)s - %(name)s - %(message)s'
        # vLLM's CRITICAL (its ERROR lines include benign shutdown noise: "Engine core proc ... died
        # unexpectedly" at the end of a finished script)
        + r"|^CRITICAL \d\d-\d\d \d\d:\d\d:\d\d ",
        "severity": "SEV3",
        "generic": True,
        "doc": "a logging line at ERROR level, or an OS error ('[Errno 2] No such file or directory'), "
        "that no specific rule explains. SEV3: a level alone is weak evidence (libraries log ERROR and "
        "go on: DCGM's 'No data is available', a missing 'aplay', a server's stderr relayed at "
        "ERROR), so it waits in place and climbs only if no iteration follows; a process that dies "
        "is classified by its exit",
    },
    # exceptions reported by the training hook (type and message)
    {
        "name": "clean_system_exit",
        "status": "none",
        "exception_type": r"SystemExit",
        "message": r"^(?:0|None)?$",
    },
    {
        "name": "cuda_out_of_memory_exception",
        "status": "other_software_error",
        "exception_type": r"(?:torch\.(?:cuda\.)?)?OutOfMemoryError",
    },
    {
        "name": "host_memory_exception",
        "status": "other_software_error",
        "exception_type": r"MemoryError",
    },
    # how a process ended (exit codes and signals)
    {
        "name": "killed_sigkill",
        "status": "exited_abnormally",
        "signals": ["SIGKILL"],
        "doc": "killed outright: the OOM killer, kill -9, or Slurm after its grace period",
    },
    {
        "name": "crashed_sigsegv",
        "status": "exited_abnormally",
        "signals": ["SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"],
        "doc": "crashed in native code",
    },
    {
        "name": "terminated",
        "status": "exited_abnormally",
        "signals": ["SIGTERM", "SIGINT", "SIGHUP"],
        "secondary": True,
        "doc": "asked to stop by someone else (torchrun or Slurm cleaning up after a failure)",
    },
    # NVML health events (the agent reports increases of counters and threshold crossings)
    {
        "name": "gpu_ecc_uncorrectable",
        "status": "ecc_error",
        "gpu_kind": "ecc_uncorrectable",
        "min_value": 1,
    },
    {
        "name": "gpu_retired_pages",
        "status": "ecc_error",
        "gpu_kind": "retired_pages",
        "min_value": 1,
        "doc": "a page was retired after a double-bit error; the GPU needs a reset to stop using it",
    },
    {
        "name": "gpu_remapped_rows",
        "status": "ecc_error",
        "gpu_kind": "remapped_rows",
        "min_value": 1,
        "doc": "a memory row was remapped (or remapping failed); the GPU needs a reset",
    },
    {
        "name": "gpu_nvlink_errors",
        "status": "nvlink_error",
        "gpu_kind": "nvlink_error",
        "min_value": 1,
    },
    {
        "name": "gpu_overheat",
        "status": "gpu_driver_error",
        "gpu_kind": "temperature",
        "doc": "the agent saw the GPU cross its temperature limit: it throttles, then shuts down",
    },
    {
        "name": "gpu_driver_unusable",
        "status": "gpu_driver_error",
        "gpu_kind": "driver_error",
        "doc": "NVML could not open or read the GPU",
    },
)
"""Built-in rules in the rules-file schema, parsed by :func:`detect.rules.parse_rules`."""
