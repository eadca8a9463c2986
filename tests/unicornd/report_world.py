"""A scripted ten minutes of a small cluster for ``unicornctl report`` (issue 21): its
snapshot at any time and the goodput ledger advanced over it, as unicornd would.

Five nodes n1..n5 (2 GPUs each); n5 runs another user's job 999 (not ours).

* ``gpt7b`` (job 11) runs on n1, n2 at DP4, one iteration a second. n2 dies after
  iteration 198: incident ``gpt7b.1`` (SEV1) detected at 200, isolated at 201, drained and
  replanned at 205, relaunched on n1 alone at DP2 at 206, resumed at 222 (from iteration
  190), closed at 230. n2 stays drained, held.
* ``llama`` (job 12) runs on n3 at DP2: ``llama.1`` (SEV2, an exit) at 400, processes restarted at
  401, resumed at 410, closed at 412; ``llama.2`` (SEV3, an NCCL timeout) detected at 560, retried in place
  at 561, still open at the end.
* ``c``, named ``<script>alert("c")</script>``, waits (pending, no GPUs).
"""

from __future__ import annotations

from typing import Final

from detect.statuses import ErrorStatus, Severity
from plan.hardware import gpu_spec
from plan.perf import PerfAssumptions
from tests.unicornd.coord_world import GPN, task
from unicornd.goodput import Ledger, advance, new_ledger
from unicornd.state import (
    Incident,
    LadderStage,
    NodeHealth,
    NodeRecord,
    Snapshot,
    StageEntry,
    TaskRecord,
    TaskState,
)

T0: Final = 1_700_000_000.0
END: Final = 600.0
"""Seconds the script runs (the report's "now" is ``T0 + END``)."""
EVIL: Final = '<script>alert("c")</script>'
GPU: Final = gpu_spec("a100-80g")
ASSUME: Final = PerfAssumptions()
L = LadderStage

_INCIDENTS: Final = (
    ("gpt7b.1", "gpt7b", "n2", ErrorStatus.LOST_CONNECTION, Severity.SEV1,
     ((L.DETECTED, 200), (L.ISOLATE, 201), (L.REPLAN, 205), (L.TRANSITION, 206), (L.RESUMED, 222),
      (L.CLOSED, 230))),
    ("llama.1", "llama", "n3", ErrorStatus.EXITED_ABNORMALLY, Severity.SEV2,
     ((L.DETECTED, 400), (L.RESTART_PROCESSES, 401), (L.RESUMED, 410), (L.CLOSED, 412))),
    ("llama.2", "llama", "n3", ErrorStatus.NCCL_TIMEOUT, Severity.SEV3,
     ((L.DETECTED, 560), (L.RETRY_IN_PLACE, 561))),
)  # fmt: skip


def incident_at(spec: tuple[object, ...], at: float) -> Incident | None:
    """The incident as the snapshot holds it at ``at`` (None: not detected yet)."""
    inc_id, task_id, node, status, severity, stages = spec
    assert isinstance(stages, tuple)
    if stages[0][1] > at:
        return None
    first = T0 + stages[0][1]
    inc = Incident(
        str(inc_id), str(task_id), str(node), 0, status, severity, "rule", "evidence <&>", first,  # type: ignore[arg-type]
        timeline=(StageEntry(L.DETECTED, first),),
    )  # fmt: skip
    for stage, t in stages[1:]:
        if t <= at:
            inc = inc.moved(stage, T0 + t)
    return inc


def _gpt(at: float) -> TaskRecord:
    if at < 200:
        return task("gpt7b", 11, ["n1", "n2"], last_iteration=int(at), last_iteration_s=T0 + int(at))
    if at < 206:
        return task("gpt7b", 11, ["n1", "n2"], state=TaskState.RECOVERING, last_iteration=198,
                    last_iteration_s=T0 + 198)  # fmt: skip
    if at < 222:
        return task("gpt7b", 11, ["n1"], state=TaskState.RECOVERING, last_iteration=198,
                    last_iteration_s=T0 + 198, launched_s=T0 + 206)  # fmt: skip
    # Resumed from iteration 190 at 222, on one node at 2 s an iteration: past the mark at 240.
    it = 190 + int((at - 222) // 2)
    done = T0 + 222 + 2 * (it - 190)
    if it <= 198:
        it, done = 198, T0 + 198
    state = TaskState.RUNNING if at >= 230 else TaskState.RECOVERING
    return task(
        "gpt7b", 11, ["n1"], state=state, last_iteration=it, last_iteration_s=done, launched_s=T0 + 206
    )


def _llama(at: float) -> TaskRecord:
    if at < 400:
        it, done = int(at), T0 + int(at)
    elif at < 410:
        it, done = 398, T0 + 398
    else:
        it = 398 + int(min(at, 559) - 410)
        done = T0 + 410 + (it - 398)
    state = TaskState.RUNNING if at < 400 or 412 <= at < 560 else TaskState.RECOVERING
    return task("llama", 12, ["n3"], state=state, last_iteration=it, last_iteration_s=done)


def snapshot_at(at: float) -> Snapshot:
    """The snapshot ``at`` seconds after :data:`T0`."""
    waiting = task("c", 13, [], state=TaskState.PENDING, name=EVIL, last_iteration=None)
    tasks = [_gpt(at), _llama(at), waiting]
    nodes = {f"n{i}": NodeRecord(f"n{i}") for i in range(1, 6)}
    nodes["n5"] = NodeRecord("n5", jobs=(999,))
    if at >= 201:
        health = NodeHealth.DRAINED if at >= 205 else NodeHealth.DRAINING
        nodes["n2"] = NodeRecord(
            "n2", health, reason="node unreachable <ssh>", failures_s=(T0 + 201,), drains_s=(T0 + 201,),
            held=at >= 205,
        )  # fmt: skip
    incidents = [i for spec in _INCIDENTS if (i := incident_at(spec, at)) is not None]
    return Snapshot(
        tasks={t.task_id: t for t in tasks},
        nodes=nodes,
        gpus_per_node=GPN,
        incidents={i.incident_id: i for i in incidents},
    )


def scripted(step: float = 2.0) -> tuple[Snapshot, Ledger, float]:
    """(the snapshot at the end, the ledger advanced every ``step`` seconds over the
    script, now)."""
    ledger = new_ledger(T0)
    t = 0.0
    while t <= END:
        ledger = advance(ledger, snapshot_at(t), T0 + t, GPU, ASSUME)
        t += step
    return snapshot_at(END), ledger, T0 + END
