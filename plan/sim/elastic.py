"""Single-job fault-tolerant training systems Unicron compares with: Oobleck, Varuna, Bamboo.

Each task runs under its own instance of the system on a fixed allocation (the planner's
failure-free allocation for that system's throughput curves, :mod:`plan.sim.systems`). A
task that loses a node reconfigures onto the nodes it still holds plus free ones, up to
its allocation; a returning node goes to the first task that lost one (the same rule as
``per-task``: each job takes back what it lost; nobody plans across jobs).

What each system does, with the paper's section; the costs are in
:class:`~plan.sim.costs.ElasticCosts` (our measured detection and restart times where the
papers give none):

* **Oobleck** (Jang et al., SOSP'23, arXiv 2309.08125). Pipeline templates (Sec. 4.1) for
  n0 .. N - f n0 nodes, instantiated as >= f+1 pipelines covering every node with batch
  distribution (Sec. 4.2). After a failure it re-instantiates pipelines from the same
  templates on the nodes left (Sec. 5: re-instantiate, borrow, merge) and copies the
  missing layers' state from the other pipelines (Sec. 5.2): no checkpoint, only the
  iteration in flight is redone. We give it the best instantiation for the nodes left,
  an upper bound on its local repair. With fewer than (f+1) n0 nodes it cannot run.
* **Varuna** (Athlur et al., EuroSys'22, arXiv 2111.04007). Pipeline and data parallelism
  without tensor parallelism (Sec. 3). Job morphing (Sec. 4): on any change of the
  available GPUs its manager picks the best (P, D) for them, checkpoints, stops and
  relaunches. A planned morph (a node joins) checkpoints on demand first (SIGUSR1) and
  loses nothing; a failure restarts from the last persistent checkpoint.
* **Bamboo** (Thorpe et al., NSDI'23, arXiv 2204.12013). Redundant computation (Secs. 3-4):
  each node holds its successor's stage and runs its forward pass in the pipeline
  bubbles. When a node fails, its predecessor takes over its stage (failover): training
  goes on without a restart or rollback, slower, since one GPU now runs two stages. A
  second loss in a task already in failover, a task that cannot fail over, and returning
  nodes make it reconfigure its pipelines onto the nodes it has, from the in-memory
  states of the surviving replicas. Where the paper leaves the choice open we take the
  better of failover and an immediate reconfiguration, by the work each earns until the
  next expected failure (the planner's D_running), which can only help Bamboo.

Process and network faults (SEV2, SEV3) on a task that lost no node restart it on the
same nodes: from the surviving replicas' memory for Oobleck and Bamboo (the iteration in
flight is lost), from the last persistent checkpoint for Varuna.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from plan.objective import FailureModel
from plan.planner import plan_cluster
from plan.sim.costs import ElasticCosts
from plan.sim.policies import Policy, Workload, by_loss, hit_index, intact
from plan.sim.state import Action, Decision, Notice, Phase, Snapshot, TaskDecision, TaskView
from plan.sim.systems import RunConfig, bamboo_curve, oobleck_curve, oobleck_instance, varuna_curve
from plan.sim.trace import EventKind
from unicorn_core.errors import InvalidArgument

ELASTIC_NAMES: Final = ("oobleck", "varuna", "bamboo")
_FAILOVER = 1  # config[1] of a Bamboo task running in failover


class _ElasticPolicy:
    """What the three share: a fixed allocation, per-task reconfiguration, measured detection."""

    name = ""

    def __init__(self, workload: Workload, usable: int, costs: ElasticCosts) -> None:
        self.workload = workload
        self.costs = costs
        curves = workload.curves_from(
            [self.curve(i, workload.cluster.nodes) for i in range(len(workload.tasks))]
        )
        self.allocation = plan_cluster(curves, workload.cluster.with_nodes(usable)).allocation

    # --- the system -----------------------------------------------------------------------

    def curve(self, task: int, max_nodes: int) -> Sequence[RunConfig | None]:
        """The system's configuration on n = 0..max_nodes nodes (for the initial plan)."""
        raise NotImplementedError

    def config(self, task: int, nodes: int) -> RunConfig | None:
        """The configuration it runs on ``nodes`` nodes of its allocation."""
        return self.curve(task, self.workload.cluster.nodes)[nodes] if nodes > 0 else None

    def start(self, task: int, cfg: RunConfig | None, downtime_s: float, *, planned: bool) -> TaskDecision:
        raise NotImplementedError

    def reconfigure_s(self, task: int, cfg: RunConfig, *, in_place: bool) -> float:
        raise NotImplementedError

    # --- the policy -----------------------------------------------------------------------

    def detection_s(self, kind: EventKind) -> float:
        return self.costs.detection_s(kind)

    def gpus(self, nodes: int) -> int:
        return nodes * self.workload.gpus_per_node

    def initial(self, nodes: int) -> Decision:
        if sum(self.allocation) > nodes:
            raise InvalidArgument(f"{self.name}: allocation needs {sum(self.allocation)} of {nodes} nodes")
        return tuple(
            self.start(i, self.config(i, k), 0.0, planned=True) if k else TaskDecision(0, Action.RESTART)
            for i, k in enumerate(self.allocation)
        )

    def reconfigure(self, task: int, nodes: int, held: int, *, planned: bool) -> TaskDecision:
        """Onto ``nodes`` nodes; waiting on the ``held`` ones when the system cannot run there."""
        cfg = self.config(task, nodes)
        if cfg is None:
            return TaskDecision(held, Action.WAIT)
        return self.start(task, cfg, self.reconfigure_s(task, cfg, in_place=False), planned=planned)

    def on_hit(self, view: TaskView, task: int, free: int, notice: Notice) -> TaskDecision:
        """The task hit by a failure that took a node (or a fault on a task already short)."""
        nodes = min(self.allocation[task], view.held + free)
        return self.reconfigure(task, nodes, view.held, planned=False)

    def on_event(self, snapshot: Snapshot, notice: Notice, clock_s: float) -> Decision:
        hit = hit_index(snapshot, notice)
        views = snapshot.tasks
        out = [TaskDecision.keep(v) for v in views]
        free = snapshot.free
        if hit is not None:
            view = views[hit]
            if notice.kind in (EventKind.SEV2, EventKind.SEV3) and intact(view):
                cfg = self.config(hit, view.workers)
                if cfg is not None:
                    downtime = self.reconfigure_s(hit, cfg, in_place=True)
                    out[hit] = self.start(hit, cfg, downtime, planned=False)
                    return tuple(out)
            out[hit] = self.on_hit(view, hit, free, notice)
            free += view.held - out[hit].nodes
        if notice.kind is EventKind.NODE_RETURN:
            short = [
                i
                for i, v in enumerate(views)
                if i != hit and v.phase is not Phase.DETECTING and v.held < self.allocation[i]
            ]
            for i in by_loss(views, short):
                view = views[i]
                nodes = min(self.allocation[i], view.held + free)
                if nodes <= view.held:
                    continue
                cfg = self.config(i, nodes)
                if cfg is None or (view.phase is Phase.RUNNING and cfg.tflops <= self._tflops_now(i, view)):
                    continue
                out[i] = self.reconfigure(i, nodes, view.held, planned=True)
                free -= nodes - view.held
                break  # one node returns: the first task short of nodes takes it
        return tuple(out)

    def _tflops_now(self, task: int, view: TaskView) -> float:
        cfg = self.config(task, view.workers)
        return cfg.tflops if cfg is not None else 0.0


class OobleckPolicy(_ElasticPolicy):
    """Oobleck: pipeline templates, re-instantiated on the nodes left from replicas' state."""

    name = "oobleck"

    def curve(self, task: int, max_nodes: int) -> Sequence[RunConfig | None]:
        w = self.workload
        return oobleck_curve(w.tasks[task].model, w.gpu, w.gpus_per_node, max_nodes, self.costs.oobleck_f)

    def config(self, task: int, nodes: int) -> RunConfig | None:
        if nodes <= 0 or self.allocation[task] <= 0:
            return None
        w = self.workload
        model = w.tasks[task].model
        return oobleck_instance(
            model, w.gpu, w.gpus_per_node, nodes, f=self.costs.oobleck_f, allocation=self.allocation[task]
        )

    def reconfigure_s(self, task: int, cfg: RunConfig, *, in_place: bool) -> float:
        m = self.costs.measured
        restart = m.restart_in_place_s if in_place else m.relaunch_s
        return restart + self.costs.state_copy_s(self.workload.tasks[task].model, cfg.gpus)

    def start(self, task: int, cfg: RunConfig | None, downtime_s: float, *, planned: bool) -> TaskDecision:
        if cfg is None:
            return TaskDecision(0, Action.RESTART, downtime_s)
        waf = self.workload.weighted(task, cfg)
        # the state lives in the other pipelines: a failure redoes the iteration in flight
        return TaskDecision(
            cfg.nodes, Action.RESTART, downtime_s, cfg.iteration_s, waf_tflops=waf, config=cfg.pipelines
        )


class VarunaPolicy(_ElasticPolicy):
    """Varuna: job morphing to the best (P, D) for the GPUs there, restarts from checkpoints."""

    name = "varuna"

    def curve(self, task: int, max_nodes: int) -> Sequence[RunConfig | None]:
        w = self.workload
        return varuna_curve(w.tasks[task].model, w.gpu, w.gpus_per_node, max_nodes)

    def reconfigure_s(self, task: int, cfg: RunConfig, *, in_place: bool) -> float:
        # the manager relaunches the job and every rank loads its share of the checkpoint
        return self.costs.measured.relaunch_s + self.costs.checkpoint_load_s(
            self.workload.tasks[task].model, cfg.gpus
        )

    def start(self, task: int, cfg: RunConfig | None, downtime_s: float, *, planned: bool) -> TaskDecision:
        if cfg is None:
            return TaskDecision(0, Action.RESTART, downtime_s)
        model = self.workload.tasks[task].model
        if planned and downtime_s > 0:  # morphing: an on-demand checkpoint first
            downtime_s += self.costs.checkpoint_save_s(model, cfg.gpus)
        stall = self.costs.varuna_stall_fraction(model, cfg.gpus)
        interval = self.costs.varuna_checkpoint_interval_s / (1.0 - stall)
        waf = self.workload.weighted(task, cfg) * (1.0 - stall)
        return TaskDecision(
            cfg.nodes, Action.RESTART, downtime_s, interval, waf_tflops=waf, config=(cfg.gpus,)
        )


class BambooPolicy(_ElasticPolicy):
    """Bamboo: redundant computation; fail over to the predecessor, reconfigure when it cannot."""

    name = "bamboo"

    def __init__(
        self, workload: Workload, usable: int, costs: ElasticCosts, failure: FailureModel | None = None
    ) -> None:
        super().__init__(workload, usable, costs)
        self.failure = failure or FailureModel()

    def curve(self, task: int, max_nodes: int) -> Sequence[RunConfig | None]:
        w = self.workload
        return bamboo_curve(w.tasks[task].model, w.gpu, w.gpus_per_node, max_nodes)

    def reconfigure_s(self, task: int, cfg: RunConfig, *, in_place: bool) -> float:
        m = self.costs.measured
        restart = m.restart_in_place_s if in_place else m.relaunch_s
        return restart + self.costs.state_copy_s(self.workload.tasks[task].model, cfg.gpus)

    def start(self, task: int, cfg: RunConfig | None, downtime_s: float, *, planned: bool) -> TaskDecision:
        if cfg is None:
            return TaskDecision(0, Action.RESTART, downtime_s)
        waf = self.workload.weighted(task, cfg)
        return TaskDecision(
            cfg.nodes, Action.RESTART, downtime_s, cfg.iteration_s, waf_tflops=waf, config=(cfg.nodes, 0)
        )

    def failover(self, task: int, view: TaskView) -> TaskDecision | None:
        """Keep going on the nodes left, a predecessor running its lost successor's stage."""
        if view.config[1:] == (_FAILOVER,) or view.held < 1:
            return None  # a second loss: no redundant copy is left for the stage
        cfg = self.config(task, view.workers)
        if cfg is None or cfg.failover_tflops <= 0:
            return None
        spec = self.workload.tasks[task]
        waf = spec.weight * cfg.failover_tflops
        pause = self.costs.measured.restart_in_place_s
        return TaskDecision(
            view.held,
            Action.RESTART,
            pause,
            cfg.iteration_s,
            waf_tflops=waf,
            config=(view.workers, _FAILOVER),
        )

    def on_hit(self, view: TaskView, task: int, free: int, notice: Notice) -> TaskDecision:
        reconfigured = super().on_hit(view, task, free, notice)
        over = self.failover(task, view) if notice.kind is EventKind.SEV1 else None
        if over is None:
            return reconfigured
        horizon = self.failure.running_s(max(view.held, 1))

        def work(d: TaskDecision) -> float:
            if d.action is not Action.RESTART or d.waf_tflops is None:
                return 0.0
            return d.waf_tflops * max(horizon - d.downtime_s, 0.0)

        return over if work(over) >= work(reconfigured) else reconfigured


def make_elastic(name: str, workload: Workload, usable: int, costs: ElasticCosts) -> Policy:
    """The elastic baseline called ``name`` (one of :data:`ELASTIC_NAMES`)."""
    if name == "oobleck":
        return OobleckPolicy(workload, usable, costs)
    if name == "varuna":
        return VarunaPolicy(workload, usable, costs)
    if name == "bamboo":
        return BambooPolicy(workload, usable, costs)
    raise InvalidArgument(f"unknown elastic policy {name!r}; known: {', '.join(ELASTIC_NAMES)}")
