"""The sbatch wrapper end to end: sbatch etc/unicorn-job.sbatch on a real cluster, a real
unicornd, real agents and torchrun training; scancel, a short run, bad options."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import msgspec
import pytest
import redis

from launcher.probe import find_agents
from tests.conftest import REPO, DevCluster, private_cluster
from tests.system.coordinator import (
    PLANNER_MODEL,
    Coordinator,
    coordinator,
    iterations,
    resumes,
    train_log,
    trainer_command,
)
from unicorn_core import acl, munge
from unicorn_core.keys import PAYLOAD_FIELD
from unicornd.cli import EXIT_NOT_OPERATOR
from unicornd.control import ControlClient, Register, RequestRefused, encode_request, registration_digest
from unicornd.state import NodeHealth, Snapshot, TaskState

pytestmark = pytest.mark.system

WRAPPER = REPO / "etc" / "unicorn-job.sbatch"
UNICORNCTL = Path(sys.executable).parent / "unicornctl"
ENV: dict[str, str] = {}  # default detection settings (CPU wait is not counted as a hang)
_LOG_LINE = re.compile(r"training output \(every rank of a node\): (\S+) on node\(s\) (\S+)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """2 nodes with 1 GPU each."""
    with private_cluster(tmp_path_factory, "wrapper", "--nodes", "2", "--gpus-per-node", "1") as c:
        yield c


def isolated(tmp: Path) -> dict[str, str]:
    """unicornd's env (the agents inherit it): checkpoint tiers of this test only (job ids
    repeat across clusters, and a memory-tier snapshot of another job 2 would be restored)."""
    return {**ENV, "UNICORN_CKPT__SHM_DIR": str(tmp / "shm"), "UNICORN_CKPT__LOCAL_DIR": str(tmp / "local")}


def model_file(tmp: Path) -> Path:
    """The planner's model (ModelSpec fields at the top level of a TOML file)."""
    path = tmp / "model.toml"
    fields = ("layers", "hidden", "heads", "sequence", "vocabulary", "global_batch")
    path.write_text("".join(f"{f} = {getattr(PLANNER_MODEL, f)}\n" for f in fields))
    return path


def sbatch(
    c: Coordinator, tmp: Path, slurm: tuple[str, ...], unicorn: tuple[str, ...], **env: str
) -> subprocess.CompletedProcess[str]:
    """``sbatch [slurm] etc/unicorn-job.sbatch [unicorn]`` from ``tmp``, output in job-<id>.out there."""
    return subprocess.run(
        ["sbatch", "--parsable", "-o", str(tmp / "job-%j.out"), *slurm, str(WRAPPER), *unicorn],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp,
        check=False,
        env={
            **c.env,
            "UNICORNCTL": str(UNICORNCTL),
            "UNICORN_WAIT_OPTIONS": "--progress-interval-s 2 --poll-s 0.25",
            **env,
        },
    )


def submit(c: Coordinator, tmp: Path, slurm: tuple[str, ...], unicorn: tuple[str, ...], **env: str) -> int:
    out = sbatch(c, tmp, slurm, unicorn, **env)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def until(pred: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def job_fields(cluster: DevCluster, job: int) -> dict[str, str]:
    """``scontrol show job`` as key=value (the record stays MinJobAge after the end)."""
    out = cluster.slurm("scontrol", "-o", "show", "job", str(job)).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def job_active(cluster: DevCluster, job: int) -> bool:
    return bool(cluster.slurm("squeue", "-h", "-j", str(job), "-o", "%T", check=False).stdout.strip())


def output(tmp: Path, job: int) -> str:
    path = tmp / f"job-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def test_bad_weight_is_rejected_before_registration(cluster: DevCluster, tmp_path: Path) -> None:
    cmd = trainer_command(tmp_path / "ckpt")
    with coordinator(cluster, tmp_path, **isolated(tmp_path)) as c:
        # A wrapper option: the job starts, the wrapper refuses it before registering (exit 2).
        job = submit(
            c, tmp_path, ("-N", "1"), ("--model", str(model_file(tmp_path)), "--weight", "3", "--", *cmd)
        )
        until(lambda: not job_active(cluster, job), "the job with a bad weight to end", 30)
        fields = job_fields(cluster, job)
        assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0"), fields
        assert "--weight = '3': the weight must be a number between 0.5 and 2.0" in output(tmp_path, job)
        # The SPANK variable (sbatch --unicorn-weight / UNICORN_WEIGHT): refused at submission.
        refused = sbatch(
            c, tmp_path, ("-N", "1"), ("--model", str(model_file(tmp_path)), "--", *cmd), UNICORN_WEIGHT="3"
        )
        assert refused.returncode != 0 and "the weight must be a decimal number between" in refused.stderr
        with c.client() as r:
            assert r.xlen(c.keys.control()) == 0  # nothing was ever sent to unicornd
        snap = c.snapshot()
        assert snap is not None and not snap.tasks


def test_short_run_finishes_with_exit_0(cluster: DevCluster, tmp_path: Path) -> None:
    cmd = trainer_command(tmp_path / "ckpt", "--iterations=6")
    with coordinator(cluster, tmp_path, **isolated(tmp_path)) as c:
        job = submit(
            c,
            tmp_path,
            ("-N", "1", "-J", "short"),
            ("--model", str(model_file(tmp_path)), "--max-gpus", "1", "--", *cmd),
        )  # --max-gpus 1: the job keeps its one node (the planner would grow it onto the idle one)
        until(lambda: not job_active(cluster, job), "the short job to end by itself", 120)
        fields = job_fields(cluster, job)
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (
            fields,
            output(tmp_path, job),
        )
        snap = c.snapshot()
        assert snap is not None
        task = snap.tasks[f"short.{job}"]
        # The final iteration is recorded although progress is persisted every 10 iterations.
        assert task.state is TaskState.FINISHED and task.last_iteration == 6, task
        assert "task finished at iteration 6" in output(tmp_path, job)
        log = train_log(c.keys.prefix, job, fields["NodeList"])
        assert [it for it, _ in iterations(log)][-1] == 6, log


def roles(tmp: Path) -> dict[str, str]:
    """unicornd's settings for the operator and user Redis roles (password files in ``tmp``)."""
    (tmp / "operator.pass").write_text("operator-secret\n")
    (tmp / "user.pass").write_text("user-secret\n")
    return {
        "UNICORN_REDIS__OPERATOR_PASSWORD_FILE": str(tmp / "operator.pass"),
        "UNICORN_REDIS__USER_PASSWORD_FILE": str(tmp / "user.pass"),
    }


def as_user(c: Coordinator, tmp: Path) -> dict[str, str]:
    """Environment overrides of a cluster user: no readable coordinator password, only the user's."""
    parts = urlsplit(c.env["UNICORN_REDIS__URL"])
    bare = urlunsplit((parts.scheme, f"{parts.hostname}:{parts.port}", parts.path, "", ""))
    return {
        "UNICORN_REDIS__URL": bare,
        "UNICORN_REDIS__PASSWORD_FILE": str(tmp / "not-readable-by-users"),
        "UNICORN_REDIS__OPERATOR_PASSWORD_FILE": str(tmp / "not-readable-by-users"),
    }


@contextlib.contextmanager
def traversable(folder: Path) -> Iterator[None]:
    """Let every user traverse (o+x) ``folder`` and its parents for a while, as on a real
    cluster where munged's socket is reachable by all."""
    changed = []
    for path in [folder, *folder.parents]:
        mode = path.stat().st_mode
        if not mode & stat.S_IXOTH:
            path.chmod(mode | stat.S_IXOTH)
            changed.append((path, mode))
    try:
        yield
    finally:
        for path, mode in changed:
            path.chmod(mode)


def training_processes(cluster: DevCluster, job: int) -> list[tuple[dict[str, str], Path]]:
    """(environment, working directory) of every rank of ``job`` of ``cluster`` (other
    clusters on this machine have their own job ``job``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            raw = (entry / "environ").read_bytes()
            env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
            ours = env.get("SLURM_CONF") == cluster.slurm_conf
            if ours and env.get("UNICORN_JOB_ID") == str(job) and "RANK" in env:
                found.append((env, (entry / "cwd").resolve()))
        except OSError:
            continue  # not ours, or exited while we looked
    return found


def test_submit_trains_and_scancel_stops_cleanly(cluster: DevCluster, tmp_path: Path) -> None:
    """Submitted, followed and cancelled by a plain user (Redis user ``<prefix>-user``);
    the job's agents run under their own Redis user, confined to the job's keys."""
    cmd = trainer_command(tmp_path / "ckpt")
    with coordinator(cluster, tmp_path, **isolated(tmp_path), **roles(tmp_path)) as c:
        user = as_user(c, tmp_path)
        user_env = {**c.env, **user}
        job = submit(
            c, tmp_path, ("-N", "2", "-J", "wrapped"),
            ("--model", str(model_file(tmp_path)), "--weight", "1.5", "--name", "w", "--", *cmd),
            **user, TRAINING_MARKER="exported at sbatch", CUDA_VISIBLE_DEVICES="batch-step-only",
        )  # fmt: skip
        task_id = f"w.{job}"
        in_squeue = ["wrapped", "RUNNING"]
        until(
            lambda: cluster.slurm("squeue", "-h", "-j", str(job), "-o", "%j %T").stdout.split() == in_squeue,
            "the job RUNNING in squeue",
        )
        snap = c.wait(
            lambda s: (
                task_id in s.tasks
                and s.tasks[task_id].state is TaskState.RUNNING
                and (s.tasks[task_id].last_iteration or 0) >= 3
            ),
            "running, iterations advancing",
            150,
        )
        shown = subprocess.run(
            [str(UNICORNCTL), "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=user_env,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        (doc,) = [t for t in json.loads(shown.stdout)["unicorn"]["tasks"] if t["task_id"] == task_id]
        assert (doc["job_id"], doc["weight"], doc["nodes"]) == (job, 1.5, ["n1", "n2"]), doc
        # The ranks run with the job's exported variables, in the directory sbatch ran in,
        # without the batch step's own variables; and they never see Redis credentials.
        ranks = training_processes(cluster, job)
        assert {env["RANK"] for env, _ in ranks} == {"0", "1"}, ranks  # (and the ranks' children)
        for env, cwd in ranks:
            assert env["TRAINING_MARKER"] == "exported at sbatch" and cwd == tmp_path.resolve()
            assert env.get("CUDA_VISIBLE_DEVICES") != "batch-step-only"
            assert "UNICORN_REDIS__URL" not in env and env["SLURM_JOB_ID"] == str(job)
        # The user is root here, so unicornctl's own operator check passes; Redis refuses.
        drain = subprocess.run(
            [str(UNICORNCTL), "drain", "n1", "--reason", "x", "--yes"],
            capture_output=True,
            text=True,
            timeout=60,
            env=user_env,
            check=False,
        )
        assert drain.returncode == EXIT_NOT_OPERATOR and "not an operator" in drain.stderr, drain.stderr
        assert c.snapshot().nodes["n1"].health is NodeHealth.HEALTHY  # type: ignore[union-attr]

        # Registering a task for this job is refused unless the job's owner (root here)
        # signed that very request with MUNGE: another user's, none, or a replayed one.
        forged = replace(snap.tasks[task_id], task_id=f"evil.{job}", name=f"evil.{job}",
                         state=TaskState.PENDING, layout=None, command=("/bin/true",))  # fmt: skip
        task_doc = forged.to_dict()
        digest = registration_digest(Register(task=task_doc, credential="-"))  # the digest leaves it out
        munge_socket = c.env["UNICORN_SLURM__MUNGE_SOCKET"]
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        with traversable(Path(munge_socket).parent):  # pytest's tmp folders are root's only
            nobody = subprocess.run(
                [*as_nobody, "munge", f"--socket={munge_socket}"], input=digest,
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.strip()  # fmt: skip
        root = asyncio.run(munge.sign(digest, socket=munge_socket))
        unsigned = msgspec.json.encode({"op": "register", "task": task_doc, "credential": ""})  # malformed
        refusals: dict[str, Register | bytes] = {
            "belongs to root; the request was signed by uid 65534": Register(
                task=task_doc, credential=nobody
            ),
            "no MUNGE credential": unsigned,
            "signs another request": Register(task={**task_doc, "weight": 2.0}, credential=root),
            "Replayed credential": Register(task=task_doc, credential=root),  # root's, used just above
        }
        for why, sent in refusals.items():
            payload = encode_request(sent) if isinstance(sent, Register) else sent
            with pytest.raises(RequestRefused, match=why):
                c._run(lambda cl, p=payload: ControlClient(cl, c.keys, timeout_s=10).send_payload(p))  # type: ignore[misc]
        assert f"evil.{job}" not in c.snapshot().tasks  # type: ignore[union-attr]

        # The agents' Redis user: their job's streams only.
        with c.client() as r:
            password = r.get(c.keys.agent_password(job))
            assert password is not None
            assert acl.agent_user(c.keys, job) in r.acl_users()
            agent = redis.Redis.from_url(
                acl.url_with_user(
                    user_env["UNICORN_REDIS__URL"], acl.agent_user(c.keys, job), password.decode()
                )
            )
            with pytest.raises(redis.exceptions.NoPermissionError):
                agent.xadd(c.keys.events(job + 1), {PAYLOAD_FIELD: b"forged"})
            with pytest.raises(redis.exceptions.NoPermissionError):
                agent.xadd(c.keys.operator_control(), {PAYLOAD_FIELD: b"forged"})
            assert r.xlen(c.keys.events(job)) > 0 and not r.exists(c.keys.events(job + 1))

        # The job's output: progress lines and where each node's training log is.
        until(
            lambda: _LOG_LINE.search(output(tmp_path, job)) is not None, "the log location in the output", 10
        )
        found = _LOG_LINE.search(output(tmp_path, job))
        assert found is not None and found.group(2) == "n[1-2]"
        logs = [Path(found.group(1).replace("<node>", n)) for n in ("n1", "n2")]
        assert iterations("".join(p.read_text() for p in logs))  # the last pipeline stage logs them
        until(
            lambda: "iteration" in output(tmp_path, job).split("training output")[-1], "a progress line", 30
        )

        cluster.slurm("scancel", str(job))
        until(lambda: not job_active(cluster, job), "the cancelled job to end", 30)
        snap = c.wait(lambda s: s.tasks[task_id].state is TaskState.STOPPED, "the task stopped", 15)
        assert snap.tasks[task_id].nodes == ()
        until(
            lambda: not find_agents(job, "n1") and not find_agents(job, "n2"), "no agents of the job left", 15
        )
        out = output(tmp_path, job)
        assert "SIGTERM: asking unicornd to stop the task" in out, out
        with c.client() as r:  # the job is gone: so are its agents' Redis user and password
            until(
                lambda: acl.agent_user(c.keys, job) not in r.acl_users(),
                "user gone",
                15,
            )
            assert not r.exists(c.keys.agent_password(job))
        assert "stopping after iteration" in "".join(p.read_text() for p in logs)  # saved on SIGTERM


@pytest.mark.slurm_release
def test_a_killed_node_is_drained_and_the_gpu_job_goes_on_smaller_then_grows_back_by_requeue(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """Node-kill recovery end to end through the wrapper (CI runs it on every Slurm release
    it tests), for a job holding GPUs (GRES): sbatch on both nodes, n2 dies, unicornd
    drains n2 and the same job trains on n1 from its checkpoint; n2
    comes back, the operator resumes it, and the job grows back onto it by a requeue
    (Slurm refuses to expand a job holding GRES)."""
    cmd = trainer_command(tmp_path / "ckpt")
    with coordinator(cluster, tmp_path, **isolated(tmp_path)) as c:
        job = submit(
            c,
            tmp_path,
            ("-N", "2", "--gres=gpu:1", "-J", "killed"),
            ("--model", str(model_file(tmp_path)), "--name", "k", "--", *cmd),
        )
        task_id = f"k.{job}"

        def training(nodes: tuple[str, ...], past: int) -> Callable[[Snapshot], bool]:
            def pred(s: Snapshot) -> bool:
                t = s.tasks.get(task_id)
                return (
                    t is not None
                    and t.state is TaskState.RUNNING
                    and t.nodes == nodes
                    and (t.last_iteration or 0) > past
                )

            return pred

        snap = c.wait(training(("n1", "n2"), 6), "the job training on n1 and n2, saved once", 150)
        assert snap.tasks[task_id].job_gres.endswith("gpu:1"), snap.tasks[task_id]
        try:
            cluster.script("kill-node", "n2")
            snap = c.wait(
                lambda s: s.nodes["n2"].health in (NodeHealth.DRAINING, NodeHealth.DRAINED), "n2 drained", 60
            )
            mark = snap.tasks[task_id].last_iteration or 0
            snap = c.wait(training(("n1",), mark), "the job training on n1 alone", 180)
            fields = job_fields(cluster, job)
            # In place (a shrink) or, when slurmctld set n2 DOWN first, requeued onto n1.
            assert (fields["JobState"], fields["NodeList"]) == ("RUNNING", "n1"), fields
            restarts = int(fields["Restarts"])
            reason = cluster.slurm("scontrol", "-o", "show", "node", "n2").stdout
            assert "Reason=unicorn: lost_connection" in reason, reason
            starts = resumes(train_log(c.keys.prefix, job, "n1"))
            assert len(starts) >= 2 and starts[-1] >= 5, starts  # from a checkpoint (every 5)
        finally:
            cluster.script("revive-node", "n2", check=False)
        c.resume("n2")
        mark = snap.tasks[task_id].last_iteration or 0
        c.wait(training(("n1", "n2"), mark), "the job grown back onto n2", 180)
        fields = job_fields(cluster, job)
        assert (fields["JobState"], fields["NodeList"]) == ("RUNNING", "n[1-2]"), fields
        assert int(fields["Restarts"]) == restarts + 1  # grown back by one requeue
        cluster.slurm("scancel", str(job))
        until(lambda: not job_active(cluster, job), "the job to end", 30)
