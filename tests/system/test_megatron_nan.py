"""A NaN in real Megatron-LM's data rolls the task back past it (issue 23).

``pretrain_gpt.py`` (tiny GPT, mock data, gloo, DP2 on two nodes) as a user submits it,
unmodified; the test-only shim gives the first sample of iteration K's global batch a NaN
loss mask (``TEST_MEGATRON_NAN_AT``), every time that sample is read: the data carries the
fault. What Megatron-LM 0.16 does with it (its default ``--rerun-mode validate_results``):
the loss check logs ``Unexpected result nan on rank 0 at iteration #K ... (message='found
NaN in local forward loss calculation')``, re-runs the step, finds the NaN reproducible,
saves iteration K-1 (marked for a re-run on another GPU) and exits 16; it never prints an
``lm loss: nan`` line. unicornd reads that message as a ``nan_loss`` at iteration K, rolls
the task back: the same command relaunched with Megatron's own ``--iterations-to-skip
K-1`` (and ``--rerun-mode disabled``, so the re-run marked in K-1 is not resumed), the
ranks load the newest version older than K, skip K's data and train to the end, the loss
free of NaN; no node is drained.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from detect.statuses import ErrorStatus
from tests.conftest import DevCluster, private_cluster
from tests.system.coordinator import coordinator, train_log
from tests.system.megatron_job import (
    MEGATRON_LM,
    MODEL,
    PLAN_ENV,
    SAVE_INTERVAL,
    job_env,
    model_file,
    runs,
    tiers_env,
    user_args,
)
from tests.system.test_megatron import logs_kept
from tests.system.test_unicornd import node_reason
from tests.system.test_wrapper import job_active, job_fields, output, submit, until
from unicornd.state import LadderStage, NodeHealth, Snapshot, TaskState

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        not (MEGATRON_LM / "pretrain_gpt.py").exists(),
        reason=f"Megatron-LM's training loop not found at {MEGATRON_LM} (set UNICORN_MEGATRON_LM)",
    ),
]

K = 12
"""The iteration whose data holds the NaN: after two saves (5 and 10)."""
ITERATIONS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """2 nodes with 1 GPU each: DP2, one CPU rank per node."""
    with private_cluster(tmp_path_factory, "megatron-nan", "--nodes", "2", "--gpus-per-node", "1") as c:
        yield c


def rolled_back(snap: Snapshot, task_id: str) -> bool:
    return any(i.task_id == task_id and i.rollback is not None for i in snap.incidents.values())


@pytest.mark.timeout(900)
def test_a_nan_in_megatron_data_rolls_back_skips_it_and_trains_to_the_end(
    cluster: DevCluster, tmp_path: Path
) -> None:
    with coordinator(cluster, tmp_path, **tiers_env(tmp_path), **PLAN_ENV) as c, logs_kept(c, tmp_path):
        job = submit(
            c, tmp_path, ("-N", "2", "-J", "mn"),
            ("--model", str(model_file(tmp_path)), "--framework", "megatron", "--name", "mn",
             "--max-gpus", "2", "--", str(MEGATRON_LM / "pretrain_gpt.py"),
             *user_args(tmp_path / "ckpt", ITERATIONS)),
            **job_env(TEST_MEGATRON_NAN_AT=str(K)),
        )  # fmt: skip
        task_id = f"mn.{job}"
        nodes = c.wait(lambda s: rolled_back(s, task_id), "the NaN rolled back", 300).tasks[task_id].nodes
        until(lambda: not job_active(cluster, job), "the Megatron-LM job to finish", 300)
        fields = job_fields(cluster, job)
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output(tmp_path, job)
        snap = c.wait(lambda s: s.tasks[task_id].state is TaskState.FINISHED, "the task finished", 30)

        # unicornd: a training-state NaN at K, rolled back once, nothing drained.
        task = snap.tasks[task_id]
        (inc,) = [i for i in snap.incidents.values() if i.task_id == task_id]
        assert inc.status is ErrorStatus.NAN_LOSS and inc.rollback is not None, inc
        assert (inc.rollback.first, inc.rollback.last, inc.rollback.iteration) == (K, K, K)
        assert "Unexpected result nan" in inc.evidence and f"iteration #{K}" in inc.evidence, inc.evidence
        version = inc.rollback.version
        # the newest complete version older than K: Megatron's own save of K-1 on its way
        # out, or the last --save-interval one when the roll back stopped that save
        newest_save = (K - 1) // SAVE_INTERVAL * SAVE_INTERVAL
        assert version is not None and newest_save <= version < K, inc
        assert inc.stage is LadderStage.CLOSED, inc
        assert f"rolled back to version {version}, iterations {K}-{K} skipped" in inc.note, inc.note
        assert LadderStage.ISOLATE not in [e.stage for e in inc.timeline]
        assert len(task.rollbacks) == 1 and task.skip_ranges() == ((K, K),)
        assert all(n.health is NodeHealth.HEALTHY for n in snap.nodes.values())
        assert not any(node_reason(cluster, n) for n in snap.nodes)

        # Megatron-LM's own logs: rank 0's node (the NaN, where it resumed), the last rank's
        # node (the iteration lines).
        first_node, last_node = nodes[0], nodes[-1]  # in node-rank order (a finished task holds none)
        head = train_log(c.keys.prefix, job, first_node)
        assert re.search(rf"Unexpected result nan on rank 0 at iteration #{K} ", head), head[-3000:]
        assert "lm loss: nan" not in head + train_log(c.keys.prefix, job, last_node)
        started = [r for r in runs(head) if r.loaded is not None or r.layout]
        assert started[-1].loaded == version, started
        starts = [m.start() for m in re.finditer(r"megatron checkpoints\s+memory_tier=", head)]
        resumed_args = head[starts[-1] :]
        assert re.search(rf"iterations_to_skip \.+ \[{K - 1}\]", resumed_args), resumed_args[:3000]
        assert re.search(r"rerun_mode \.+ disabled", resumed_args)

        printed = [r for r in runs(train_log(c.keys.prefix, job, last_node)) if r.steps]
        first, last = printed[0], printed[-1]
        assert [s.iteration for s in first.steps] == list(range(1, K)), first.steps  # NaN at K: no line
        want = [i for i in range(version + 1, ITERATIONS + 1) if i != K]
        assert [s.iteration for s in last.steps] == want, last.steps
        # K's samples were consumed and discarded: the data position still follows the iterations
        assert all(s.consumed == s.iteration * MODEL.global_batch for s in last.steps), last.steps
        assert all(math.isfinite(s.loss) for s in last.steps), last.steps
        print(f"NaN at {K}: rolled back to version {version}; lm loss at {ITERATIONS}: {last.steps[-1].loss}")
