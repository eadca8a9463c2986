"""When the planner takes a new plan basis (:class:`unicornd.state.PlanBasis`).

The planner reads its measured inputs (iteration times, transition times, node MTBF) from
the snapshot's plan basis, not from the live calibration, so they change at known moments
and a plan solved ahead for the next failure (:mod:`unicornd.lookup`) is still the plan
that failure gets. A new basis is taken when there is none, and then every
:data:`~unicornd.state.PLAN_BASIS_REFRESH_S` while the calibration moves.
"""

from __future__ import annotations

from unicornd.actions import Decision
from unicornd.replan import PLANNED_STATES
from unicornd.state import PLAN_BASIS_REFRESH_S, PlanBasis, Snapshot


def on_basis_due(snapshot: Snapshot, now_s: float) -> Decision:
    """A new basis (the calibration now) when the snapshot plans tasks and has no basis, or
    its basis is :data:`PLAN_BASIS_REFRESH_S` old and the calibration changed since; else
    nothing."""
    if not any(t.state in PLANNED_STATES for t in snapshot.tasks.values()):
        return Decision()
    basis = snapshot.plan_basis
    if basis is not None:
        if now_s - basis.t_s < PLAN_BASIS_REFRESH_S:
            return Decision()
        if basis.calibration is snapshot.calibration or basis.calibration == snapshot.calibration:
            return Decision()
    fresh = PlanBasis(snapshot.calibration, now_s)
    return Decision(plan_basis=fresh, notes=("plan basis: the planner takes the calibration as of now",))
