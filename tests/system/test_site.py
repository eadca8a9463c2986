"""A shared site's cluster (issue 24's done-when): partition ``gpu`` (n1-n5) is unicorn's,
with two GPU types (n1-n3 ``a100``, n4-n5 ``h100``); partition ``cpu`` (n6) is outside its
scope. Another user's job runs on n6 and on n5. A node kill is recovered without touching
any node outside the scope or of the other user's job, and every task stays on one GPU
type."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import DevCluster, private_cluster
from tests.system.coordinator import PLANNER_MODEL, Coordinator, coordinator, trainer_command
from unicornd.control import RequestRefused
from unicornd.state import NodeHealth, Snapshot, TaskRecord, TaskState

pytestmark = [pytest.mark.system, pytest.mark.slurm_release]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with private_cluster(
        tmp_path_factory, "site", "--nodes", "6", "--gpus-per-node", "1", "--cpu-nodes", "1",
        "--gpu-types", "a100,h100",
    ) as c:  # fmt: skip
        yield c


def foreign_job(cluster: DevCluster, *options: str) -> int:
    """Another user's job (not unicorn's), running."""
    out = cluster.slurm(
        "sbatch", "--parsable", "--job-name=etl", "--output=/dev/null", *options, "--wrap=sleep 600"
    )
    job = int(out.stdout.strip().split(";")[0])
    deadline = time.monotonic() + 30
    while cluster.slurm("squeue", "-h", "-j", str(job), "-o", "%T").stdout.strip() != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} did not start"
        time.sleep(0.2)
    return job


def hold_gpu_job(c: Coordinator, name: str, nodes: str) -> tuple[int, tuple[str, ...]]:
    """A batch job holding ``nodes`` and one GPU on each, running (what the wrapper's job
    is on a site: it holds GRES, so unicorn grows it by requeue, never by expansion)."""
    out = c.cluster.slurm(
        "sbatch", "--parsable", "-N", str(len(nodes.split(","))), "-w", nodes, "--gres=gpu:1",
        "--no-kill", "-J", name, "-o", "/dev/null", "--wrap", "sleep 100000",
    )  # fmt: skip
    job = int(out.stdout.strip().split(";")[0])
    deadline = time.monotonic() + 30
    while c.cluster.slurm("squeue", "-h", "-j", str(job), "-o", "%T").stdout.strip() != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} did not start"
        time.sleep(0.2)
    return job, tuple(nodes.split(","))


def task(c: Coordinator, name: str, nodes: str, tmp: Path, gpu_types: tuple[str, ...] = ()) -> TaskRecord:
    job, held = hold_gpu_job(c, name, nodes)
    return TaskRecord(
        task_id=name, name=name, model=PLANNER_MODEL, command=trainer_command(tmp / f"ckpt-{name}"),
        min_gpus=1, job_id=job, nodes=held, gpu_types=gpu_types,
    )  # fmt: skip


def training(task_id: str, past: int = 0, on: tuple[str, ...] | None = None) -> Callable[[Snapshot], bool]:
    def pred(s: Snapshot) -> bool:
        t = s.tasks.get(task_id)
        return (
            t is not None
            and t.state is TaskState.RUNNING
            and (t.last_iteration or 0) > past
            and (on is None or t.nodes == on)
        )

    return pred


def one_type(s: Snapshot, t: TaskRecord) -> set[str]:
    return {s.nodes[n].gpu_type for n in t.nodes}


def test_the_dev_cluster_has_two_gpu_types_and_a_cpu_partition(site: DevCluster) -> None:
    out = site.slurm("sinfo", "-h", "-N", "-o", "%N %P %G").stdout.split("\n")
    assert sorted(line.strip() for line in out if line.strip()) == [
        "n1 gpu* gpu:a100:1", "n2 gpu* gpu:a100:1", "n3 gpu* gpu:a100:1",
        "n4 gpu* gpu:h100:1", "n5 gpu* gpu:h100:1", "n6 cpu gpu:1",
    ]  # fmt: skip


def test_a_node_kill_touches_only_unicorns_nodes_and_keeps_each_task_on_one_gpu_type(
    site: DevCluster, tmp_path: Path
) -> None:
    on_cpu = foreign_job(site, "--partition=cpu", "--nodes=1")
    on_n5 = foreign_job(site, "--partition=gpu", "--nodelist=n5", "--nodes=1")
    try:
        with coordinator(site, tmp_path, UNICORN_SLURM__PARTITIONS="gpu") as c:
            a = task(c, "a", "n1,n2", tmp_path)  # any type: it runs on A100s
            b = task(c, "b", "n4", tmp_path, gpu_types=("h100",))
            c.register(a)
            c.register(b)
            snap = c.wait(
                lambda s: training("a", 5)(s) and "n2" in s.tasks["a"].nodes and training("b", 3, ("n4",))(s),
                "a on A100s with n2 and b on n4 training",
                180,
            )
            # a holds GRES on 2 nodes: it is planned on A100s only, and not past its own size
            # (the spare n3 stays free: 22.05 refuses to requeue a job onto more nodes).
            assert snap.tasks["a"].nodes == ("n1", "n2") and snap.tasks["a"].max_gpus == 2
            assert sorted(snap.nodes) == ["n1", "n2", "n3", "n4", "n5"]  # n6 (cpu) never enters
            assert {n: snap.nodes[n].gpu_type for n in snap.nodes} == {
                "n1": "a100", "n2": "a100", "n3": "a100", "n4": "h100", "n5": "h100",
            }  # fmt: skip
            assert snap.foreign_jobs("n5") == (on_n5,)
            b_before = snap.tasks["b"]

            site.script("kill-node", "n2")
            try:
                drained = (NodeHealth.DRAINING, NodeHealth.DRAINED)
                snap = c.wait(lambda s: s.nodes["n2"].health in drained, "n2 drained", 60)
                mark = snap.tasks["a"].last_iteration or 0
                snap = c.wait(
                    lambda s: training("a", mark)(s) and "n2" not in s.tasks["a"].nodes,
                    "a training again without n2",
                    180,
                )
            finally:
                site.script("revive-node", "n2")
            # a stayed on the A100s (n1, or n1 and the spare n3), never an H100 (n4 is b's, n5 the
            # other user's).
            assert one_type(snap, snap.tasks["a"]) == {"a100"}, snap.tasks["a"].nodes
            assert set(snap.tasks["a"].nodes) <= {"n1", "n3"}
            assert one_type(snap, snap.tasks["b"]) == {"h100"}
            # b, its node, the other user's jobs and nodes: untouched.
            assert snap.tasks["b"].nodes == ("n4",) and snap.tasks["b"].launched_s == b_before.launched_s
            for job in (on_cpu, on_n5):
                state = site.slurm("squeue", "-h", "-j", str(job), "-o", "%T").stdout.strip()
                assert state == "RUNNING", (job, state)
            states = site.slurm("sinfo", "-h", "-N", "-n", "n4,n5,n6", "-o", "%N %T").stdout
            assert "drain" not in states and "down" not in states, states
            assert all(snap.nodes[n].health is NodeHealth.HEALTHY for n in ("n3", "n4", "n5"))
            c.resume("n2")
            # A task accepting only a type no node has is refused at registration.
            wrong = TaskRecord(
                task_id="v", name="v", model=PLANNER_MODEL, command=trainer_command(tmp_path / "ckpt-v"),
                job_id=b.job_id, nodes=("n4",), gpu_types=("v100",),
            )  # fmt: skip
            with pytest.raises(RequestRefused, match="no node unicorn manages has GPU type v100"):
                c.register(wrong)
            assert "v" not in (c.snapshot() or snap).tasks
    finally:
        site.slurm("scancel", str(on_cpu), str(on_n5), check=False)
