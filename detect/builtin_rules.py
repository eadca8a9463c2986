"""The built-in rule table: evidence from PyTorch, NCCL, CUDA, the NVIDIA driver, the
kernel and Slurm, mapped to Unicron's statuses (schema: :mod:`detect.rules`).

Order is priority (first match wins per line), grouped so that the most specific and
most severe explanation of a line comes first:

1. benign lines that would otherwise match a broader rule below;
2. NVIDIA Xid codes, with NVIDIA's documented meanings (XID catalog,
   docs.nvidia.com/deploy/xid-errors);
3. hardware and driver (SEV1): ECC, GPU off the bus, driver failures, DMA/IOMMU, NVLink;
4. CUDA errors raised in the process (SEV2);
5. the process or node itself: segfaults, OOM kills, Slurm node failures;
6. network and collectives (SEV3): NCCL timeouts and errors, resets, link flaps;
7. generic catch-alls (a Python exception line, a C++ terminate, any ``NCCL WARN``).

Every pattern is exercised by a real log line in ``tests/detect/test_detect_rules.py``.
"""

from __future__ import annotations

from typing import Final

_RANK = r"^\s*(?:\[(?:rank|default)\d+\]:\s*)?"
"""Optional ``[rank3]:`` prefix that torchrun puts before each line of a rank's output."""

_XIDS: Final[tuple[tuple[int, str, str, dict[str, object]], ...]] = (
    (
        13,
        "illegal_memory_access",
        "Graphics Engine Exception: an illegal or out-of-range access in a kernel",
        {},
    ),
    (
        31,
        "illegal_memory_access",
        "GPU memory page fault (MMU fault), usually an illegal address in the application",
        {},
    ),
    (32, "cuda_error", "Invalid or corrupted push buffer stream", {}),
    (38, "gpu_driver_error", "Driver firmware error", {}),
    (
        43,
        "cuda_error",
        "GPU stopped processing: the faulting application's channel was stopped",
        {"secondary": True},
    ),
    (44, "gpu_driver_error", "Graphics Engine fault during context switch", {}),
    (45, "cuda_error", "Preemptive cleanup, due to previous errors", {"secondary": True}),
    (48, "ecc_error", "Double Bit ECC Error (uncorrectable)", {}),
    (61, "gpu_driver_error", "Internal micro-controller breakpoint/warning", {}),
    (62, "gpu_driver_error", "Internal micro-controller halt", {}),
    (63, "ecc_error", "ECC page retirement or row remapping recording event", {}),
    (64, "ecc_error", "ECC page retirement or row remapper recording failure", {}),
    (69, "cuda_error", "Graphics Engine class error", {}),
    (74, "nvlink_error", "NVLink error", {}),
    (79, "gpu_driver_error", "GPU has fallen off the bus", {}),
    (92, "ecc_error", "High single-bit ECC error rate", {}),
    (
        94,
        "ecc_error",
        "Contained ECC error: only the applications using the bad memory must restart",
        {"severity": "SEV2"},
    ),
    (95, "ecc_error", "Uncontained ECC error: the GPU must be reset", {}),
    (109, "gpu_driver_error", "Context switch timeout", {}),
    (119, "gpu_driver_error", "GSP RPC timeout", {}),
    (120, "gpu_driver_error", "GSP error", {}),
    (140, "ecc_error", "Unrecovered ECC error", {}),
    (144, "nvlink_error", "NVLink SAW error", {}),
    (145, "nvlink_error", "NVLink RLW error", {}),
    (146, "nvlink_error", "NVLink TLW error", {}),
    (147, "nvlink_error", "NVLink TREX error", {}),
    (148, "nvlink_error", "NVLink NVLPW control error", {}),
    (149, "nvlink_error", "NVLink NETIR error", {}),
    (150, "nvlink_error", "NVLink MSE error", {}),
)

BUILTIN_RULES: Final[tuple[dict[str, object], ...]] = (
    # 1. benign lines (status none) that broader rules below would otherwise catch
    {
        "name": "torchelastic_closing_signal",
        "status": "none",
        "pattern": r"Sending process \d+ closing signal SIG\w+",
        "doc": "torchrun stopping the remaining workers after a failure: a reaction, not evidence",
    },
    {
        "name": "cuda_async_hint",
        "status": "none",
        "pattern": _RANK + r"(?:CUDA kernel errors might be asynchronously reported|For debugging consider "
        r"passing CUDA_LAUNCH_BLOCKING|Compile with `TORCH_USE_CUDA_DSA`)",
        "doc": "the hint PyTorch prints after every CUDA error; the error line itself is classified",
    },
    {
        "name": "nccl_info",
        "status": "none",
        "pattern": r"\bNCCL INFO\b",
        "doc": "NCCL informational output (including 'connect returned Connection refused, retrying')",
    },
    # 2. NVIDIA Xid codes
    *(
        {"name": f"xid_{code}", "status": status, "xid": [code], "doc": f"Xid {code}: {meaning}", **extra}
        for code, status, meaning, extra in _XIDS
    ),
    {
        "name": "xid_other",
        "status": "cuda_error",
        "xid": [],
        "generic": True,
        "doc": "an Xid not in the table: a GPU-side error of unknown kind; restart the process",
    },
    # 3. hardware and driver
    {
        "name": "ecc_uncorrectable",
        "status": "ecc_error",
        "pattern": r"uncorrectable ECC error|ECC_UNCORRECTABLE|cudaErrorECCUncorrectable|double[- ]bit ECC",
        "ignore_case": True,
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
        "pattern": r"GPU is lost|GPU requires reset|Unable to determine the device handle for GPU",
        "ignore_case": True,
    },
    {
        "name": "nvidia_driver_unusable",
        "status": "gpu_driver_error",
        "pattern": r"Driver/library version mismatch|couldn't communicate with the NVIDIA driver|"
        r"NVIDIA driver on your system is too old|Found no NVIDIA driver|no CUDA-capable device is detected|"
        r"CUDA driver initialization failed|all CUDA-capable devices are busy or unavailable|"
        r"CUDA_ERROR_NO_DEVICE|cudaErrorNoDevice|NVML_ERROR_GPU_IS_LOST|RmInitAdapter failed",
        "ignore_case": True,
    },
    {
        "name": "iommu_dma_fault",
        "status": "invalid_dma_mapping",
        "pattern": r"DMAR: \[DMA (?:Read|Write)|DMAR: DRHD: handling fault|"
        r"AMD-Vi: Event logged \[IO_PAGE_FAULT|IO_PAGE_FAULT|DMA mapping error|dma_map\w* failed|"
        r"invalid DMA mapping",
        "ignore_case": True,
        "doc": "the IOMMU rejected a device DMA: a bad mapping between GPU/NIC and host memory",
    },
    {
        "name": "nvlink_failure",
        "status": "nvlink_error",
        "pattern": r"NVLink\b.*\b(?:errors?|fail\w*|fatal|down|inactive|fault)\b",
        "ignore_case": True,
    },
    # 4. CUDA errors in the process
    {
        "name": "cuda_illegal_address",
        "status": "illegal_memory_access",
        "pattern": r"illegal memory access|CUDA_ERROR_ILLEGAL_ADDRESS|cudaErrorIllegalAddress|"
        r"misaligned address",
        "ignore_case": True,
    },
    {
        "name": "cuda_out_of_memory",
        "status": "other_software_error",
        "pattern": r"CUDA out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|"
        r"CUBLAS_STATUS_ALLOC_FAILED",
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
        "pattern": r"device-side assert triggered",
    },
    {
        "name": "nccl_cuda_failure",
        "status": "cuda_error",
        "pattern": r"NCCL WARN Cuda failure|ncclUnhandledCudaError|unhandled cuda error",
        "ignore_case": True,
    },
    {
        "name": "cuda_error",
        "status": "cuda_error",
        "pattern": r"CUDA error\b|CUDA_ERROR_\w+|cudaError\w+|cuda runtime error|CUDNN_STATUS_(?!SUCCESS)\w+|"
        r"CUBLAS_STATUS_(?!SUCCESS)\w+",
        "generic": True,
    },
    # 5. the process and the node
    {
        "name": "slurm_node_failure",
        "status": "lost_connection",
        "pattern": r"DUE TO NODE FAILURE|Node failure on \S+|\bNODE_FAIL\b",
        "doc": "Slurm lost a node of the job (slurmd unreachable)",
    },
    {
        "name": "host_oom_kill",
        "status": "exited_abnormally",
        "pattern": r"Out of memory: Kill(?:ed)? process|invoked oom-killer|\boom-kill:|oom_reaper: reaped|"
        r"Memory cgroup out of memory|Detected \d+ oom[-_]kill event",
        "doc": "the kernel's OOM killer (host memory) killed a process",
    },
    {
        "name": "segfault",
        "status": "exited_abnormally",
        "pattern": r"Segmentation fault|SIGSEGV|segfault at [0-9a-f]+",
    },
    {
        "name": "bus_error",
        "status": "exited_abnormally",
        "pattern": r"\bBus error\b|SIGBUS",
    },
    {
        "name": "fatal_python_error",
        "status": "exited_abnormally",
        "pattern": r"Fatal Python error",
    },
    {
        "name": "torchelastic_worker_failed",
        "status": "exited_abnormally",
        "pattern": r"failed \(exitcode: -?\d+\) local_rank: \d+|ChildFailedError",
        "secondary": True,
        "doc": "torchrun reporting a worker's death; the worker's own output says why",
    },
    # 6. network and collectives
    {
        "name": "nccl_watchdog_timeout",
        "status": "nccl_timeout",
        "pattern": r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*timed out|"
        r"Timeout at NCCL work|Some NCCL operations have failed or timed out",
    },
    {
        "name": "gloo_timeout",
        "status": "nccl_timeout",
        "pattern": r"gloo.*Timed out waiting \d+ms for \w+ operation",
        "doc": "a CPU (gloo) collective timed out: the same symptom as an NCCL timeout",
    },
    {
        "name": "nccl_comm_aborted",
        "status": "other_network_error",
        "pattern": r"NCCL communicator was aborted",
        "secondary": True,
        "doc": "the communicator was torn down after an error or timeout seen elsewhere",
    },
    {
        "name": "nccl_remote_error",
        "status": "other_network_error",
        "pattern": r"ncclRemoteError|remote process exited or there was a network error",
        "secondary": True,
        "doc": "a peer of the collective went away (or the network between them did)",
    },
    {
        "name": "nccl_invalid_usage",
        "status": "other_software_error",
        "pattern": r"ncclInvalidUsage|ncclInvalidArgument|invalid usage, NCCL version",
    },
    {
        "name": "connection_reset",
        "status": "connection_refused_reset",
        "pattern": r"Connection reset by peer|ECONNRESET|Broken pipe|\bEPIPE\b|"
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
        "pattern": r"Got async event : port error|IBV_EVENT_PORT_ERR|Link DOWN\b|link status definitely down|"
        r"NIC Link is Down|Lost carrier",
        "doc": "a NIC or InfiniBand port went down (and usually back up)",
    },
    {
        "name": "nccl_net_failure",
        "status": "other_network_error",
        "pattern": r"NET/(?:IB\w*|OFI|Socket)\s*:?.*\b(?:completion|error|failed|failure)\b|ncclSystemError|"
        r"unhandled system error|ncclInternalError|internal error, NCCL version",
        "ignore_case": True,
    },
    {
        "name": "socket_failure",
        "status": "other_network_error",
        "pattern": r"Connection timed out|errno: 110\b|No route to host|Network is unreachable|"
        r"DistNetworkError|DistStoreError|RendezvousTimeoutError|RendezvousConnectionError|Socket Timeout",
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
        "name": "cpp_terminate",
        "status": "other_software_error",
        "pattern": r"terminate called after throwing an instance of",
        "generic": True,
    },
    {
        "name": "python_exception",
        "status": "other_software_error",
        "pattern": _RANK + r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?::|$)",
        "generic": True,
        "doc": "an exception line of a Python traceback that no specific rule explains",
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
