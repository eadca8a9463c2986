"""The coordinator's decisions: pure functions of (snapshot, input, clock) -> :class:`Decision`.

Nothing here performs I/O or reads a clock: ``now_s`` is wall-clock seconds passed in by
the caller (see :mod:`unicornd.state` for why wall time). The same snapshot and input
always give the same decision, action ids included, so unicornd can re-decide after a
crash and its executor skips what it already did.

The ladder (Unicron Fig. 7), per task, one open incident at a time:

==========================  ===========================================================
finding                     rung
==========================  ===========================================================
SEV3                        ``retry_in_place``: wait (``restart_ranks`` on the node if
                            the rank died); a failed retry climbs
SEV2, or retries exhausted  ``restart_processes``: ``restart_ranks`` on every node of
                            the task, same nodes, same layout, nearest saved state
SEV1, or restarts exhausted ``isolate``: drain the node (``unicorn: <status> <detail>``),
                            then ``replan``; :func:`unicornd.replan.plan_transition`
                            moves the incident to ``transition``. Gated by
                            :mod:`detect.isolation`: an unconfirmed SEV1 restarts in
                            place; exhausted restarts run the node check (paired for
                            collective faults) before any drain; a software error
                            never drains (the task stops)
an iteration after that     ``resumed`` then ``closed`` (:func:`on_progress`)
==========================  ===========================================================

A rung *failed* when a finding no better than it arrives more than
:attr:`Policy.settle_s` after its action, or when no iteration arrives within its
timeout (:func:`on_tick`). Findings inside the settle time are consequences of the
action (peers time out, restarted ranks exit) and are only recorded. Breakers: the
per-task recovery budget and the no-progress breaker stop the task and notify the
operator; the drain limiter turns a drain beyond its quota into a request for the
operator's confirmation (:func:`on_operator_confirm_drain`).

A rung also fails at once when its action fails: an agent that answers a restart or a
relaunch with an error, a launch that srun refuses (:func:`on_outcome`).

The package, by input:

- :mod:`.ladder`: findings, time (:func:`on_tick`), the operator's drain and confirmation;
- :mod:`.progress`: iterations (:func:`on_progress`);
- :mod:`.membership`: nodes join/are checked/drained; tasks arrive, finish, stop; a
  requeued job runs again;
- :mod:`.outcomes`: what became of each action (:func:`on_outcome`);
- :mod:`.stragglers`: a node slower than its peers, replaced or reported (:func:`on_straggler`);
- :mod:`.basis`: when the planner takes a new plan basis (:func:`on_basis_due`);
- :mod:`.resolve`: a decision's replan and agent restarts made concrete before commit.
"""

from __future__ import annotations

from unicornd.decide.basis import on_basis_due
from unicornd.decide.common import (
    AGENT_LOST,
    AGENT_RULES,
    AGENT_SILENT,
    HEARTBEAT_TIMEOUT,
    RUNG_OF_SEVERITY,
    SLURM_NOT_RESPONDING,
    SSH_UNREACHABLE,
    ClassificationLike,
    Finding,
)
from unicornd.decide.ladder import (
    on_finding,
    on_operator_confirm_drain,
    on_operator_drain,
    on_tick,
    rung_failed,
    start_failed,
)
from unicornd.decide.membership import (
    on_job_running,
    on_node_check,
    on_node_drained,
    on_node_finished,
    on_node_gpus,
    on_node_jobs,
    on_node_join,
    on_node_slurm_down,
    on_task_arrived,
    on_task_finished,
    on_task_stop,
)
from unicornd.decide.outcomes import on_outcome
from unicornd.decide.progress import on_progress
from unicornd.decide.resolve import resolve, resolve_with_plan
from unicornd.decide.stragglers import StragglerFinding, on_straggler
from unicornd.state import LIVE_TASK_STATES

__all__ = [
    "AGENT_LOST",
    "AGENT_RULES",
    "AGENT_SILENT",
    "HEARTBEAT_TIMEOUT",
    "LIVE_TASK_STATES",
    "RUNG_OF_SEVERITY",
    "SLURM_NOT_RESPONDING",
    "SSH_UNREACHABLE",
    "ClassificationLike",
    "Finding",
    "StragglerFinding",
    "on_basis_due",
    "on_finding",
    "on_job_running",
    "on_node_check",
    "on_node_drained",
    "on_node_finished",
    "on_node_gpus",
    "on_node_jobs",
    "on_node_join",
    "on_node_slurm_down",
    "on_operator_confirm_drain",
    "on_operator_drain",
    "on_outcome",
    "on_progress",
    "on_straggler",
    "on_task_arrived",
    "on_task_finished",
    "on_task_stop",
    "on_tick",
    "resolve",
    "resolve_with_plan",
    "rung_failed",
    "start_failed",
]
