"""The main job on the built-in local cluster: self-healing training, end to end.

Run by ``scripts/demo`` (after ``scripts/bootstrap``). It starts its own local cluster
(4 nodes x 1 fake GPU, state in ``.dev-cluster-demo/``), starts unicornd, and submits two
training tasks of the built-in trainer the way a user does, through the sbatch wrapper
(``sbatch ... etc/unicorn-job.sbatch --model FILE ... -- COMMAND``): one with the
wrapper's ``--weight``, one with sbatch's ``--unicorn-weight`` (the SPANK plugin). It kills
a node of the first one midway and prints what unicornd did: the incident timeline, the
new plan, and the loss curve continuing at the new layout. Then the node is revived and
resumed by the operator, rejoins, and is used again. Both tasks train to their last
iteration; the demo checks that their jobs ended COMPLETED with exit code 0 and that the
loss continued from checkpoints, and exits 1 otherwise. Everything it started is stopped
at the end.

``--megatron``: the same story with Megatron-LM's own ``pretrain_gpt.py``
(../shared/third_party/megatron-lm, unmodified; a tiny GPT on mock data, submitted with
``--framework megatron``) instead of the built-in trainer. Its CPU ranks run under the
test-only CUDA-to-CPU shim (tests/launcher/mcore/megatron_lm), exported to the jobs on
``PYTHONPATH`` as a user exports Megatron-LM's own path; the checkpoint tiers are per node,
so the killed node's shards come back from its peer's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# Shared folders this demo may make (torch's compile cache, made by importing the trainer's
# modules below; the agents' run root): removed at the end unless they were here before.
INDUCTOR = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
MADE = [d for d in (INDUCTOR, Path("/tmp/unicorn")) if not d.exists()]

from tests.system import megatron_job  # noqa: E402
from unicorn_core import redis_io  # noqa: E402
from unicorn_core.config import RedisConfig  # noqa: E402
from unicorn_core.keys import RedisKeys  # noqa: E402
from unicorn_core.model import ModelSpec  # noqa: E402
from unicorn_core.paths import AGENT_RUN_ROOT  # noqa: E402
from unicornd.state import NodeHealth, Policy, Snapshot, TaskState  # noqa: E402
from unicornd.store import read_snapshot  # noqa: E402

STATE = REPO / ".dev-cluster-demo"
REPORT = STATE / "report.html"  # unicornctl report --html of the run, kept after the demo
RUN = STATE / "demo"  # this run's files: the model file, the jobs' output, checkpoints
SHM = Path("/dev/shm/unicorn-ckpt-demo")  # the memory tier of this demo only (job ids repeat)
DEV = [str(REPO / "scripts" / "dev-cluster"), "--state-dir", str(STATE)]
BIN = Path(sys.executable).parent
WRAPPER = REPO / "etc" / "unicorn-job.sbatch"
PREFIX = "demo"  # Redis key prefix: this demo's unicornd, tasks and per-rank logs
ITERATIONS = 150
# What the planner sees: GPT-3 1.3B's shape (etc/tasks/gpt3-1.3b.toml), with a global batch of
# 12 so every data-parallel size up to 4 divides it (the built-in trainer runs that batch).
MODEL = ModelSpec(layers=24, hidden=2048, heads=16, sequence=2048, vocabulary=50257, global_batch=12)
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
LAUNCH = re.compile(r"\[unicorn-train\] layout (\S+) .*resumed_from=(\S+)")
ELAPSED = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] iteration\s+(\d+)/\s*\d+ \|"
    r".*?elapsed time per iteration \(ms\): ([0-9.]+)"
)
GAP_TOLERANCE = 0.02  # issue 21: the causes add up to the gap within 2 %
RATE_TOLERANCE = 0.05  # issue 21: the ledger's rate matches the training logs' within 5 %
ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
     "DEADLINE"}
)  # fmt: skip


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def sh(*argv: str, env: dict[str, str], cwd: Path | None = None) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def log_windows(texts: Iterable[str], ranges: Iterable[Sequence[int]]) -> tuple[float, int]:
    """(seconds, iterations) the training logs took over exactly the iterations the ledger
    counted as running (``ranges``: its inclusive ``running_ranges``), iteration by
    iteration: each iteration's ``elapsed time per iteration`` (the demo logs every
    iteration, so that is the wall time since the line before it), from the line that
    followed the previous iteration in the same run (a run's first line, whose time began at
    a restore, has none), the first such line of each iteration (a later one recomputed it).
    Lines of every node in time order (the logging rank moves when the layout changes)."""
    wanted = {k for first, last in ranges for k in range(int(first), int(last) + 1)}
    lines = sorted(
        (stamp, n, pos, int(it), float(ms))
        for n, text in enumerate(texts)
        for pos, (stamp, it, ms) in enumerate(ELAPSED.findall(text))
    )
    previous: dict[int, int] = {}
    counted: set[int] = set()
    seconds = 0.0
    for _, n, _, k, ms in lines:
        if previous.get(n) == k - 1 and k in wanted and k not in counted:
            seconds += ms / 1000
            counted.add(k)
        previous[n] = k
    return seconds, len(counted)


def short(arg: str) -> str:
    """An argument as the user would type it, from the repository root."""
    return arg.replace(f"{REPO}/", "")


@dataclass
class Job:
    """One submitted task: its Slurm job, its unicorn task id, its output file, how it ended."""

    name: str
    job_id: int
    output: Path
    end: dict[str, str] | None = None  # `scontrol show job` once it ended (kept MinJobAge = 60 s)

    @property
    def task_id(self) -> str:
        return f"{self.name}.{self.job_id}"


class Demo:
    def __init__(self, *, megatron: bool = False) -> None:
        self.megatron = megatron
        self.started = time.monotonic()
        subprocess.run([*DEV, "down"], capture_output=True, check=False)
        shutil.rmtree(AGENT_RUN_ROOT / PREFIX, ignore_errors=True)  # agents' logs of an earlier demo
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(SHM, ignore_errors=True)
        subprocess.run([*DEV, "up", "--nodes", "4", "--gpus-per-node", "1"], check=True)
        RUN.mkdir(parents=True)
        dev_env = subprocess.run([*DEV, "env", "--json"], check=True, capture_output=True, text=True).stdout
        self.env = {
            **os.environ,
            **json.loads(dev_env),
            "UNICORN_REDIS__KEY_PREFIX": PREFIX,
            "UNICORN_CKPT__SHM_DIR": str(SHM),
            "UNICORN_CKPT__LOCAL_DIR": str(RUN / "ckpt-local"),
            # Replication ports of its own: agents of the system tests' clusters, beside this
            # one, listen on the default ports of the same job ids.
            "UNICORN_CKPT__PEER_PORT_BASE": "28000",
            # What the wrapper runs in the job (sbatch exports this environment to it).
            "UNICORNCTL": str(BIN / "unicornctl"),
            "UNICORN_WAIT_OPTIONS": "--progress-interval-s 10",
            # torchrun's torchelastic_* and the ranks' scratch go with this run's files.
            "TMPDIR": str(RUN),
        }
        if megatron:
            self.env |= {
                # Per node, as real nodes' memory and disks are.
                "UNICORN_CKPT__SHM_DIR": str(SHM / "{node}"),
                "UNICORN_CKPT__LOCAL_DIR": str(RUN / "ckpt-local" / "{node}"),
                **megatron_job.PLAN_ENV,
                **megatron_job.job_env(),
            }
        self.keys = RedisKeys(PREFIX)
        self.log = (STATE / "unicornd.log").open("ab")
        self.daemon = subprocess.Popen(
            [str(BIN / "unicornd")],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.jobs: dict[str, Job] = {}
        self.model = RUN / "model.toml"
        model, about = (
            (megatron_job.MODEL, "the tiny GPT Megatron-LM trains (tests/system/megatron_job.py)")
            if megatron
            else (MODEL, "GPT-3 1.3B's shape with a global batch of 12 (see scripts/demo.py)")
        )
        self.model.write_text(
            f"# {about}\n[model]\n"
            + "".join(f"{f} = {getattr(model, f)}\n" for f in ("layers", "hidden", "heads", "sequence",
                                                              "vocabulary", "global_batch"))
        )  # fmt: skip
        self.launches_before_kill = 0
        self.ends_read_s = 0.0
        self.goodput: dict[str, object] = {}

    # --- reading unicornd's state --------------------------------------------------------

    def snapshot(self) -> Snapshot:
        async def go() -> Snapshot | None:
            client = redis_io.connect(RedisConfig(url=self.env["UNICORN_REDIS__URL"]))
            try:
                return await read_snapshot(client, self.keys, Policy())
            finally:
                await client.aclose()

        snap = asyncio.run(go())
        assert snap is not None, "unicornd has not written its state"
        return snap

    def wait(self, pred: Callable[[Snapshot], bool], what: str, timeout_s: float = 240) -> Snapshot:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise SystemExit(f"unicornd exited {self.daemon.returncode}; see {STATE / 'unicornd.log'}")
            self.record_ends()
            try:
                snap = self.snapshot()
                if pred(snap):
                    return snap
            except AssertionError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"timed out waiting for {what}; see {STATE / 'unicornd.log'} and {RUN}/*.out")

    def ctl(self, *args: str) -> str:
        """``unicornctl ARGS`` as an operator types it, its output indented."""
        print(f"$ unicornctl {' '.join(args)}")
        out = subprocess.run([str(BIN / "unicornctl"), *args], capture_output=True, text=True, env=self.env,
                             check=False)  # fmt: skip
        shown = out.stdout if out.returncode == 0 else out.stdout + out.stderr  # stderr: its logs
        for line in shown.rstrip().splitlines():
            print(f"  {line}")
        return out.stdout

    # --- Slurm ------------------------------------------------------------------------------

    def job_fields(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as key=value ({} once Slurm has forgotten the job)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True,
                             env=self.env, check=False).stdout  # fmt: skip
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def record_ends(self) -> None:
        """Note how each job ended while Slurm still knows it (no slurmdbd here, so no sacct)."""
        if time.monotonic() - self.ends_read_s < 2:
            return
        self.ends_read_s = time.monotonic()
        for job in self.jobs.values():
            if job.end is None:
                fields = self.job_fields(job.job_id)
                if fields.get("JobState") in ENDED:
                    job.end = fields

    def submit(self, name: str, slurm: tuple[str, ...], unicorn: tuple[str, ...]) -> Job:
        ckpt = RUN / f"ckpt-{name}"
        command: tuple[str, ...] = (
            sys.executable, "-m", "launcher.train", f"--iterations={ITERATIONS}", "--layers=12",
            "--hidden=32", "--heads=4", "--seq=16", "--vocab=64", f"--save-dir={ckpt}", f"--load={ckpt}",
            "--save-interval=5", "--log-interval=1",  # each iteration: the ledger check compares them
        )  # fmt: skip
        if self.megatron:
            command = megatron_job.task_command(ckpt, ITERATIONS)
            unicorn = ("--framework", "megatron", *unicorn)
        # --max-gpus 2: each task keeps to its two nodes' worth, so the first to finish does
        # not hand its nodes to the other in the demo's last seconds.
        argv = (
            "sbatch", "-N", "2", "-J", name, "-o", str(RUN / f"{name}-%j.out"), *slurm, str(WRAPPER),
            "--model", str(self.model), "--max-gpus", "2", *unicorn, "--", *command,
        )  # fmt: skip
        shown = [short(a) for a in argv[: argv.index("--") + 5]]
        print(f"$ {shlex.join(shown)} ...")
        out = sh(argv[0], "--parsable", *argv[1:], env=self.env, cwd=RUN)
        job_id = int(out.strip().split(";")[0])
        job = Job(name, job_id, RUN / f"{name}-{job_id}.out")
        self.jobs[name] = job
        print(f"  job {job_id}: task {job.task_id}, output in {short(str(job.output))}")
        return job

    def spank_weight(self) -> bool:
        """Whether this cluster's sbatch has the SPANK plugin's --unicorn-weight (needs gcc)."""
        help_text = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, env=self.env,
                                   check=False).stdout  # fmt: skip
        return "--unicorn-weight" in help_text

    # --- training logs ------------------------------------------------------------------------

    def train_logs(self, job: Job) -> dict[str, str]:
        """Each node's training output (every rank on that node), by node."""
        root = AGENT_RUN_ROOT / PREFIX / str(job.job_id)
        return {p.parent.name: p.read_text(errors="replace") for p in sorted(root.glob("*/train.log"))}

    def curve(self, job: Job) -> tuple[list[tuple[str, str]], dict[int, float]]:
        """The task's launches (layout, resumed from) and its loss by iteration, all nodes merged."""
        launches: list[tuple[str, str]] = []
        points: dict[int, float] = {}
        for text in self.train_logs(job).values():
            if self.megatron:  # rank 0's start-up lines: the layout, the iteration it loaded
                launches += [(r.layout, str(r.loaded)) for r in megatron_job.runs(text) if r.layout]
            else:
                launches += LAUNCH.findall(text)
            points |= {int(i): float(v) for i, v in LOSS.findall(text)}
        return launches, points

    def losses(self, job: Job, mark: int | None = None) -> None:
        launches, points = self.curve(job)
        for layout, start in launches:
            origin = "from scratch" if start in {"None", "0"} else f"resumed from iteration {start}"
            print(f"  {job.task_id}: launch at {layout}, {origin}")
        if not points:
            return
        its = sorted(points)
        step = max(1, len(its) // 12)
        near = [i for i in its if mark is not None and abs(i - mark) <= 5]  # around the kill
        shown = sorted({*its[::step], its[-1], *near})
        print(f"  {job.task_id} loss " + ", ".join(f"{i}:{points[i]:.3f}" for i in shown))

    # --- the story ----------------------------------------------------------------------------

    def run(self) -> bool:
        spank = self.spank_weight()
        say("two training tasks through the sbatch wrapper, 2 nodes each, weights 1.0 and 1.2")
        a = self.submit("a", (), ("--weight", "1.0"))
        if spank:
            b = self.submit("b", ("--unicorn-weight=1.2",), ())
        else:
            print("  (sbatch has no --unicorn-weight here: the SPANK plugin was not built; using --weight)")
            b = self.submit("b", (), ("--weight", "1.2"))

        def both_training(s: Snapshot) -> bool:
            ok = [
                t.state is TaskState.RUNNING and (t.last_iteration or 0) >= 8
                for t in (s.tasks.get(a.task_id), s.tasks.get(b.task_id))
                if t is not None
            ]
            return len(ok) == 2 and all(ok)

        snap = self.wait(both_training, "both tasks training")
        self.ctl("tasks")
        # A node of task a that is not its batch host (that one runs the wrapper's batch script).
        batch_host = self.job_fields(a.job_id).get("BatchHost")
        victim = [n for n in snap.tasks[a.task_id].nodes if n != batch_host][-1]
        say(f"kill node {victim} of task {a.task_id} (slurmd, agent and ranks: SIGKILL)")
        mark = snap.tasks[a.task_id].last_iteration or 0
        self.launches_before_kill = len(self.curve(a)[0])
        t0 = time.monotonic()
        subprocess.run([*DEV, "kill-node", victim], check=True)

        def resumed(s: Snapshot) -> bool:
            t = s.tasks[a.task_id]
            return victim not in t.nodes and t.state is TaskState.RUNNING and (t.last_iteration or 0) > mark

        snap = self.wait(resumed, f"task {a.task_id} resumed")
        print(f"task {a.task_id} training again {time.monotonic() - t0:.1f} s after the kill "
              f"(it had reported iteration {mark})")  # fmt: skip
        self.ctl("status")
        self.ctl("incidents", "--all")
        self.losses(a, mark)

        say(f"the node comes back; the operator resumes it; a replan gives {victim} back to {a.task_id}")
        subprocess.run([*DEV, "revive-node", victim], check=True)
        time.sleep(2)
        self.ctl("resume", victim, "--yes")

        def used_again(s: Snapshot) -> bool:
            t = s.tasks[a.task_id]
            if t.state is TaskState.FINISHED:
                raise SystemExit(f"task {a.task_id} finished before {victim} was used again")
            return (s.nodes[victim].health is NodeHealth.HEALTHY and victim in t.nodes
                    and t.state is TaskState.RUNNING)  # fmt: skip

        self.wait(used_again, f"{victim} used again")
        self.ctl("tasks")

        say(f"both tasks train to iteration {ITERATIONS}; each job ends with its training's result")
        last_line = time.monotonic()

        def ended(s: Snapshot) -> bool:
            nonlocal last_line
            if time.monotonic() - last_line > 15:
                last_line = time.monotonic()
                now = [f"{t.task_id} {t.state.value}, iteration {t.last_iteration}" for t in s.tasks.values()]
                print("  " + "; ".join(sorted(now)))
            return all(j.end is not None for j in self.jobs.values())

        self.wait(ended, "both jobs to end", timeout_s=900)
        for job, last in ((a, None), (b, 4)):  # a's whole story; b's end
            lines = job.output.read_text(errors="replace").splitlines()
            what = "" if last is None else f", last {last} lines"
            print(f"\n{short(str(job.output))} (the job's output{what}):")
            for line in lines[-last if last else 0 :]:
                print(f"  {line if len(line) <= 150 else line[:149] + '…'}")
        print()
        self.ctl("incidents", "--all")
        print()
        self.ctl("status")
        say("loss curves (per-rank logs, every node of each job merged)")
        self.losses(a, mark)
        self.losses(b)
        say("goodput: achieved vs ideal WAF, and what the failure cost by cause (unicornd's ledger)")
        self.ctl("goodput")
        out = subprocess.run([str(BIN / "unicornctl"), "goodput", "--json"], capture_output=True, text=True,
                             env=self.env, check=False)  # fmt: skip
        self.goodput = json.loads(out.stdout) if out.returncode == 0 else {}
        say("the operator's page: nodes, layouts, incident timelines, achieved vs ideal WAF")
        REPORT.unlink(missing_ok=True)
        self.ctl("report", "--html", str(REPORT))
        return self.verdict(mark)

    def verdict(self, mark: int) -> bool:
        """Print each task's result; True when both trained to the end through the failure."""
        say("result")
        snap = self.snapshot()
        failures = []
        for job in self.jobs.values():
            end = job.end or {}
            state, code = end.get("JobState", "?"), end.get("ExitCode", "?")
            task = snap.tasks.get(job.task_id)
            launches, points = self.curve(job)
            result = f"{task.state.value} at iteration {task.last_iteration}" if task else "unknown"
            print(
                f"  job {job.job_id} ({job.task_id}): {state}, exit code {code}, requeued "
                f"{end.get('Restarts', '?')} time(s); task {result}, {len(launches)} launch(es)"
            )
            if (state, code) != ("COMPLETED", "0:0"):
                failures.append(f"job {job.job_id} ended {state} with exit code {code}")
            if task is None or task.state is not TaskState.FINISHED or task.last_iteration != ITERATIONS:
                failures.append(f"task {job.task_id} did not finish at iteration {ITERATIONS}")
            if f"task finished at iteration {ITERATIONS}" not in job.output.read_text(errors="replace"):
                failures.append(f"{short(str(job.output))} does not say the task finished")
            if max(points, default=0) != ITERATIONS:
                failures.append(f"{job.task_id}'s logs end at iteration {max(points, default=0)}")
        failures += self.ledger_checks()
        a = self.jobs["a"]
        after = self.curve(a)[0][self.launches_before_kill :]
        if not after:
            failures.append(f"no launch of {a.task_id} after the kill in its logs")
        for layout, start in after:
            if not start.isdigit() or int(start) < mark - 5:  # --save-interval=5, and JIT saves
                failures.append(f"{a.task_id} relaunched at {layout} from iteration {start}, not near {mark}")
        if not REPORT.is_file():
            failures.append(f"unicornctl report --html wrote no {REPORT}")
        for why in failures:
            print(f"  FAILED: {why}")
        return not failures

    def ledger_checks(self) -> list[str]:
        """Issue 21's checks of the ledger: each task's causes add up to its gap (ideal less
        achieved) within 2 %, and each task's achieved rate matches the training logs': the
        iteration time of its running stretches (their time over their new iterations,
        measured by unicornd from the ranks' reports) against the logs' ``elapsed time per
        iteration`` (Megatron's: wall time between log lines) over exactly the iterations the
        ledger counted (:func:`log_windows`), within 5 %."""
        failures = []
        tasks = self.goodput.get("tasks")
        if not isinstance(tasks, dict):
            return ["no goodput ledger from unicornctl goodput --json"]
        for job in self.jobs.values():
            tid = job.task_id
            doc = tasks.get(tid)
            if not isinstance(doc, dict):
                failures.append(f"task {tid} is not in the goodput ledger")
                continue
            gap = doc["ideal"] - doc["achieved"]
            share = abs(doc["unattributed"]) / gap if gap > 0 else 0.0
            causes = ", ".join(f"{c} {v / 3600:.3g}" for c, v in doc["lost"].items() if v)
            explained = 100 * (1 - share)
            print(f"  {tid}: gap {gap / 3600:.4g} wTFLOP-h; the causes explain {explained:.1f} % ({causes})")
            if share > GAP_TOLERANCE:
                failures.append(f"{tid}: the causes leave {100 * share:.1f} % of the gap unexplained")
            logged_s, logged_n = log_windows(self.train_logs(job).values(), doc.get("running_ranges", []))
            if logged_n < 10 or doc["running_iterations"] < 10:
                n = f"{logged_n} logged iterations, {doc['running_iterations']} in the ledger"
                failures.append(f"{tid}: too few measurements ({n})")
                continue
            ledger_s, log_s = doc["running_s"] / doc["running_iterations"], logged_s / logged_n
            ratio = ledger_s / log_s
            print(
                f"  {tid}: iteration time in the ledger {ledger_s:.4f} s ({doc['running_iterations']} "
                f"iterations of its running stretches), in the training logs {log_s:.4f} s "
                f"({logged_n} iterations): ratio {ratio:.3f}"
            )
            if abs(ratio - 1) > RATE_TOLERANCE:
                failures.append(f"{tid}: the ledger's iteration time is {ratio:.3f}x the logs'")
        return failures

    def close(self) -> None:
        # While unicornd still runs: scancel makes the wrapper stop its task cleanly.
        active = [j.job_id for j in self.jobs.values() if j.end is None]
        for job_id in active:
            subprocess.run(["scancel", str(job_id)], env=self.env, check=False)
        deadline = time.monotonic() + 20
        while active and time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env,
                                 check=False).stdout.split()  # fmt: skip
            active = [j for j in active if str(j) in out]
            time.sleep(0.5)
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
        self.log.close()
        subprocess.run([*DEV, "down"], capture_output=True, check=False)
        shutil.rmtree(SHM, ignore_errors=True)
        # The agents' run folders (training logs, agent.out) go beside the demo's other files,
        # nothing stays in /tmp.
        agents = AGENT_RUN_ROOT / PREFIX
        if agents.is_dir():
            shutil.rmtree(STATE / "agent-logs", ignore_errors=True)
            shutil.copytree(agents, STATE / "agent-logs", ignore=shutil.ignore_patterns("*.sock"))
            shutil.rmtree(agents, ignore_errors=True)
        if INDUCTOR in MADE:
            shutil.rmtree(INDUCTOR, ignore_errors=True)
        if AGENT_RUN_ROOT in MADE:
            with contextlib.suppress(OSError):
                AGENT_RUN_ROOT.rmdir()  # only if nothing else uses it


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron", action="store_true", help="run Megatron-LM's pretrain_gpt.py instead")
    ap.add_argument(
        "--json",
        action="store_true",
        help="end with the goodput ledger (unicornctl goodput --json) on one line",
    )
    args = ap.parse_args()
    if args.megatron and not (megatron_job.MEGATRON_LM / "pretrain_gpt.py").exists():
        where = megatron_job.MEGATRON_LM
        ap.error(f"Megatron-LM's pretrain_gpt.py not found under {where} (set UNICORN_MEGATRON_LM)")
    demo = Demo(megatron=args.megatron)
    try:
        ok = demo.run()
    finally:
        demo.close()
    took = time.monotonic() - demo.started
    if ok:
        say(f"done in {took:.0f} s: both tasks trained to the end through a node failure; cluster stopped")
    else:
        say(f"the demo FAILED after {took:.0f} s (see above; logs in {short(str(STATE))}/); cluster stopped")
    if args.json:
        print(json.dumps(demo.goodput, separators=(",", ":")), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
