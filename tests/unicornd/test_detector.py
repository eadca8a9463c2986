"""unicornd's detector on agent messages that race a restart."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from detect.classify import NEAREST_RULE, load_classifier
from detect.statuses import ErrorStatus
from tests.unicornd.coord_world import apply, of_kind, task, world
from unicorn_core.config import AgentConfig, DetectConfig
from unicorn_core.protocol import (
    AgentAction,
    ExceptionReport,
    FaultReport,
    Heartbeat,
    IterationPhase,
    IterationTiming,
    ProcessExit,
    SlowStep,
    decode,
    encode,
)
from unicornd.actions import CheckNode, Decision, DrainNode, LaunchAgents, NodeArgv, Requeue, SendCommand
from unicornd.decide import Finding, on_finding
from unicornd.detector import Detector
from unicornd.state import LadderStage, NodeHealth, Policy, RequeueWait, Snapshot, TaskState


def timing(rank: int, iteration: int, node: str = "n1") -> IterationTiming:
    return IterationTiming(
        job_id=4, node=node, wall_time_s=1.0, rank=rank, iteration=iteration, duration_s=0.1, samples=12
    )


def slow(rank: int, iteration: int) -> SlowStep:
    return SlowStep(
        job_id=4, node="n1", wall_time_s=1.0, rank=rank, iteration=iteration, phase=IterationPhase.CHECKPOINT
    )


def test_a_slow_step_announced_by_a_rank_the_restart_forgot_is_ignored() -> None:
    """Seen in CI: scancel made the old ranks announce their SIGTERM save just after the
    job's restart had dropped its timing; the announcement raised and stopped unicornd."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    assert d.on_message(timing(0, 3), 10.0) == [] and d.on_message(timing(1, 3), 10.0) == []
    assert d.on_message(slow(1, 4), 10.1) == []  # a known rank: its next step may be slow
    d.restart_job(4)
    assert d.on_message(slow(1, 4), 10.2) == []  # stale: nothing to extend, no error
    assert d.on_message(timing(0, 4), 10.3) == [] and d.last_iteration(4) == 4


def test_a_hang_names_the_node_of_the_stopped_rank() -> None:
    """Not the task's first node: the rank that stopped reporting ran on n2."""
    d = Detector(DetectConfig(warmup_iterations=1), AgentConfig(), load_classifier(None))
    now = 10.0
    for it in range(1, 30):
        now += 0.1
        d.on_message(timing(0, it, "n1"), now)
        if it < 20:
            d.on_message(timing(1, it, "n2"), now)
    found = []
    while not found and now < 200:
        now += 0.5
        found = d.check(now)
    assert found and found[0].evidence.source == "hang"
    assert found[0].evidence.rank == 1 and found[0].evidence.node == "n2", found


def test_silence_is_measured_up_to_what_the_reader_has_heard() -> None:
    """Found at 4,096 nodes: after a pause of unicornd's loop the ticker woke before the
    reader had caught up, and reports waiting in Redis counted as the ranks' silence. Once
    a reader reports its progress (heard_until), neither a lost heartbeat nor a stalled
    iteration is found past it, and the horizon never moves back."""
    cfg = DetectConfig(warmup_iterations=1, heartbeat_timeout_s=5.0)
    d = Detector(cfg, AgentConfig(), load_classifier(None))
    now = 10.0
    for it in range(1, 30):
        now += 0.1
        d.on_message(timing(0, it), now)
        d.on_message(beat("n1", None), now)
    d.heard_until(now)
    later = now + 60.0  # the clock ran on, the reader did not
    assert d.check(later) == [] and not d.silent(4, "n1", later)
    d.heard_until(now - 5.0)  # an older horizon changes nothing
    d.heard_until(now + 6.0)  # read to the end 6 s on: nothing came, so the agent is lost
    found = {f.evidence.source for f in d.check(later)}
    assert found == {"heartbeat", "hang"} and d.silent(4, "n1", later)


def beat(node: str, cpu_wait_s: float | None) -> Heartbeat:
    return Heartbeat(
        job_id=4,
        node=node,
        wall_time_s=1.0,
        agent_pid=1,
        pids=[],
        iteration=None,
        seq=0,
        cpu_wait_s=cpu_wait_s,
    )


def test_a_stall_while_a_node_waits_for_a_cpu_is_no_hang_and_is_reported_once() -> None:
    """Seen in scripts/bench/detection.py: a CPU hog on the node; the ranks fell silent for
    3 mean iterations, most of it runnable but off the CPU. Once the heartbeats say so it
    is no hang; when the wait stops growing it is, reported once even though rank 0
    (not stalled) goes on."""
    d = Detector(DetectConfig(warmup_iterations=1), AgentConfig(), load_classifier(None))
    now = 10.0
    for it in range(1, 30):
        now += 0.1
        d.on_message(timing(0, it, "n1"), now)
        d.on_message(timing(1, it, "n2"), now)
    d.on_message(beat("n1", 0.0), now)
    d.on_message(beat("n2", 5.0), now)
    d.on_message(beat("n1", 0.0), now + 0.4)
    d.on_message(beat("n2", 5.25), now + 0.4)
    assert d.check(now + 0.4) == []  # silent 0.4 s (4 x 0.1 s), 0.25 s of it starved on n2
    d.on_message(beat("n1", 0.0), now + 0.6)
    d.on_message(beat("n2", 5.25), now + 0.6)  # no more waiting: 0.35 s of work, > 0.2 s
    found = d.check(now + 0.6)
    assert [f.classification.status for f in found] == [ErrorStatus.TASK_HANG]
    assert "0.25 s of it waiting for a CPU" in found[0].classification.evidence
    d.on_message(timing(0, 30, "n1"), now + 0.7)  # rank 0 goes on; rank 1 is still stuck at 29
    assert d.check(now + 0.8) == []


def test_an_agent_stopped_on_purpose_holds_no_verdict_back() -> None:
    d = Detector(DetectConfig(warmup_iterations=1), AgentConfig(), load_classifier(None))
    now = 10.0
    for it in range(1, 30):
        now += 0.1
        d.on_message(timing(0, it, "n1"), now)
    d.on_message(beat("n1", 0.0), now)
    d.on_message(beat("n2", 0.0), now)  # n2's agent beats, then is stopped
    d.on_message(beat("n1", 0.0), now + 1.0)
    assert d.check(now + 1.0) == []  # n2 has not reported for the silence yet
    d.forget_agent(4, "n2")
    assert [f.classification.status for f in d.check(now + 1.0)] == [ErrorStatus.TASK_HANG]


def test_cpu_wait_is_an_additive_heartbeat_field() -> None:
    """Agents from before the field send heartbeats without it: read as None (wall clock only)."""
    old = msgspec.msgpack.encode(
        {"type": "hb", "v": 1, "job_id": 4, "node": "n1", "wall_time_s": 1.0, "agent_pid": 1, "pids": [],
         "iteration": None, "seq": 0}
    )  # fmt: skip
    decoded = decode(old)
    assert isinstance(decoded, Heartbeat) and decoded.cpu_wait_s is None
    assert decode(encode(beat("n1", 2.5))) == beat("n1", 2.5)
    with pytest.raises(ValueError, match="cpu_wait_s"):
        beat("n1", -1.0)


def loss(iteration: int, value: float, launch: str) -> IterationTiming:
    return msgspec.structs.replace(timing(0, iteration), loss=value, launch_id=launch)


def test_a_replaced_launchs_loss_report_does_not_hide_the_new_ranks_report() -> None:
    """Seen in the repeated-spike system test: after a roll back was decided, the old ranks
    (still running until their agent stops them) reported iteration K+1; the detector took
    K+1 as judged and the rolled-back ranks' spike at K+1 went unseen."""
    d = Detector(DetectConfig(loss_warmup=5), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    launch = LaunchAgents("plan-1/launch/4", "a", 4, (NodeArgv("n1", ("train",)),))
    d.follow(empty, empty, Decision(actions=(launch,)), 1.0)
    for k in range(1, 11):
        assert d.on_message(loss(k, 2.0 - 0.01 * k, launch.action_id), 1.0 + k) == []
    restart = SendCommand("inc.1/rollback/n1", 4, "n1", AgentAction.RESTART_RANKS, deadline_s=60.0)
    d.follow(empty, empty, Decision(actions=(restart,)), 12.0)
    assert d.on_message(loss(11, 1.9, launch.action_id), 12.1) == []  # the old ranks: not judged
    found = d.on_message(loss(11, 9.0, restart.action_id), 20.0)  # the new ranks spike at 11
    assert [f.evidence.classification.status for f in found] == [ErrorStatus.LOSS_SPIKE]
    assert found[0].launch_id == restart.action_id


def stamped(rank: int, iteration: int, node: str, launch: str) -> IterationTiming:
    return msgspec.structs.replace(timing(rank, iteration, node), launch_id=launch)


def steady(d: Detector, nodes: tuple[str, ...], now: float) -> tuple[float, Snapshot]:
    """Iterations 1-19 every 0.1 s, rank i on ``nodes[i]``, each node beating (no CPU wait);
    returns the clock after them and a snapshot of the job's task on n1 and n2."""
    for it in range(1, 20):
        now += 0.1
        for rank, node in enumerate(nodes):
            d.on_message(timing(rank, it, node), now)
            d.on_message(beat(node, 0.0), now)
    return now, Snapshot(tasks={"t": task("t", 4, ("n1", "n2"))}, nodes={}, gpus_per_node=8)


def test_a_replaced_or_stopped_launchs_ranks_are_not_watched_by_the_new_layout() -> None:
    """Found in CI (the paired-check system test): a 4-rank job went on with 3 ranks; the
    old rank 3, still running until its agent stopped it, reported one more iteration after
    the relaunch and was watched from then on; once the new layout's timing was learned it
    was judged hung ("rank 3 reported no iteration for 9.81 s") and, with no restarts
    left, the task was stopped. A replaced launch's reports (another launch id) and a
    stopped agent's never reach the new monitor; the new ranks' own stall is still found."""
    d = Detector(DetectConfig(warmup_iterations=1), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    nodes = ("n1", "n2", "n3", "n4")
    first = LaunchAgents("plan-1/launch/4", "a", 4, tuple(NodeArgv(n, ("train",)) for n in nodes))
    d.follow(empty, empty, Decision(actions=(first,)), 1.0)
    now = 1.0
    for it in range(1, 10):
        now += 0.1
        for rank, node in enumerate(nodes):
            d.on_message(stamped(rank, it, node, first.action_id), now)
    stop = SendCommand("inc.1/stop/n2", 4, "n2", AgentAction.STOP, deadline_s=60.0)
    new = [
        SendCommand(f"plan-2/relaunch/{n}", 4, n, AgentAction.RELAUNCH, deadline_s=60.0)
        for n in ("n1", "n3", "n4")
    ]
    d.follow(empty, empty, Decision(actions=(stop, *new)), now)
    now += 0.05
    d.on_message(stamped(3, 10, "n4", first.action_id), now)  # the old rank 3, replaced
    d.on_message(stamped(1, 10, "n2", first.action_id), now)  # the old rank 1, its agent stopped
    assert d.last_iteration(4) is None  # neither counts as the new layout's progress
    for it in range(5, 40):
        now += 0.1
        for rank, cmd in enumerate(new):
            d.on_message(stamped(rank, it, cmd.node, cmd.action_id), now)
    assert d.check(now + 0.1) == [] and d.last_iteration(4) == 39
    now += 0.1
    for rank, cmd in enumerate(new[:2]):  # rank 2 (n4) stops reporting
        d.on_message(stamped(rank, 40, cmd.node, cmd.action_id), now)
    found = d.check(now + 1.0)
    assert [(f.evidence.rank, f.evidence.node) for f in found] == [(2, "n4")], found


def test_an_unstamped_report_after_unicornd_relaunched_the_node_is_the_old_ranks() -> None:
    """Found by the scale bench (t039 at 326 s, t121 at 1,059 s of every 4,096-node run): agents
    started without a launch id (a job's first agents) report unstamped; those reports, read
    after the job's relaunch committed, taught the new launch's monitor the old mean, and the
    new ranks' start-up was judged a stall at 2 x that mean. Every launch unicornd makes
    stamps its reports, so an unstamped one on a node it relaunched is the old ranks'. A
    node unicornd never launched on keeps counting its unstamped reports."""
    d = Detector(DetectConfig(warmup_iterations=1), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    now = 1.0
    for it in range(1, 10):
        now += 0.1
        d.on_message(stamped(0, it, "n1", ""), now)
    assert d.last_iteration(4) == 9  # unstamped, nothing launched by unicornd: counted
    relaunch = SendCommand("plan-2/relaunch/n1", 4, "n1", AgentAction.RELAUNCH, deadline_s=60.0)
    d.follow(empty, empty, Decision(actions=(relaunch,)), now)
    for it in range(10, 13):  # the old ranks, until the agent stops them
        now += 0.1
        d.on_message(stamped(0, it, "n1", ""), now)
    assert d.last_iteration(4) is None
    now += 30.0
    assert d.check(now) == []  # nothing learned from them: the new ranks' start-up is no stall
    for it in range(10, 20):
        now += 0.1
        d.on_message(stamped(0, it, "n1", relaunch.action_id), now)
    assert d.last_iteration(4) == 19


def test_a_rolled_back_task_is_judged_leniently_until_its_noise_is_learned() -> None:
    """Likely what failed CI (test_loss_rollback): 2 s after a roll back resumed, rank 1 was
    called hung, judged at 2 x a mean learned from the first 5 steps of the restored ranks
    on a loaded machine, and the task was restarted a second time. Until 16 iterations'
    noise is in, a rank is allowed max_hang_factor x the mean; a rank that stops is still found;
    once the noise is learned, the default factor is back."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    now = 10.0

    def step(it: int, launches: tuple[str, str], dt: float = 0.2) -> None:
        nonlocal now
        now += dt
        for rank, (node, launch) in enumerate(zip(("n1", "n2"), launches, strict=True)):
            msg = msgspec.structs.replace(stamped(rank, it, node, launch), duration_s=0.2)
            d.on_message(msg, now)

    for it in range(1, 32):
        step(it, ("", ""))
    rollback = [
        SendCommand(f"plan-2/relaunch/{n}", 4, n, AgentAction.RELAUNCH, deadline_s=60.0) for n in ("n1", "n2")
    ]
    d.follow(empty, empty, Decision(actions=tuple(rollback)), now)
    new = (rollback[0].action_id, rollback[1].action_id)
    for it in range(31, 40):  # the restored ranks: warm-up, then the mean from 5 steps
        step(it, new)
    now += 0.7  # 3.5 x the mean: jitter of a loaded machine, not a hang
    assert d.check(now) == []
    step(40, new, dt=0.0)
    stopped, found = now, []
    while not found and now < 60:  # both ranks stop: found after 4 x the mean
        now += 0.05
        found = d.check(now)
    assert [f.evidence.source for f in found] == ["hang"] and 0.8 < now - stopped <= 0.85 + 1e-9
    for it in range(41, 75):
        step(it, new)
    now += 0.45  # 2.25 x the mean, with the noise learned (steady: k = 2)
    found = [f for f in d.check(now) if f.evidence.source == "hang"]
    assert [f.evidence.node for f in found] == ["n1"], found


def test_a_node_the_relaunch_left_no_longer_hides_a_hang() -> None:
    """Silence counts only up to the time every agent has said how long its ranks waited
    for a CPU. A relaunch keeps those counters for the nodes it runs on; the agent of a
    node it left (drained, dead) never reports again and must not freeze that horizon."""
    d = Detector(DetectConfig(warmup_iterations=1, hang_factor=2.0, max_hang_factor=2.0), AgentConfig(),
                 load_classifier(None))  # fmt: skip
    now, after = steady(d, ("n1", "n2", "n3"), 10.0)
    relaunch = LaunchAgents("plan-3/launch", "t", 4, tuple(NodeArgv(n, ("train",)) for n in ("n1", "n2")))
    d.follow(after, after, Decision(actions=(relaunch,)), now)
    for it in range(1, 10):
        now += 0.1
        for rank, node in ((0, "n1"), (1, "n2")):
            d.on_message(stamped(rank, it, node, relaunch.action_id), now)
            d.on_message(beat(node, 0.0), now)  # n3's agent is gone: it never beats again
    now += 1.0
    d.on_message(beat("n1", 0.0), now)
    d.on_message(beat("n2", 0.0), now)
    found = [f for f in d.check(now) if f.evidence.source == "hang"]  # (n3 is also silent)
    assert [f.evidence.node for f in found] == ["n1"], found


def test_a_stopped_agent_beating_through_its_grace_is_not_watched_again() -> None:
    """Found in review: the agent of a node a shrink left, stopped on purpose, beat once more
    through its grace. Its beat put it back under watch (then "lost" once it ended) and its
    CPU-wait series, never fed again, froze the job's silence horizon: the next hang was
    found 10 x later. A stopped agent's beats are ignored until unicornd launches there."""
    cfg = DetectConfig(warmup_iterations=1, hang_factor=2.0, max_hang_factor=2.0)
    d = Detector(cfg, AgentConfig(), load_classifier(None))
    now, after = steady(d, ("n1", "n2", "n3"), 10.0)
    actions = (
        SendCommand("plan-3/stop/n3", 4, "n3", AgentAction.STOP, deadline_s=60.0),
        *(
            SendCommand(f"plan-3/relaunch/{n}", 4, n, AgentAction.RELAUNCH, deadline_s=60.0)
            for n in ("n1", "n2")
        ),
    )
    d.follow(after, after, Decision(actions=actions), now)
    now += 0.05
    d.on_message(beat("n3", 0.0), now)  # through its grace
    for it in range(1, 10):
        now += 0.1
        for rank, node in ((0, "n1"), (1, "n2")):
            d.on_message(stamped(rank, it, node, f"plan-3/relaunch/{node}"), now)
            d.on_message(beat(node, 0.0), now)
    stopped = now
    while now < stopped + 0.5:
        now += 0.1
        d.on_message(beat("n1", 0.0), now)
        d.on_message(beat("n2", 0.0), now)
    found = d.check(now)
    assert [f.evidence.source for f in found] == ["hang"], found  # and n3 is not "lost"
    later = [f.evidence.node for f in d.check(now + 60.0) if f.evidence.source == "heartbeat"]
    assert "n3" not in later, later


def test_a_launch_drops_the_series_of_the_agents_it_replaces() -> None:
    """A new agent's counter starts afresh; the agent it replaces may be dead, and its
    series, never fed again, would freeze the silence horizon until the new one beats."""
    cfg = DetectConfig(warmup_iterations=1, hang_factor=2.0, max_hang_factor=2.0)
    d = Detector(cfg, AgentConfig(), load_classifier(None))
    now, after = steady(d, ("n1", "n2"), 10.0)
    launch = LaunchAgents("plan-3/launch", "t", 4, (NodeArgv("n2", ("train",)),))
    restart = SendCommand("plan-3/restart/n1", 4, "n1", AgentAction.RESTART_RANKS, deadline_s=60.0)
    d.follow(after, after, Decision(actions=(launch, restart)), now)
    for it in range(1, 10):  # the new agent on n2 has not beaten yet; its ranks report
        now += 0.1
        d.on_message(stamped(0, it, "n1", restart.action_id), now)
        d.on_message(stamped(1, it, "n2", launch.action_id), now)
        d.on_message(beat("n1", 0.0), now)
    stopped = now
    while now < stopped + 0.5:
        now += 0.1
        d.on_message(beat("n1", 0.0), now)
    assert [f.evidence.source for f in d.check(now)] == ["hang"]


def test_teardown_noise_after_the_last_iteration_is_no_finding() -> None:
    """Seen in CI: after the run's last iteration, the last rank to tear down logged its
    peers' closed sockets (SEV3, a retry in place that cannot help). Before the last
    iteration the same line is a finding; a SEV2 one stays a finding after it too."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))

    def line(status: str, severity: str) -> FaultReport:
        return FaultReport(
            job_id=4, node="n3", wall_time_s=1.0, status=status, severity=severity, rule="socket_failure",
            rank=None, evidence="RuntimeError: Connection closed by peer [127.0.0.1]:1234",
        )  # fmt: skip

    d.on_message(timing(0, 9), 10.0)
    assert len(d.on_message(line("other_network_error", "SEV3"), 10.1)) == 1
    last = IterationTiming(
        job_id=4, node="n1", wall_time_s=1.0, rank=0, iteration=10, duration_s=0.1, samples=12, final=True
    )
    d.on_message(last, 10.2)
    assert d.on_message(line("other_network_error", "SEV3"), 10.3) == []
    assert len(d.on_message(line("other_software_error", "SEV2"), 10.4)) == 1
    d.restart_job(4)  # a relaunch runs on: its lines count again
    assert len(d.on_message(line("other_network_error", "SEV3"), 10.5)) == 1


def test_a_line_found_by_a_secondary_rule_stays_secondary() -> None:
    """A known miss until session 31: the detector rebuilt ``secondary`` from the status
    alone, so a consequence an agent reported (a peer's remote error, Open MPI's word that
    another node's daemon is gone) counted as a cause: it climbed an open incident instead of
    being absorbed. An exit line the agent sent at SEV2 stays primary (it corroborates an exit
    the agent saw: ARCHITECTURE.md's row of exit lines)."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))

    def line(rule: str, status: str, severity: str, text: str) -> FaultReport:
        return FaultReport(
            job_id=4, node="n3", wall_time_s=1.0, status=status, severity=severity, rule=rule,
            rank=None, evidence=text,
        )  # fmt: skip

    peer = line("nccl_remote_error", "other_network_error", "SEV3", "NCCL: remote process exited")
    orte = line("mpi_daemon_lost", "lost_connection", "SEV1", "ORTE has lost communication with a daemon")
    cause = line("python_exception", "other_software_error", "SEV2", "ValueError: bad shape")
    unknown = line("a_site_rule", "other_software_error", "SEV2", "site: job failed")
    unknown_reset = line("a_site_reset", "connection_refused_reset", "SEV3", "site: peer reset")
    # torchrun's summary: sent at SEV2 only when it corroborates an exit the agent saw, then
    # it moves the ladder (the exit's own finding is the secondary one); at SEV3, secondary
    summary = line("torchelastic_summary", "exited_abnormally", "SEV2", "Root Cause (first observed failure)")
    unseen = msgspec.structs.replace(summary, severity="SEV3", evidence="Root Cause (first observed)")
    msgs = (peer, orte, cause, unknown, unknown_reset, summary, unseen)
    got = [d.on_message(m, 10.0 + i) for i, m in enumerate(msgs)]
    assert [len(g) for g in got] == [1] * len(msgs)
    # a rule the coordinator lacks (an agent's site rule): as its status's default
    secondary = [g[0].evidence.classification.secondary for g in got]
    assert secondary == [True, True, False, False, True, False, True]


def test_the_exits_and_errors_of_replaced_ranks_are_no_finding() -> None:
    """Found in CI (the node-loss system test): after a shrink relaunched the job on its
    surviving node, the superseded agent there reported its old ranks' SIGKILL once the
    shrink's incident had closed, and a new incident restarted the healthy new ranks. An
    exit, an exception or a log line of ranks this unicornd replaced (another launch id
    there, or the agent stopped) is dropped; the new launch's own, and an unstamped one
    (an agent that does not say), are findings."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    first = LaunchAgents("plan-1/launch/4", "a", 4, (NodeArgv("n1", ("train",)), NodeArgv("n2", ("train",))))
    d.follow(empty, empty, Decision(actions=(first,)), 1.0)

    def killed(node: str, launch: str) -> ProcessExit:
        return ProcessExit(
            job_id=4, node=node, wall_time_s=1.0, rank=None, local_rank=None, pid=77, exit_code=None,
            signal=9, error_file_text=None, stderr_tail="", launch_id=launch,
        )  # fmt: skip

    def raised(launch: str) -> ExceptionReport:
        return ExceptionReport(
            job_id=4, node="n1", wall_time_s=1.0, rank=0, exc_type="RuntimeError",
            message="Connection reset by peer", traceback="", launch_id=launch,
        )  # fmt: skip

    def line(launch: str) -> FaultReport:
        return FaultReport(
            job_id=4, node="n1", wall_time_s=1.0, status="exited_abnormally", severity="SEV2",
            rule="torchelastic_worker_failed", rank=None, evidence="worker group failed", launch_id=launch,
        )  # fmt: skip

    assert len(d.on_message(killed("n1", first.action_id), 2.0)) == 1  # the current launch's: a fault
    shrink = LaunchAgents("plan-2/relaunch/4", "a", 4, (NodeArgv("n1", ("train",)),))
    stop = SendCommand("plan-2/stop/n2", 4, "n2", AgentAction.STOP, deadline_s=60.0)
    d.follow(empty, empty, Decision(actions=(shrink, stop)), 3.0)
    for stale in (killed("n1", first.action_id), raised(first.action_id), line(first.action_id)):
        assert d.on_message(stale, 20.0) == []
    assert d.on_message(killed("n2", first.action_id), 20.0) == []  # its agent was stopped
    assert d.stale_reports == 4
    for fresh in (killed("n1", shrink.action_id), raised(shrink.action_id), line(shrink.action_id)):
        (found,) = d.on_message(fresh, 21.0)
        assert found.current_launch, fresh  # the ranks the shrink started: its own failure
    (unknown,) = d.on_message(killed("n1", ""), 22.0)  # unknown launch: it counts, as no one's
    assert not unknown.current_launch


def test_a_failed_restart_or_stop_leaves_the_old_ranks_reports_counting() -> None:
    """Found in review: the detector takes a restart's or stop's launch as current when it is
    committed; if the agent then fails it (or the command never reaches it), the old ranks
    run on, and their faults must count again. A later action's launch is not undone."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    first = LaunchAgents("plan-1/launch/4", "a", 4, (NodeArgv("n1", ("train",)), NodeArgv("n2", ("train",))))
    d.follow(empty, empty, Decision(actions=(first,)), 1.0)

    def killed(node: str) -> ProcessExit:
        return ProcessExit(
            job_id=4, node=node, wall_time_s=1.0, rank=0, local_rank=0, pid=77, exit_code=1,
            signal=None, error_file_text=None, stderr_tail="", launch_id=first.action_id,
        )  # fmt: skip

    restart = SendCommand("a.1/restart_processes/1/n1", 4, "n1", AgentAction.RESTART_RANKS, deadline_s=60.0)
    stop = SendCommand("a.1/stop/n2", 4, "n2", AgentAction.STOP, deadline_s=60.0)
    d.follow(empty, empty, Decision(actions=(restart, stop)), 2.0)
    assert d.on_message(killed("n1"), 3.0) == [] and d.on_message(killed("n2"), 3.0) == []
    d.command_failed("no-such-action")
    assert d.on_message(killed("n1"), 3.1) == []
    d.command_failed(restart.action_id)
    d.command_failed(stop.action_id)
    assert len(d.on_message(killed("n1"), 4.0)) == 1 and len(d.on_message(killed("n2"), 4.0)) == 1
    again = SendCommand("a.1/restart_processes/2/n1", 4, "n1", AgentAction.RESTART_RANKS, deadline_s=60.0)
    later = SendCommand("a.1/relaunch/1/n1", 4, "n1", AgentAction.RELAUNCH, deadline_s=60.0)
    d.follow(empty, empty, Decision(actions=(again,)), 5.0)
    d.follow(empty, empty, Decision(actions=(later,)), 6.0)
    d.command_failed(again.action_id)  # replaced since: the relaunch's launch stays current
    assert d.on_message(killed("n1"), 7.0) == []


def test_one_agent_failing_a_whole_job_launch_puts_back_only_its_own_node() -> None:
    """Review: one agent of a whole-job step answering its launch failed rolled every node
    of the launch back, and the other nodes' healthy new ranks were taken for replaced ones
    (their exits, faults and iterations dropped). Only the failing node is put back."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    first = LaunchAgents("plan-1/launch/4", "a", 4, (NodeArgv("n1", ("train",)), NodeArgv("n2", ("train",))))
    d.follow(empty, empty, Decision(actions=(first,)), 1.0)
    second = LaunchAgents("plan-2/launch/4", "a", 4, (NodeArgv("n1", ("train",)), NodeArgv("n2", ("train",))))
    d.follow(empty, empty, Decision(actions=(second,)), 2.0)
    d.command_failed(second.action_id, "n1")
    assert not d.replaced(4, "n1", first.action_id)  # n1's old ranks may still run: they count
    assert d.replaced(4, "n2", first.action_id) and not d.replaced(4, "n2", second.action_id)
    d.command_failed(second.action_id)  # the whole step failed (no node named): every node
    assert not d.replaced(4, "n2", first.action_id)


def test_a_relaunched_agent_is_watched_afresh_and_its_silence_found_again() -> None:
    """A silence found (the pair waits in ``_lost`` for a beat) and then a new agent launched
    on purpose: the new agent gets a new agent's grace, then its own silence is found again.
    Before, the old entry stayed expired and in ``_lost``, so a new agent that never beat was
    never reported (the probe's verdict about the old one is dropped: its epoch changed)."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    first = LaunchAgents("plan-1/launch/4", "a", 4, (NodeArgv("n1", ("train",)),))
    d.follow(empty, empty, Decision(actions=(first,)), 1.0)
    d.launching(4, ("n1",), first.action_id, 1.0)
    d.on_message(beat("n1", None), 2.0)
    lost = d.check(5.0)
    assert [(f.evidence.node, f.agent_epoch) for f in lost] == [("n1", d.agent_epoch(4, "n1"))]
    assert lost[0].agent_epoch > 0
    again = LaunchAgents("plan-2/relaunch/4", "a", 4, (NodeArgv("n1", ("train",)),))
    d.follow(empty, empty, Decision(actions=(again,)), 6.0)
    d.launching(4, ("n1",), again.action_id, 6.0)
    assert d.agent_epoch(4, "n1") != lost[0].agent_epoch
    assert d.check(20.0) == []  # within the new agent's grace (30 s)
    found = d.check(40.0)  # never beat: found again, with the new epoch
    assert [(f.evidence.node, f.agent_epoch) for f in found] == [("n1", d.agent_epoch(4, "n1"))]


def test_a_job_waiting_for_its_requeue_is_not_heard_until_its_agents_are_launched() -> None:
    """Found by the 4,096-node hour: a replan's requeues run one at a time, so a job's
    agents beat on for minutes after the requeue was committed (and the job forgotten).
    Their beats put them back under watch, and when the requeue finally ended them their
    silence was a finding. A job whose task waits for its requeue is not heard; the agents
    unicornd launches once it runs again are."""
    cfg = DetectConfig(warmup_iterations=1, heartbeat_timeout_s=1.5)
    d = Detector(cfg, AgentConfig(), load_classifier(None))
    now, before = steady(d, ("n1", "n2"), 10.0)
    waiting = replace(before.tasks["t"], requeue=RequeueWait("plan-2/t/requeue", deadline_s=1e9))
    after = Snapshot(tasks={"t": waiting}, nodes={}, gpus_per_node=8)
    requeue = Requeue("plan-2/t/requeue", "t", 4, ("n1", "n2"))
    d.follow(before, after, Decision(actions=(requeue,), tasks=(waiting,)), now)
    for _ in range(50):  # the requeue waits behind others; the agents beat and train on
        now += 0.1
        d.on_message(beat("n1", 0.0), now)
        d.on_message(stamped(0, 20, "n1", ""), now)
    now += 5.0  # the requeue ended them: silence
    assert d.check(now) == [] and not d.silent(4, "n1", now)
    # The job runs again: unicornd launches its agents, and hears them.
    running = replace(waiting, requeue=None)
    launched = Snapshot(tasks={"t": running}, nodes={}, gpus_per_node=8)
    launch = LaunchAgents("plan-2/t/requeue/launch", "t", 4, (NodeArgv("n1", ("a",)), NodeArgv("n2", ("a",))))
    d.follow(after, launched, Decision(actions=(launch,), tasks=(running,)), now)
    d.launching(4, ("n1", "n2"), launch.action_id, now)
    d.on_message(beat("n1", 0.0), now + 0.1)
    d.on_message(beat("n2", 0.0), now + 0.1)
    lost = [f.evidence.node for f in d.check(now + 2.0) if f.evidence.source == "heartbeat"]
    assert sorted(lost) == ["n1", "n2"], lost  # their silence counts again


def test_a_leader_taking_over_does_not_hear_a_job_waiting_for_its_requeue() -> None:
    d = Detector(DetectConfig(heartbeat_timeout_s=1.5), AgentConfig(), load_classifier(None))
    waiting = task("t", 4, ("n1",), requeue=RequeueWait("plan-2/t/requeue", deadline_s=1e9))
    d.expect_running(Snapshot(tasks={"t": waiting}, nodes={}, gpus_per_node=8), 10.0)
    d.on_message(beat("n1", 0.0), 10.1)
    assert d.check(20.0) == []


def test_a_launch_waiting_behind_other_actions_gets_its_grace_when_it_runs() -> None:
    """Found by the 4,096-node hour: a replan's launch waited behind the job's resize, which
    waited for every allocation change committed before it; the agents were "never heard
    from" 30 s after the commit, before they had been started."""
    d = Detector(DetectConfig(heartbeat_timeout_s=1.5), AgentConfig(), load_classifier(None))
    snap = Snapshot(tasks={"t": task("t", 4, ("n1", "n2"))}, nodes={}, gpus_per_node=8)
    launch = LaunchAgents("plan-5/t/launch", "t", 4, (NodeArgv("n1", ("a",)), NodeArgv("n2", ("a",))))
    d.follow(snap, snap, Decision(actions=(launch,)), 100.0)
    for t in range(101, 200):  # queued 99 s: the ticker checks each second meanwhile
        assert d.check(float(t)) == [], t
    d.launching(4, ("n1", "n2"), "plan-5/t/launch", 200.0)  # performed at last
    assert d.check(225.0) == []  # within the grace from the launch
    d.on_message(beat("n1", 0.0), 230.0)
    lost = [f.evidence for f in d.check(230.5) if f.evidence.source == "heartbeat"]
    assert [e.node for e in lost] == ["n2"] and "never heard from" in lost[0].classification.evidence
    # A launch that a later one replaced does not start the later one's grace.
    later = replace(launch, action_id="plan-6/t/launch")
    d.follow(snap, snap, Decision(actions=(later,)), 300.0)
    d.launching(4, ("n1", "n2"), "plan-5/t/launch", 301.0)
    assert d.check(400.0) == []
    d.launching(4, ("n1", "n2"), "plan-6/t/launch", 401.0)
    assert sorted(f.evidence.node for f in d.check(432.0)) == ["n1", "n2"]


def test_a_launch_owed_by_the_leader_before_starts_its_agents_grace_when_performed() -> None:
    """A new leader expects the agents of every running task from its start; a launch the
    leader before it committed and never performed runs now: the grace counts from then."""
    d = Detector(DetectConfig(heartbeat_timeout_s=1.5), AgentConfig(), load_classifier(None))
    d.expect_running(Snapshot(tasks={"t": task("t", 4, ("n1",))}, nodes={}, gpus_per_node=8), 10.0)
    d.launching(4, ("n1",), "plan-9/t/launch", 35.0)
    assert d.check(60.0) == []
    assert [f.evidence.node for f in d.check(66.0)] == ["n1"]


def test_the_agent_on_a_node_its_task_left_without_a_stop_is_not_watched() -> None:
    """Found by the 4,096-node hour: a replan moved a task off a drained node (no stop is
    sent to an unhealthy node); its agent ran until the job's shrink, minutes later behind
    the other allocation changes, and its silence was then a finding."""
    d = Detector(DetectConfig(heartbeat_timeout_s=1.5), AgentConfig(), load_classifier(None))
    now, before = steady(d, ("n1", "n2"), 10.0)
    moved = replace(before.tasks["t"], nodes=("n1",))
    after = Snapshot(tasks={"t": moved}, nodes={}, gpus_per_node=8)
    d.follow(before, after, Decision(tasks=(moved,)), now)
    for _ in range(20):  # the agent on n2 beats on until the shrink ends it
        now += 0.5
        d.on_message(beat("n1", 0.0), now)
        d.on_message(beat("n2", 0.0), now)
    for _ in range(20):
        now += 0.5
        d.on_message(beat("n1", 0.0), now)
    assert [f.evidence.node for f in d.check(now) if f.evidence.source == "heartbeat"] == []


def test_a_bare_exit_after_the_ranks_own_exception_takes_the_exceptions_status() -> None:
    """Found by the safety bench: a user's bug raised again after its restart (absorbed: the
    restart had just been ordered), then the rank exited 1. As ``exited_abnormally`` (a node
    can cause that) the exit climbed to isolation and ran a node check on a healthy node. An
    exit that names no cause of its own, of a rank that raised in the same launch, ended
    because of that exception: it is the exception's finding, with the rank gone. An exit
    with its own cause (a signal), of another rank, or of another launch is its own."""
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None, nearest=True))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    first = LaunchAgents("plan-1/launch/4", "a", 4, (NodeArgv("n1", ("train",)), NodeArgv("n2", ("train",))))
    d.follow(empty, empty, Decision(actions=(first,)), 1.0)

    def raised(rank: int, launch: str) -> ExceptionReport:
        return ExceptionReport(
            job_id=4, node="n2", wall_time_s=1.0, rank=rank, exc_type="RuntimeError",
            message="injected failure at iteration 5", traceback="", launch_id=launch,
        )  # fmt: skip

    def ended(rank: int, launch: str, *, code: int | None = 1, sig: int | None = None) -> ProcessExit:
        return ProcessExit(
            job_id=4, node="n2", wall_time_s=1.0, rank=rank, local_rank=0, pid=77, exit_code=code,
            signal=sig, error_file_text=None, stderr_tail="", launch_id=launch,
        )  # fmt: skip

    (exc,) = d.on_message(raised(1, first.action_id), 2.0)
    assert exc.classification.status is ErrorStatus.OTHER_SOFTWARE_ERROR
    (ex,) = d.on_message(ended(1, first.action_id), 2.1)
    c, e = ex.classification, exc.classification
    assert (c.status, c.rule, ex.evidence.source) == (e.status, e.rule, "exit")
    assert c.evidence.splitlines()[0] == e.evidence.splitlines()[0]
    assert "exit code 1" in c.evidence and ex.current_launch
    # Once only: the same rank's next bare exit (no new exception) is its own again.
    (again,) = d.on_message(ended(1, first.action_id), 2.2)
    assert again.classification.status is ErrorStatus.EXITED_ABNORMALLY
    # Another rank's exit is not explained by rank 1's exception.
    d.on_message(raised(1, first.action_id), 3.0)
    (other,) = d.on_message(ended(2, first.action_id), 3.1)
    assert other.classification.status is ErrorStatus.EXITED_ABNORMALLY
    # A signal is a cause of its own: kept as the classifier reads it.
    (killed,) = d.on_message(ended(1, first.action_id, code=None, sig=9), 3.2)
    alone = load_classifier(None).classify_exit(None, 9, "", None)
    assert (killed.classification.status, killed.classification.rule) == (alone.status, alone.rule)
    # An exception long before the exit (a thread's, one the rank survived) explains nothing.
    d.on_message(msgspec.structs.replace(raised(1, first.action_id), wall_time_s=1.0), 3.3)
    (late,) = d.on_message(msgspec.structs.replace(ended(1, first.action_id), wall_time_s=32.0), 3.4)
    assert late.classification.status is ErrorStatus.EXITED_ABNORMALLY
    # An exception under an unstamped (unknown) launch explains nothing.
    d.on_message(raised(1, ""), 4.0)
    (unstamped,) = d.on_message(ended(1, ""), 4.1)
    assert unstamped.classification.status is ErrorStatus.EXITED_ABNORMALLY
    # The nearest labelled line's status for an exit no rule explains is a guess: the rank's
    # own exception still names the cause.
    tail = "gdrdrv:nvidia_p2p_get_pages(va=704fe0000 len=327680 p2p_token=0 va_space=0) failed [ret = -22]"
    assert load_classifier(None, nearest=True).classify_exit(1, None, tail).rule == NEAREST_RULE
    d.on_message(raised(1, first.action_id), 4.5)
    (guessed,) = d.on_message(msgspec.structs.replace(ended(1, first.action_id), stderr_tail=tail), 4.6)
    assert guessed.classification.status is ErrorStatus.OTHER_SOFTWARE_ERROR
    # Forgetting the job forgets its exceptions.
    d.on_message(raised(1, first.action_id), 5.0)
    d.forget_job(4)
    assert d._raised == {}


def test_a_users_bug_that_raises_again_after_its_restart_stops_the_task_without_a_node_check() -> None:
    """The safety bench's user_bug scenario through the detector and the ladder: rank 1 on
    n2 raises at the same iteration every launch; 1 restart allowed. The second launch's
    exception comes within the settle time (absorbed), then the rank exits. The task stops
    with the exception as the reason; no node is checked or drained."""
    policy = Policy(max_process_restarts=1, no_progress_limit=10, recovery_budget=10)
    snap = world(3, [task("a", 4, ["n1", "n2"])], policy)
    d = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    empty = Snapshot(tasks={}, nodes={}, gpus_per_node=8)
    launch = LaunchAgents("plan-1/launch/4", "a", 4, (NodeArgv("n1", ("train",)), NodeArgv("n2", ("train",))))
    d.follow(empty, empty, Decision(actions=(launch,)), 1.0)
    t0 = 1_700_000_000.0
    seq = iter(range(1, 100))

    def heard(msg: ExceptionReport | ProcessExit, at: float) -> Finding:
        (jf,) = d.on_message(msg, at)
        f = Finding.of(
            jf.classification, finding_id=f"f{next(seq)}", job_id=4, node=jf.evidence.node,
            rank=jf.evidence.rank, rank_died=jf.evidence.source == "exit", current_launch=jf.current_launch,
        )  # fmt: skip
        assert f is not None
        return f

    def raised(launch_id: str) -> ExceptionReport:
        return ExceptionReport(
            job_id=4, node="n2", wall_time_s=1.0, rank=1, exc_type="RuntimeError",
            message="injected failure at iteration 5", traceback="", launch_id=launch_id,
        )  # fmt: skip

    def exited(launch_id: str) -> ProcessExit:
        return ProcessExit(
            job_id=4, node="n2", wall_time_s=1.0, rank=1, local_rank=1, pid=77, exit_code=1,
            signal=None, error_file_text=None, stderr_tail="", launch_id=launch_id,
        )  # fmt: skip

    dec = on_finding(snap, heard(raised(launch.action_id), 2.0), t0)
    snap = apply(snap, dec)
    assert snap.incidents["a.1"].stage is LadderStage.RESTART_PROCESSES
    d.follow(empty, empty, dec, 2.0)  # the restart's launch ids are now current
    restart = next(a for a in dec.actions if isinstance(a, SendCommand) and a.node == "n2")
    snap = apply(snap, on_finding(snap, heard(raised(restart.action_id), 10.0), t0 + 8))
    assert snap.incidents["a.1"].stage is LadderStage.RESTART_PROCESSES  # absorbed while settling
    last = on_finding(snap, heard(exited(restart.action_id), 10.5), t0 + 8.5)
    after = apply(snap, last)
    assert not of_kind(last.actions, CheckNode) and not of_kind(last.actions, DrainNode), last.actions
    assert after.tasks["a"].state is TaskState.STOPPED
    note = after.incidents["a.1"].note
    assert "never of a node" in note and "injected failure" in note and "the same error again" in note
    assert all(n.health is NodeHealth.HEALTHY for n in after.nodes.values())
