"""Unicron's error statuses and severities (Unicron paper, Table 1), and the defaults.

Severity says what recovery a failure needs, so the coordinator can act on it without
knowing the status:

- ``SEV1``: the node (or one of its GPUs or links) is faulty; it must leave the job and
  the task is reconfigured without it.
- ``SEV2``: the training process is gone or corrupted; restart the process(es), the
  node stays.
- ``SEV3``: a transient fault (network hiccup, timeout); reattempt in place.

``SEV1`` is the most severe. The string values sort the same way (``"SEV1" <
"SEV2"``), so ``min()`` over severities is the worst; :func:`worst` says so by name.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final


class ErrorStatus(enum.StrEnum):
    """What went wrong, with exactly Unicron's Table 1 names, plus ``none`` (benign) and
    the training-state statuses of :mod:`detect.losshealth`."""

    NONE = "none"
    LOST_CONNECTION = "lost_connection"
    EXITED_ABNORMALLY = "exited_abnormally"
    CONNECTION_REFUSED_RESET = "connection_refused_reset"
    ILLEGAL_MEMORY_ACCESS = "illegal_memory_access"
    ECC_ERROR = "ecc_error"
    INVALID_DMA_MAPPING = "invalid_dma_mapping"
    CUDA_ERROR = "cuda_error"
    NVLINK_ERROR = "nvlink_error"
    GPU_DRIVER_ERROR = "gpu_driver_error"
    OTHER_NETWORK_ERROR = "other_network_error"
    OTHER_SOFTWARE_ERROR = "other_software_error"
    NCCL_TIMEOUT = "nccl_timeout"
    LINK_FLAPPING = "link_flapping"
    TASK_HANG = "task_hang"
    # Training-state findings (the Acme/InternEvo failure study; not in Unicron's Table 1):
    # the hardware looks fine but the numbers do not (:mod:`detect.losshealth`).
    NAN_LOSS = "nan_loss"
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_EXPLOSION = "grad_norm_explosion"
    SILENT_DATA_CORRUPTION = "silent_data_corruption"
    # Sub-healthy: the node works, slower than its peers (:mod:`detect.stragglers`).
    STRAGGLER = "straggler"


class Severity(enum.StrEnum):
    """How much recovery a failure needs; ``SEV1`` is the most severe (see module doc)."""

    SEV1 = "SEV1"
    SEV2 = "SEV2"
    SEV3 = "SEV3"

    @property
    def level(self) -> int:
        """1 for ``SEV1`` (most severe) .. 3 for ``SEV3``; smaller is worse."""
        return int(self.value[3:])

    def is_worse_than(self, other: Severity) -> bool:
        """True when ``self`` needs more recovery than ``other``."""
        return self.level < other.level


def worst(severities: Iterable[Severity | None]) -> Severity | None:
    """The most severe of ``severities`` (``None`` entries, meaning benign, are skipped)."""
    found = [s for s in severities if s is not None]
    return min(found, key=lambda s: s.level) if found else None


DEFAULT_SEVERITY: Final[dict[ErrorStatus, Severity]] = {
    ErrorStatus.LOST_CONNECTION: Severity.SEV1,
    ErrorStatus.EXITED_ABNORMALLY: Severity.SEV2,
    ErrorStatus.CONNECTION_REFUSED_RESET: Severity.SEV3,
    ErrorStatus.ILLEGAL_MEMORY_ACCESS: Severity.SEV2,
    ErrorStatus.ECC_ERROR: Severity.SEV1,
    ErrorStatus.INVALID_DMA_MAPPING: Severity.SEV1,
    ErrorStatus.CUDA_ERROR: Severity.SEV2,
    ErrorStatus.NVLINK_ERROR: Severity.SEV1,
    ErrorStatus.GPU_DRIVER_ERROR: Severity.SEV1,
    ErrorStatus.OTHER_NETWORK_ERROR: Severity.SEV3,
    ErrorStatus.OTHER_SOFTWARE_ERROR: Severity.SEV2,
    ErrorStatus.NCCL_TIMEOUT: Severity.SEV3,
    ErrorStatus.LINK_FLAPPING: Severity.SEV3,
    ErrorStatus.TASK_HANG: Severity.SEV2,
    ErrorStatus.NAN_LOSS: Severity.SEV2,
    ErrorStatus.LOSS_SPIKE: Severity.SEV2,
    ErrorStatus.GRAD_NORM_EXPLOSION: Severity.SEV2,
    ErrorStatus.SILENT_DATA_CORRUPTION: Severity.SEV1,
    ErrorStatus.STRAGGLER: Severity.SEV3,
}
"""Unicron Table 1: the severity of each status (``none`` has no severity), and the
training-state statuses: a NaN, a loss spike or a gradient-norm explosion needs the
processes restarted from saved state (SEV2), never a node taken out
(:data:`detect.isolation.ISOLATION` says ``never``). ``silent_data_corruption`` (one
node's replica keeps producing them while the others do not) points at the node, so
SEV1; it is never confirmed by the training's numbers alone: the paired check decides.
``straggler`` is sub-healthy, not failed (SEV3, the least): whether the node leaves its task
is a cost decision (:mod:`unicornd.decide.stragglers`), never the ladder's."""

SECONDARY_BY_DEFAULT: Final[frozenset[ErrorStatus]] = frozenset(
    {ErrorStatus.NCCL_TIMEOUT, ErrorStatus.CONNECTION_REFUSED_RESET, ErrorStatus.TASK_HANG}
)
"""Statuses that are usually *consequences* of a failure elsewhere: when one rank dies,
its peers' collectives time out, their connections to it are reset, and the whole task
stops progressing. Root-cause selection prefers other evidence over these; a rule may
override the flag either way."""


def default_severity(status: ErrorStatus) -> Severity | None:
    """Table 1 severity of ``status``; ``None`` for ``none``."""
    return DEFAULT_SEVERITY.get(status)
