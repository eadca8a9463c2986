"""Discrete-event replay of a trace under one policy, with Unicron's cost accounting (Eq. 1).

The ideal is the limit no policy can pass: the same tasks with no failures, each on its
best layout, in the planner's best allocation of the whole cluster, earning W* at every
instant. The gap to it splits exactly into four causes:

* steady state: W* minus the policy's own failure-free WAF (layouts its system cannot
  run, its fixed allocation, redundant computation, checkpoint stalls);
* detection: F of the tasks hit but not yet noticed (hung or dead);
* transition: F of the tasks restarting or reconfiguring, and of those recomputing the
  work lost since their last restore point (lost work is redone at the new rate);
* sub-healthy: the policy's failure-free WAF minus the WAF of the allocation in force
  (nodes down, fewer nodes, a worse split, tasks waiting for nodes).

So accumulated WAF + the four losses = W* x duration, always, and the fraction of the
ideal is accumulated WAF / (W* x duration).
Node bookkeeping: a decision's node counts are mapped onto node ids stickily: a task
keeps its nodes, shrinking tasks release their highest ids, growing tasks take the
lowest free ids. The task nodes of the initial allocation are assigned in workload order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from plan.planner import plan_cluster
from plan.sim.policies import Policy, Workload
from plan.sim.state import (
    Action,
    Decision,
    Notice,
    Phase,
    Snapshot,
    TaskDecision,
    TaskView,
    check_transition,
)
from plan.sim.trace import EventKind, Trace, TraceEvent
from unicorn_core.errors import InvalidArgument


class Cause(StrEnum):
    """Why WAF was lost (Unicron Eq. 1)."""

    STEADY_STATE = "steady_state"
    DETECTION = "detection"
    TRANSITION = "transition"
    SUB_HEALTHY = "sub_healthy"


@dataclass(frozen=True)
class SimResult:
    """One policy's replay of one trace. Work is in weighted TFLOP (weighted TFLOP/s x s)."""

    policy: str
    trace: str
    duration_s: float
    ideal_waf_tflops: float  # W*: the best failure-free WAF of the workload on the whole cluster
    own_waf_tflops: float  # the policy's own failure-free WAF (its initial configuration)
    accumulated_wtflop: float
    lost_wtflop: dict[Cause, float]
    times_s: tuple[float, ...]  # earned WAF is waf_tflops[i] from times_s[i] until the next time
    waf_tflops: tuple[float, ...]
    decisions: int  # how many times the policy was asked

    @property
    def ideal_wtflop(self) -> float:
        return self.ideal_waf_tflops * self.duration_s

    @property
    def fraction_of_ideal(self) -> float:
        """Accumulated WAF / (W* x duration): 1 only without failures, stalls or layout limits."""
        ideal = self.ideal_wtflop
        return self.accumulated_wtflop / ideal if ideal > 0 else 0.0


@dataclass(frozen=True)
class _Detected:
    """The policy learns of ``event``; ``task`` is the task it hit, if any."""

    event: TraceEvent
    task: int | None


@dataclass(frozen=True)
class _PhaseEnd:
    """A task's timed phase ends, unless its ``version`` moved on meanwhile."""

    task: int
    version: int


_Payload = TraceEvent | _Detected | _PhaseEnd


@dataclass
class _Task:
    name: str
    index: int
    phase: Phase = Phase.IDLE
    workers: int = 0
    waf: float = 0.0  # weighted TFLOP/s of its configuration while it trains
    held: list[int] = field(default_factory=list)
    debt_wtflop: float = 0.0  # work to redo; while RECOMPUTING, what was owed when it began
    process_start_s: float = 0.0  # when the current process started training (checkpoint clock)
    phase_end_s: float = math.inf
    interval_s: float = math.inf  # restore points against a lost node
    lag_s: float = 0.0  # ... usable this long after they are taken
    jit_interval_s: float = math.inf  # restore points against a process or network fault
    config: tuple[int, ...] = ()
    lost_at_s: float | None = None
    version: int = 0  # bumped on every phase change: stale PHASE_END entries are dropped


class _Replay:
    def __init__(self, trace: Trace, workload: Workload, policy: Policy) -> None:
        if trace.nodes != workload.cluster.nodes:
            raise InvalidArgument(
                f"trace {trace.name!r} has {trace.nodes} nodes, "
                f"the workload's cluster {workload.cluster.nodes}"
            )
        self.trace, self.workload, self.policy = trace, workload, policy
        self.tasks = [_Task(name, i) for i, name in enumerate(workload.names)]
        self.up = [True] * trace.nodes
        self.owner: list[int | None] = [None] * trace.nodes
        self.queue: list[tuple[float, int, _Payload]] = []
        self.seq = 0
        self.now = 0.0
        self.ideal = workload.ideal_waf()
        self.own = 0.0
        self.earned = 0.0
        self.lost = dict.fromkeys(Cause, 0.0)
        self.times: list[float] = []
        self.rates: list[float] = []
        self.decisions = 0

    # --- accounting -------------------------------------------------------------------

    def rate(self, task: _Task) -> float:
        return task.waf if task.workers > 0 else 0.0

    def advance(self, t: float) -> None:
        dt = t - self.now
        if dt < 0:
            raise InvalidArgument(f"time went back from {self.now} to {t}")
        earned = detecting = transition = in_force = 0.0
        for task in self.tasks:
            r = self.rate(task)
            in_force += r
            if task.phase is Phase.RUNNING:
                earned += r
            elif task.phase is Phase.DETECTING:
                detecting += r
            elif task.phase in (Phase.RESTARTING, Phase.RECOMPUTING):
                transition += r
        if not self.rates or self.rates[-1] != earned:
            self.times.append(self.now)
            self.rates.append(earned)
        self.earned += earned * dt
        self.lost[Cause.DETECTION] += detecting * dt
        self.lost[Cause.TRANSITION] += transition * dt
        self.lost[Cause.STEADY_STATE] += (self.ideal - self.own) * dt
        self.lost[Cause.SUB_HEALTHY] += (self.own - in_force) * dt
        self.now = t

    # --- events -------------------------------------------------------------------------

    def push(self, t: float, payload: _Payload) -> None:
        heapq.heappush(self.queue, (t, self.seq, payload))
        self.seq += 1

    def set_phase(self, task: _Task, phase: Phase) -> None:
        check_transition(task.name, task.phase, phase)
        task.phase = phase
        task.version += 1
        task.phase_end_s = math.inf

    def pending_debt(self, task: _Task) -> float:
        """Work still owed if the task stopped now, its state saved (a planned transition)."""
        if task.phase is Phase.RECOMPUTING:
            return self.rate(task) * max(task.phase_end_s - self.now, 0.0)
        if task.phase is Phase.RUNNING:
            return 0.0
        return task.debt_wtflop

    def fail(self, task: _Task, node_lost: bool) -> None:
        """The task's processes die: work since the last usable restore point joins its debt."""
        if task.phase in (Phase.RUNNING, Phase.RECOMPUTING):
            since = self.now - task.process_start_s
            interval, lag = (task.interval_s, task.lag_s) if node_lost else (task.jit_interval_s, 0.0)
            # the newest restore point k x interval that was usable by now (k x interval + lag);
            # none yet: back to the state the process started from
            usable = math.floor((since - lag) / interval) if math.isfinite(interval) and since >= lag else 0
            lost = since - usable * interval
            task.debt_wtflop = self.pending_debt(task) + self.rate(task) * lost
        self.set_phase(task, Phase.DETECTING)

    def on_trace(self, event: TraceEvent) -> None:
        if event.kind is EventKind.NODE_RETURN:
            self.up[event.node] = True
            self.notify(Notice(event.kind, event.node, None))
            return
        owner = self.owner[event.node]
        task = self.tasks[owner] if owner is not None else None
        if event.kind is EventKind.SEV1:
            self.up[event.node] = False
            self.owner[event.node] = None
            if task is not None:
                task.held.remove(event.node)
                task.lost_at_s = self.now
        running = task is not None and task.phase in (Phase.RUNNING, Phase.RECOMPUTING)
        if task is not None and event.kind is EventKind.SEV1 and task.phase is Phase.RESTARTING:
            running = True  # the restart dies with the node
        if running and task is not None:
            self.fail(task, event.kind is EventKind.SEV1)
            self.push(self.now + self.policy.detection_s(event.kind), _Detected(event, task.index))
        elif event.kind is EventKind.SEV1:
            # a free node, or one held by a task that is not running: nothing hangs
            pending = task is not None and task.phase is Phase.DETECTING
            delay = self.policy.detection_s(event.kind) if pending else 0.0
            self.push(self.now + delay, _Detected(event, task.index if pending and task else None))
        # a SEV2/SEV3 on a node where nothing runs has no effect

    def on_detected(self, event: TraceEvent, index: int | None) -> None:
        task = self.tasks[index] if index is not None else None
        hit = task.name if task is not None and task.phase is Phase.DETECTING else None
        self.notify(Notice(event.kind, event.node, hit))

    def on_phase_end(self, task: _Task) -> None:
        if task.phase is Phase.RESTARTING:
            task.process_start_s = self.now
            rate = self.rate(task)
            if task.debt_wtflop > 0 and rate > 0:
                self.set_phase(task, Phase.RECOMPUTING)
                task.phase_end_s = self.now + task.debt_wtflop / rate
                self.push(task.phase_end_s, _PhaseEnd(task.index, task.version))
            else:
                self.set_phase(task, Phase.RUNNING)
        elif task.phase is Phase.RECOMPUTING:
            task.debt_wtflop = 0.0
            self.set_phase(task, Phase.RUNNING)

    # --- decisions ----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        healthy = sum(self.up)
        held = sum(len(t.held) for t in self.tasks)
        views = tuple(
            TaskView(t.name, t.phase, t.workers, len(t.held), t.lost_at_s, t.config) for t in self.tasks
        )
        return Snapshot(self.now, self.trace.nodes, healthy, healthy - held, views)

    def notify(self, notice: Notice) -> None:
        decision = self.policy.on_event(self.snapshot(), notice, self.now)
        self.decisions += 1
        self.apply(decision, notice.task)

    def _check(self, decision: Decision, hit: str | None) -> None:
        if len(decision) != len(self.tasks):
            raise InvalidArgument(
                f"{self.policy.name}: {len(decision)} decisions for {len(self.tasks)} tasks"
            )
        total = sum(d.nodes for d in decision)
        if total > sum(self.up):
            raise InvalidArgument(
                f"{self.policy.name}: decision uses {total} of {sum(self.up)} healthy nodes"
            )
        for task, d in zip(self.tasks, decision, strict=True):
            if d.action is Action.KEEP and (d.nodes != len(task.held) or task.name == hit):
                raise InvalidArgument(
                    f"{self.policy.name}: KEEP for {task.name!r} must keep its {len(task.held)} nodes "
                    "and cannot leave the task hit unhandled"
                )

    def assign_nodes(self, decision: Decision) -> None:
        for task, d in zip(self.tasks, decision, strict=True):
            while len(task.held) > d.nodes:
                node = task.held.pop()  # held is sorted: release the highest ids
                self.owner[node] = None
        free = [n for n in range(self.trace.nodes) if self.up[n] and self.owner[n] is None]
        free.reverse()
        for task, d in zip(self.tasks, decision, strict=True):
            while len(task.held) < d.nodes:
                node = free.pop()
                self.owner[node] = task.index
                task.held.append(node)
            task.held.sort()

    def apply(self, decision: Decision, hit: str | None) -> None:
        self._check(decision, hit)
        self.assign_nodes(decision)
        for task, d in zip(self.tasks, decision, strict=True):
            if d.action is Action.KEEP:
                continue
            if task.phase in (Phase.RUNNING, Phase.RECOMPUTING):
                task.debt_wtflop = self.pending_debt(task)  # a planned stop saves its state
            if d.action is Action.WAIT:
                task.workers = 0
                task.config = d.config
                self.set_phase(task, Phase.WAITING)
            else:
                self.start(task, d)

    def start(self, task: _Task, d: TaskDecision) -> None:
        task.workers = d.nodes
        task.waf = self.workload.waf(task.index, d.nodes) if d.waf_tflops is None else d.waf_tflops
        task.interval_s = d.checkpoint_interval_s
        task.lag_s = d.checkpoint_lag_s
        task.jit_interval_s = d.checkpoint_interval_s if d.jit_interval_s is None else d.jit_interval_s
        task.config = d.config
        if d.nodes == 0 or self.rate(task) <= 0:
            self.set_phase(task, Phase.IDLE)
            return
        self.set_phase(task, Phase.RESTARTING)
        if d.downtime_s > 0:
            task.phase_end_s = self.now + d.downtime_s
            self.push(task.phase_end_s, _PhaseEnd(task.index, task.version))
        else:
            self.on_phase_end(task)

    # --- main loop ------------------------------------------------------------------------

    def run(self, progress: Callable[[int], None] | None) -> SimResult:
        self.apply(self.policy.initial(self.trace.nodes), None)
        self.own = sum(self.rate(t) for t in self.tasks)
        for event in self.trace.events:
            self.push(event.time_s, event)
        end = self.trace.duration_s
        while self.queue and self.queue[0][0] <= end:
            t, _, payload = heapq.heappop(self.queue)
            if isinstance(payload, _PhaseEnd):
                task = self.tasks[payload.task]
                if payload.version != task.version:
                    continue
                self.advance(t)
                self.on_phase_end(task)
            elif isinstance(payload, _Detected):
                self.advance(t)
                self.on_detected(payload.event, payload.task)
            else:
                self.advance(t)
                self.on_trace(payload)
                if progress is not None:
                    progress(1)
        self.advance(end)
        return SimResult(
            policy=self.policy.name,
            trace=self.trace.name,
            duration_s=end,
            ideal_waf_tflops=self.ideal,
            own_waf_tflops=self.own,
            accumulated_wtflop=self.earned,
            lost_wtflop=dict(self.lost),
            times_s=tuple(self.times),
            waf_tflops=tuple(self.rates),
            decisions=self.decisions,
        )


def node_bound_wtflop(trace: Trace, workload: Workload) -> float:
    """The most any policy can earn on ``trace``: at every instant the best failure-free
    allocation of the nodes up then, with free and instant detection and reconfiguration.

    The gap between it and the ideal is the work of the nodes that are down: no policy
    can recover it.
    """
    best: dict[int, float] = {}

    def waf(up: int) -> float:
        if up not in best:
            best[up] = plan_cluster(workload.curves, workload.cluster.with_nodes(up)).total_waf_tflops
        return best[up]

    up, t, total = trace.nodes, 0.0, 0.0
    for event in trace.events:
        total += waf(up) * (event.time_s - t)
        t = event.time_s
        if event.kind is EventKind.SEV1:
            up -= 1
        elif event.kind is EventKind.NODE_RETURN:
            up += 1
    return total + waf(up) * (trace.duration_s - t)


def simulate(
    trace: Trace, workload: Workload, policy: Policy, progress: Callable[[int], None] | None = None
) -> SimResult:
    """Replay ``trace`` under ``policy``; ``progress(n)`` is called as trace events are processed."""
    return _Replay(trace, workload, policy).run(progress)
