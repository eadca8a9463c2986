"""A DP rank killed mid-iteration costs only its micro-batches, end to end (issue 23, item 4).

Real Slurm, Redis, unicornd, agents and torchrun: a data-parallel task of the built-in
trainer with ``--reuse-microbatches`` on three one-GPU nodes (one CPU rank each). Rank 1
(on n2) SIGKILLs itself once it finished 1 of its micro-batches of iteration K. The
survivors (n1, n3) complete iteration K from the micro-batches they finished plus rank 1's,
save it and exit 4; unicornd restarts the task after the killed rank's exit, and the
restarted ranks resume at K + 1. The state saved after K equals an uninterrupted run's
(within 1e-6 relative; the float64 gradient sums make it equal), and so do the losses after.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DevCluster, private_cluster
from tests.launcher.test_trainer_reuse import max_relative_difference, saved_state
from tests.launcher.torchrun import run
from tests.system.coordinator import coordinator, resumes, train_log, trainer_command
from unicorn_core.model import ModelSpec
from unicornd.launch import trainer_layout_args
from unicornd.state import LadderStage, NodeHealth, Snapshot, TaskRecord, TaskState

pytestmark = pytest.mark.system

K = 12
"""The iteration in flight when rank 1 dies (not a multiple of the save interval, 5: the
version saved after K is the survivors')."""
TOTAL = 16
NODES = "n1,n2,n3"
MODEL = ModelSpec(layers=1, hidden=32, heads=4, sequence=16, vocabulary=64, global_batch=12)
"""What the planner sees: one layer, which no pipeline can split, and the task asks for all
three GPUs (``min_gpus``), so the plan is TP1 PP1 DP3 (for the trainer's own 12 layers the
planner picks PP3, and for one layer without ``min_gpus`` a single GPU: checked with
``plan.planner.plan_cluster``). The trainer runs the layers of its command."""
_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """3 nodes with 1 GPU each: one CPU rank per node."""
    with private_cluster(tmp_path_factory, "reuse", "--nodes", "3", "--gpus-per-node", "1") as c:
        yield c


def losses(log: str) -> dict[int, str]:
    """Iteration -> lm loss as printed, the newest line of each iteration."""
    return {int(m[1]): m[2] for m in _LOSS.finditer(log)}


def finished(snap: Snapshot, name: str) -> bool:
    return snap.tasks[name].state is TaskState.FINISHED


@pytest.mark.timeout(900)
def test_a_dp_rank_killed_mid_iteration_recomputes_only_its_microbatches(
    cluster: DevCluster, tmp_path: Path
) -> None:
    save = tmp_path / "ckpt"
    marker = tmp_path / "fault-fired"
    fault = (
        f"--fail-at-iteration={K}", "--fail-rank=1", "--fail-mode=kill", "--fail-after-microbatches=1",
        f"--fail-once-marker={marker}",
    )  # fmt: skip
    with coordinator(cluster, tmp_path) as c:
        job, held = c.hold_job("reuse", NODES)
        task = TaskRecord(
            task_id="reuse",
            name="reuse",
            model=MODEL,
            command=trainer_command(save, f"--iterations={TOTAL}", "--reuse-microbatches", *fault),
            min_gpus=len(held),
            max_gpus=len(held),
            job_id=job,
            nodes=held,
        )
        c.register(task)
        try:
            snap = c.wait(lambda s: finished(s, "reuse"), "the task finished", 600)
        except AssertionError:
            for node in held:  # what the ranks said (the run folders go with the coordinator)
                print(f"--- {node} train.log (tail) ---\n{train_log(c.keys.prefix, job, node)[-6000:]}")
            raise
        layout = snap.tasks["reuse"].layout
        assert layout is not None and (layout.tp, layout.pp, layout.dp) == (1, 1, 3), layout
        assert marker.exists()
        incidents = [i for i in snap.incidents.values() if i.task_id == "reuse"]
        assert len(incidents) == 1, incidents
        stages = [e.stage for e in incidents[0].timeline]
        assert LadderStage.RESTART_PROCESSES in stages and LadderStage.ISOLATE not in stages, stages
        assert all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values())
        logs = {n: train_log(c.keys.prefix, job, n) for n in held}

    per_iteration = MODEL.global_batch // layout.micro_batch
    lost = layout.num_microbatches  # rank 1's micro-batches: the only ones computed again
    summary = re.search(
        rf"iteration {K} completed without DP replicas \[1\] \(lost mid-iteration\): survivors \[0, 2\] "
        rf"agreed in ([0-9.]+) s, reused {per_iteration - lost} finished micro-batches, "
        rf"recomputed_microbatches={lost} microbatches_per_iteration={per_iteration}, ([0-9.]+) s after",
        logs[held[0]],
    )
    assert summary, logs[held[0]][-4000:]
    assert resumes(logs[held[0]]) == [0, K]  # the restart resumed right after the completed iteration
    print(f"recomputed {lost} of {per_iteration}; agreed in {summary[1]} s, completed {summary[2]} s after")
    saved = re.search(rf"exiting 4 after saving iteration {K} \(.*{save}\) ([0-9.]+) s after", logs[held[0]])
    assert saved, logs[held[0]][-3000:]

    # The uninterrupted run of the same command at the same layout, on this machine.
    ref = tmp_path / "ref"
    command = trainer_command(ref, f"--iterations={TOTAL}", "--reuse-microbatches", f"--save-interval={K}")
    args = [*command[3:], *trainer_layout_args(layout)]  # without "python -m launcher.train"
    reference = run(layout.world_size, *args, timeout_s=300, env={"TMPDIR": str(tmp_path)})
    assert reference.returncode == 0, reference.output[-3000:]
    after_k = f"iter_{K:07d}"
    survivors, uninterrupted = saved_state(save / after_k, tmp_path), saved_state(ref / after_k, tmp_path)
    difference = max_relative_difference(survivors, uninterrupted)
    print(f"max relative difference of model and optimizer after iteration {K}: {difference:.3e}")
    assert difference <= 1e-6
    expected = losses(reference.output)
    assert sorted(expected) == list(range(1, TOTAL + 1))
    got = losses(logs[held[-1]])  # the last rank logs; the restarted run's lines come last
    assert {i: got[i] for i in range(K, TOTAL + 1)} == {i: expected[i] for i in range(K, TOTAL + 1)}
