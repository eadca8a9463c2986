"""Real Megatron-LM through the whole loop: ``pretrain_gpt.py`` (tiny GPT, mock data, gloo)
submitted with the sbatch wrapper, supervised by the agents from its own log, recovered
by unicornd: a node killed (drain, new layout, resume from the memory tier), a rank's
exception and a stopped rank (restart in place). The job: :mod:`tests.system.megatron_job`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DevCluster, private_cluster
from tests.system.coordinator import Coordinator, coordinator, train_log
from tests.system.megatron_job import (
    ITERATIONS,
    MEGATRON_LM,
    MODEL,
    PLAN_ENV,
    SAVE_INTERVAL,
    job_env,
    model_file,
    reference,
    restored_from,
    runs,
    tiers_env,
    user_args,
)
from tests.system.test_unicornd import node_reason
from tests.system.test_wrapper import (
    job_active,
    job_fields,
    output,
    submit,
    until,
)
from unicorn_core.paths import AGENT_RUN_ROOT
from unicornd.state import LadderStage, NodeHealth, Snapshot, TaskState

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        not (MEGATRON_LM / "pretrain_gpt.py").exists(),
        reason=f"Megatron-LM's training loop not found at {MEGATRON_LM} (set UNICORN_MEGATRON_LM)",
    ),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """4 nodes with 1 GPU each."""
    with private_cluster(tmp_path_factory, "megatron", "--nodes", "4", "--gpus-per-node", "1") as c:
        yield c


def task_of(snap: Snapshot, task_id: str) -> bool:
    return task_id in snap.tasks


def running(snap: Snapshot, task_id: str, past: int) -> bool:
    t = snap.tasks.get(task_id)
    return t is not None and t.state is TaskState.RUNNING and (t.last_iteration or 0) > past


def submit_megatron(c: Coordinator, tmp: Path, name: str, nodes: int, **env: str) -> int:
    """``sbatch -N nodes etc/unicorn-job.sbatch ... -- pretrain_gpt.py ARGS`` as a user does;
    ``--max-gpus`` keeps the task on its job's nodes (the planner would grow it onto the
    idle ones)."""
    return submit(
        c, tmp, ("-N", str(nodes), "-J", name),
        ("--model", str(model_file(tmp)), "--framework", "megatron", "--name", name,
         "--max-gpus", str(nodes), "--", str(MEGATRON_LM / "pretrain_gpt.py"), *user_args(tmp / "ckpt")),
        **job_env(**env),
    )  # fmt: skip


def all_logs(c: Coordinator, job: int, nodes: tuple[str, ...]) -> dict[str, str]:
    return {n: train_log(c.keys.prefix, job, n) for n in nodes}


@pytest.mark.timeout(900)
def test_node_kill_resumes_megatron_at_a_new_layout_from_memory(cluster: DevCluster, tmp_path: Path) -> None:
    with coordinator(cluster, tmp_path, **tiers_env(tmp_path), **PLAN_ENV) as c, logs_kept(c, tmp_path):
        job = submit_megatron(c, tmp_path, "mg", 4)
        task_id = f"mg.{job}"
        snap = c.wait(
            lambda s: (
                task_of(s, task_id)
                and s.tasks[task_id].state is TaskState.RUNNING
                and (s.tasks[task_id].last_iteration or 0) >= 2 * SAVE_INTERVAL + 2
            ),
            "Megatron-LM training past its second save",
            300,
        )
        before = snap.tasks[task_id]
        assert before.layout is not None and len(before.nodes) == 4, before
        victim = before.nodes[1]
        cluster.script("kill-node", victim)
        try:
            snap = c.wait(
                lambda s: s.nodes[victim].health in (NodeHealth.DRAINING, NodeHealth.DRAINED),
                f"{victim} drained",
                90,
            )
            snap = c.wait(
                lambda s: (
                    victim not in s.tasks[task_id].nodes
                    and s.tasks[task_id].state is TaskState.RUNNING
                    and (s.tasks[task_id].last_iteration or 0) > (before.last_iteration or 0)
                ),
                "Megatron-LM training again without the killed node",
                300,
            )
        finally:
            cluster.script("revive-node", victim)
        after = snap.tasks[task_id]
        assert after.layout is not None and after.layout != before.layout, (before.layout, after.layout)
        reason = node_reason(cluster, victim)
        assert "ssh_unreachable" in reason or "slurm_not_responding" in reason, reason
        until(lambda: not job_active(cluster, job), "the Megatron-LM job to finish", 300)
        fields = job_fields(cluster, job)
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output(tmp_path, job)
        snap = c.wait(lambda s: s.tasks[task_id].state is TaskState.FINISHED, "the task finished", 30)
        (incident,) = [i for i in snap.incidents.values() if victim in i.isolated_nodes]
        assert LadderStage.ISOLATE in [e.stage for e in incident.timeline]

        # Megatron-LM's own log, on the node of the last rank in each run.
        logs = all_logs(c, job, before.nodes)
        printed = [r for log in logs.values() for r in runs(log) if r.steps]
        first = next(r for r in printed if r.loaded is None)
        resumed = [r for r in printed if r.loaded is not None]
        assert resumed, logs
        last = resumed[-1]
        assert last.loaded is not None and last.loaded % SAVE_INTERVAL == 0 and last.loaded >= SAVE_INTERVAL
        # Host memory restored it, at the new layout: this node's and its peers' (the killed
        # node's shard from the peer that backs it up), not a file checkpoint or disk.
        assert restored_from(last.tiers) and set(restored_from(last.tiers)) <= {"memory", "peer"}, last.tiers
        # The data position continues: consumed samples follow the iterations, no batch
        # repeated or skipped, across the relaunch at another DP.
        for r in (first, last):
            assert all(s.consumed == s.iteration * MODEL.global_batch for s in r.steps), r.steps
        assert last.steps[0].iteration == last.loaded + 1 and last.steps[-1].iteration == ITERATIONS
        # The loss continues: as an uninterrupted run at the first layout.
        want = reference(before.layout, ITERATIONS, tmp_path)
        for step in (last.steps[0], last.steps[-1]):
            assert step.loss == pytest.approx(want[step.iteration], rel=1e-4), (step, want[step.iteration])
        cluster.slurm("scontrol", "update", f"nodename={victim}", "state=resume", check=False)
        print(
            f"layout {before.layout.describe()} -> {after.layout.describe()}, resumed at {last.loaded}"
            f" ({last.tiers}); lm loss at {last.steps[0].iteration}: {last.steps[0].loss} vs"
            f" {want[last.steps[0].iteration]}"
        )


def ckpt_agent_pid(job: int, node: str, prefix: str) -> int:
    """The pid of ``node``'s checkpoint agent of ``job`` (``python -m launcher.ckptagent``)."""
    want = ["--job-id", str(job), "--node", node, "--scope", prefix]
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "launcher.ckptagent" in args and all(w in args for w in want):
            return int(entry.name)
    raise AssertionError(f"no checkpoint agent of job {job} on {node}")


@pytest.mark.timeout(900)
def test_a_node_killed_before_its_last_save_left_it_resumes_from_the_save_before(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """The race behind stop 39's CI failure, made certain: n2's checkpoint agent is stopped
    after the save at 10 reached its peer, so the save at 15 never leaves n2; the tracker says
    15 when n2 is killed. The relaunch at DP3 cannot load 15 (rank 1's shard is gone with
    n2): its load points the tracker at 10 and fails, that failure climbs at once (the
    relaunch's own ranks died), and the restart resumes from 10 to the end."""
    with coordinator(cluster, tmp_path, **tiers_env(tmp_path), **PLAN_ENV) as c, logs_kept(c, tmp_path):
        job = submit_megatron(c, tmp_path, "mk", 4)
        task_id = f"mk.{job}"
        snap = c.wait(
            lambda s: running(s, task_id, 2 * SAVE_INTERVAL), "Megatron-LM past its second save", 300
        )
        before = snap.tasks[task_id]
        victim, backup = before.nodes[1], before.nodes[2]
        copied = tmp_path / "shm" / backup / "peer"
        until(
            lambda: any(copied.glob(f"*/it-{2 * SAVE_INTERVAL:012d}/shard-00001.done")),
            "save 10 at its peer",
            60,
        )
        os.kill(ckpt_agent_pid(job, victim, c.keys.prefix), signal.SIGSTOP)
        tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
        until(lambda: tracker.read_text().strip() == str(3 * SAVE_INTERVAL), "the tracker at 15", 120)
        cluster.script("kill-node", victim)
        try:
            snap = c.wait(
                lambda s: (
                    running(s, task_id, before.last_iteration or 0) and victim not in s.tasks[task_id].nodes
                ),
                "Megatron-LM training again without the killed node",
                300,
            )
        finally:
            cluster.script("revive-node", victim)
        until(lambda: not job_active(cluster, job), "the Megatron-LM job to finish", 300)
        fields = job_fields(cluster, job)
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output(tmp_path, job)
        logs = all_logs(c, job, before.nodes)
        assert any("tracker moved back" in log for log in logs.values()), logs
        resumed = [r for log in logs.values() for r in runs(log) if r.steps and r.loaded is not None]
        assert resumed and resumed[-1].loaded == 2 * SAVE_INTERVAL, [r.loaded for r in resumed]
        assert resumed[-1].steps[-1].iteration == ITERATIONS
        cluster.slurm("scontrol", "update", f"nodename={victim}", "state=resume", check=False)


_TELLING = ("Error", "error:", "Exception", "Timeout", "timed out", "restore", "Killed", "Signal")


def _rank_story(run_root: Path, per_log: int = 6) -> str:
    """The lines of each node's training log that say why its ranks ended (errors, restores),
    newest last: a CI log shows only the head of a failure's message, and the agents' run
    folders are gone with the clean clone."""
    parts = []
    for log in sorted(run_root.glob("*/*/train.log")):
        lines = log.read_text(errors="replace").splitlines()
        telling = [line[:300] for line in lines if any(word in line for word in _TELLING)]
        shown = "\n".join(telling[-per_log:] or lines[-2:])
        parts.append(f"--- {log.parent.name} ({len(lines)} lines):\n{shown}")
    return "\n".join(parts)


@contextlib.contextmanager
def logs_kept(c: Coordinator, tmp: Path) -> Iterator[None]:
    """On the way out, copy the agents' run folders (training logs) beside the test's other
    files: the coordinator's exit removes them, and a failure is read from them. A failed
    assertion is raised again with each node's training log's telling lines first."""
    run_root = AGENT_RUN_ROOT / c.keys.prefix
    try:
        yield
    except AssertionError as exc:
        story = _rank_story(run_root) if run_root.is_dir() else "(no agent run folders)"
        raise AssertionError(f"training logs:\n{story}\n{exc}") from exc
    finally:
        if run_root.is_dir():
            shutil.copytree(run_root, tmp / "agent-logs", ignore=shutil.ignore_patterns("*.sock"))


def rank_pid(cluster: DevCluster, job: int, rank: int) -> int:
    """The pid of global rank ``rank`` of ``job`` (torchrun's worker: its environment has RANK)."""
    for entry in Path("/proc").iterdir():
        try:
            raw = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
            env = dict(kv.split("=", 1) for kv in raw if "=" in kv)
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ours = env.get("SLURM_CONF") == cluster.slurm_conf and env.get("UNICORN_JOB_ID") == str(job)
        if ours and env.get("RANK") == str(rank) and b"launcher.mcore_ckpt" in cmdline:
            return int(entry.name)
    raise AssertionError(f"rank {rank} of job {job} not found")


@pytest.mark.timeout(900)
def test_megatron_rank_exception_and_stopped_rank_restart_in_place(
    cluster: DevCluster, tmp_path: Path
) -> None:
    marker = tmp_path / "raised"
    with coordinator(cluster, tmp_path, **tiers_env(tmp_path), **PLAN_ENV) as c, logs_kept(c, tmp_path):
        job = submit_megatron(
            c, tmp_path, "mx", 2,
            TEST_MEGATRON_RAISE_AT="7", TEST_MEGATRON_RAISE_RANK="0", TEST_MEGATRON_RAISE_ONCE=str(marker),
        )  # fmt: skip
        task_id = f"mx.{job}"
        snap = c.wait(lambda s: task_of(s, task_id) and marker.exists(), "the injected exception", 300)
        snap = c.wait(
            lambda s: (
                s.tasks[task_id].state is TaskState.RUNNING and (s.tasks[task_id].last_iteration or 0) > 8
            ),
            "training past the exception",
            300,
        )
        nodes = snap.tasks[task_id].nodes
        (exc,) = [i for i in snap.incidents.values() if i.task_id == task_id]
        assert exc.status.value == "other_software_error", exc
        stages = [e.stage for e in exc.timeline]
        assert LadderStage.RESTART_PROCESSES in stages and LadderStage.ISOLATE not in stages, stages
        # The rank's exception reached unicornd through torchrun's error file (@record).
        assert "injected by the test" in exc.evidence, exc.evidence

        # A rank stopped (SIGSTOP): Megatron-LM's log goes quiet; unicornd calls it a hang and
        # restarts the processes in place; nothing is drained. Stopped once the monitor has
        # relearned the restarted run: its train steps, and its checkpoint steps (after each
        # save, which is announced) from three saves.
        snap = c.wait(
            lambda s: running(s, task_id, 5 * SAVE_INTERVAL - 3), "three saves after the restart", 300
        )
        mark = snap.tasks[task_id].last_iteration or 0
        pid = rank_pid(cluster, job, 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            snap = c.wait(
                lambda s: any(
                    i.status.value == "task_hang" for i in s.incidents.values() if i.task_id == task_id
                ),
                "the stopped rank seen as a hang",
                120,
            )
            snap = c.wait(
                lambda s: (
                    s.tasks[task_id].state is TaskState.RUNNING
                    and (s.tasks[task_id].last_iteration or 0) > mark + 2
                ),
                "training again after the hang",
                300,
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert snap.tasks[task_id].nodes == nodes
        assert all(snap.nodes[n].health is NodeHealth.HEALTHY for n in nodes)
        assert not any(node_reason(cluster, n) for n in nodes)
