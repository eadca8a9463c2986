"""Which failures may ever take a node out, and what must confirm it first.

Draining a node costs its job a transition and the cluster a node; draining a healthy
one for a fault that is not its own fixes nothing and harms a job that was fine. So a
node is isolated only when (a) the failure's status is one a node can cause at all,
and (b) evidence from outside the training processes confirms that this node is bad.
Precision beats recall: unconfirmed evidence restarts the processes in place, and a
fault that keeps coming back on a node that passes its check stops the task and asks
the operator instead of draining.

=============================  ==========  ================================================
status                         isolation   confirmed by
=============================  ==========  ================================================
other_software_error           never       (the training's code, data or configuration)
illegal_memory_access          never       (Xid 13/31 class: the application's own access)
nan_loss, loss_spike,          never       (the training's state: its data, learning rate
grad_norm_explosion                        or numerics; restarting from saved state helps)
silent_data_corruption         confirm     the paired check across the job's nodes (its
                                           all-gather checks values), operator
lost_connection                confirm     slurm (NOT_RESPONDING/DOWN), ssh (no route),
                                           node_check, operator
straggler                      confirm     operator; never the ladder: a node slower
                                           than its peers is replaced only when the
                                           planner's gain beats the transition cost
                                           (:mod:`unicornd.decide.stragglers`)
ecc_error, gpu_driver_error,   confirm     nvml (the agent's own GPU readings),
nvlink_error,                              kernel_log (Xid/ECC lines the probe read),
invalid_dma_mapping                        node_check, operator
every other status             confirm     node_check (for collective and network faults
                                           the paired check across the job's nodes),
                                           operator
=============================  ==========  ================================================

A log line that a rank printed is never confirmation: a model may print
``NVLink errors: 0`` or the text of an old error. Only a source the training code cannot
write to counts (Slurm, SSH, NVML, the kernel log, the node check, a person).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from detect.statuses import ErrorStatus


class Isolation(enum.StrEnum):
    """Whether a failure of a status may ever isolate the node it was seen on."""

    NEVER = "never"
    """The node is not at fault: the task's own code, data or configuration. Restarts
    may help (a transient state); isolating a node never does."""
    CONFIRM = "confirm"
    """A node can cause it, but only out-of-band confirmation shows this node did."""


class Confirmation(enum.StrEnum):
    """An out-of-band source of evidence about a node (never the training's own output)."""

    SLURM = "slurm"
    """slurmctld marks the node NOT_RESPONDING or DOWN (its own slurmd pings)."""
    SSH = "ssh"
    """The SSH probe found no route to the node (refused, timed out, connection lost)."""
    NVML = "nvml"
    """The node agent's NVML readings (ECC counters, Xid events, NVLink counters)."""
    KERNEL_LOG = "kernel_log"
    """Fault lines in the node's kernel log, read by the SSH probe."""
    NODE_CHECK = "node_check"
    """The node check (or the paired check across nodes) failed on this node."""
    OPERATOR = "operator"
    """A person confirmed it (``unicornctl incidents confirm``)."""


_NODE_HARDWARE: Final = frozenset(
    {
        Confirmation.NVML,
        Confirmation.KERNEL_LOG,
        Confirmation.NODE_CHECK,
        Confirmation.OPERATOR,
    }
)
_ANY_NODE: Final = frozenset({Confirmation.NODE_CHECK, Confirmation.OPERATOR})

TRAINING_STATE: Final = frozenset(
    {ErrorStatus.NAN_LOSS, ErrorStatus.LOSS_SPIKE, ErrorStatus.GRAD_NORM_EXPLOSION}
)
"""Findings about the numbers a training computes (:mod:`detect.losshealth`): a bad batch,
a learning rate too high, an fp16 overflow. No node causes them as such; the one case
that points at a node (its replica alone keeps producing them) is
``silent_data_corruption``, a status of its own."""

ISOLATION: Final[Mapping[ErrorStatus, Isolation]] = {
    status: Isolation.NEVER
    if status in (ErrorStatus.OTHER_SOFTWARE_ERROR, ErrorStatus.ILLEGAL_MEMORY_ACCESS)
    or status in TRAINING_STATE
    else Isolation.CONFIRM
    for status in ErrorStatus
    if status is not ErrorStatus.NONE
}
"""Per status: may it ever isolate a node (table in the module doc)."""

CONFIRMED_BY: Final[Mapping[ErrorStatus, frozenset[Confirmation]]] = {
    status: (
        frozenset()
        if ISOLATION[status] is Isolation.NEVER
        else frozenset({Confirmation.SLURM, Confirmation.SSH, *_ANY_NODE})
        if status is ErrorStatus.LOST_CONNECTION
        else frozenset({Confirmation.OPERATOR})
        if status is ErrorStatus.STRAGGLER
        else _NODE_HARDWARE
        if status
        in (
            ErrorStatus.ECC_ERROR,
            ErrorStatus.GPU_DRIVER_ERROR,
            ErrorStatus.NVLINK_ERROR,
            ErrorStatus.INVALID_DMA_MAPPING,
        )
        else _ANY_NODE
    )
    for status in ISOLATION
}
"""Per status: the sources whose evidence confirms that the node is at fault."""

PAIRED_CHECK: Final = frozenset(
    {
        ErrorStatus.NCCL_TIMEOUT,
        ErrorStatus.OTHER_NETWORK_ERROR,
        ErrorStatus.CONNECTION_REFUSED_RESET,
        ErrorStatus.LINK_FLAPPING,
        ErrorStatus.TASK_HANG,
        ErrorStatus.SILENT_DATA_CORRUPTION,
    }
)
"""Statuses whose evidence does not name the culprit: every rank of a collective times
out when one node stalls it, so the rank that reported is not the suspect. Their
confirmation is the paired check across all of the job's nodes, which names the bad one.
``silent_data_corruption`` names a suspect, but only by the training's own numbers; the
paired check's all-gather compares values, so a node that corrupts data fails it."""

CHECK_AT_ONCE: Final = frozenset({ErrorStatus.SILENT_DATA_CORRUPTION})
"""Statuses whose finding is itself the repeated evidence (the detector raises
``silent_data_corruption`` only after one node's replica produced training-state findings
several times while the other nodes' did not): the ladder runs the node's check at once
instead of restarting in place first. Still nothing is drained until the check fails."""


class Verdict(enum.StrEnum):
    """What the ladder may do with a node when a failure asks for isolation."""

    DRAIN = "drain"
    """Confirmed: take the node out."""
    CHECK = "check"
    """Unconfirmed: run the node check first (the paired check for :data:`PAIRED_CHECK`)."""
    NEVER = "never"
    """Not a node's fault: never drain; stop the task once restarts are used up."""


def isolation_of(status: ErrorStatus) -> Isolation:
    """The status's row of :data:`ISOLATION` (``none`` never isolates)."""
    return ISOLATION.get(status, Isolation.NEVER)


def confirms(status: ErrorStatus, source: str) -> bool:
    """True when evidence from ``source`` (a :class:`Confirmation` value, or "" for the
    training's own output) confirms that a node caused a failure of ``status``."""
    try:
        confirmation = Confirmation(source)
    except ValueError:
        return False
    return confirmation in CONFIRMED_BY.get(status, frozenset())


def verdict(status: ErrorStatus, confirmed_by: str) -> Verdict:
    """What to do with the node of a ``status`` failure that asks for isolation."""
    if isolation_of(status) is Isolation.NEVER:
        return Verdict.NEVER
    return Verdict.DRAIN if confirms(status, confirmed_by) else Verdict.CHECK
