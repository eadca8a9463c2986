"""Run a real unicornd against the dev cluster and watch its persisted state."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

import redis
import redis.sentinel

from tests.conftest import DevCluster
from unicorn_core import redis_io
from unicorn_core.config import RedisConfig
from unicorn_core.keys import RedisKeys
from unicorn_core.model import ModelSpec
from unicorn_core.paths import AGENT_RUN_ROOT, agent_run_dir
from unicornd.control import ControlClient
from unicornd.state import Policy, Snapshot, TaskRecord
from unicornd.store import decode_state, state_reads

UNICORND = Path(sys.executable).parent / "unicornd"
_prefixes = itertools.count()

PLANNER_MODEL = ModelSpec(layers=24, hidden=2048, heads=16, sequence=2048, vocabulary=50257, global_batch=12)
"""What the planner sees: a GPT-3 1.3B shape (the dev cluster's fake GPUs are planned as
A100s), with a global batch of 12 so every DP size up to 4 divides it."""

DP2_MODEL = ModelSpec(layers=12, hidden=512, heads=4, sequence=2048, vocabulary=50257, global_batch=12)
"""What the planner sees for a data-parallel task: a small model with long sequences, whose
best layout on two A100s is TP1 PP1 DP2 (about 1.6x one GPU's FLOP/s in the planner's
model): on two nodes it runs DP2, on one DP1."""

_ITER_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")
_RESUMED = re.compile(r"resumed_from=(\d+|None)")


def trainer_command(save_dir: Path, *extra: str) -> tuple[str, ...]:
    """The built-in trainer, tiny on CPU: 12 layers so PP 1..4 all divide them."""
    return (
        sys.executable,
        "-m",
        "launcher.train",
        "--iterations=100000",
        "--layers=12",
        "--hidden=32",
        "--heads=4",
        "--seq=16",
        "--vocab=64",
        f"--save-dir={save_dir}",
        f"--load={save_dir}",
        "--save-interval=5",
        "--log-interval=1",
        "--dist-timeout-s=30",
        *extra,
    )


def train_log(prefix: str, job_id: int, node: str) -> str:
    path = agent_run_dir(prefix, job_id, node) / "train.log"
    return path.read_text(errors="replace") if path.exists() else ""


def iterations(text: str) -> list[tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(2))) for m in _ITER_LINE.finditer(text)]


def resumes(text: str) -> list[int]:
    return [0 if m.group(1) == "None" else int(m.group(1)) for m in _RESUMED.finditer(text)]


def summary(snap: Snapshot | None) -> str:
    """What a failed wait saw, compactly and last (a CI log keeps only the end of the
    output): each task's state, nodes and iteration, each incident's stages and note."""
    if snap is None:
        return "no snapshot in Redis"
    out = ["--- state when the wait gave up ---"]
    for t in snap.tasks.values():
        out.append(
            f"task {t.task_id}: {t.state.value} job {t.job_id} on {list(t.nodes)} "
            f"iteration {t.last_iteration} layout {t.layout} "
            f"recoveries without progress {t.recoveries_without_progress}"
        )
    for name, n in sorted(snap.nodes.items()):
        out.append(f"node {name}: {n.health.value}")
    for inc in snap.incidents.values():
        stages = " > ".join(
            e.stage.value + (f" ({e.detail[:120]})" if e.detail else "") for e in inc.timeline
        )
        out.append(
            f"incident {inc.incident_id}: {inc.status.value} {inc.severity.name} on {inc.node} "
            f"rule {inc.rule} [{stages}] evidence {inc.evidence[:300]!r} note {inc.note[:500]!r}"
        )
    return "\n".join(out)


@dataclass
class Coordinator:
    cluster: DevCluster
    env: dict[str, str]
    keys: RedisKeys
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    supervised: Supervisor | None = None
    """Set while a :class:`Supervisor` keeps unicornd running: an exit is then restarted,
    not a failure of :meth:`wait`."""

    def start(self) -> None:
        self.proc = self.spawn(self.log_path)

    def spawn(self, log_path: Path) -> subprocess.Popen[bytes]:
        """Another unicornd on the same keys (a standby while this one leads)."""
        with log_path.open("ab") as log:
            return subprocess.Popen(
                [str(UNICORND)], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)

    def redis_config(self) -> RedisConfig:
        """The Redis settings unicornd gets (with the sentinels, when the cluster has them)."""
        sentinels = self.env.get("UNICORN_REDIS__SENTINELS", "")
        return RedisConfig(
            url=self.env["UNICORN_REDIS__URL"],
            sentinels=tuple(e for e in sentinels.split(",") if e),
            master_name=self.env.get("UNICORN_REDIS__MASTER_NAME", "unicorn"),
        )

    def client(self) -> redis.Redis:
        """A client of the Redis primary (through the sentinels, when there are some, so it
        follows a failover)."""
        cfg = self.redis_config()
        if not cfg.sentinels:
            return redis.Redis.from_url(cfg.url)
        sentinel = redis.sentinel.Sentinel(cfg.sentinel_endpoints(), socket_timeout=2.0)  # type: ignore[no-untyped-call]
        client = sentinel.master_for(  # type: ignore[no-untyped-call]
            cfg.master_name,
            password=urlsplit(cfg.url).password,
            socket_timeout=5.0,
            socket_connect_timeout=2.0,
        )
        return cast(redis.Redis, client)

    def snapshot(self) -> Snapshot | None:
        with contextlib.closing(self.client()) as c:
            pipe = c.pipeline(transaction=True)
            for command, key in state_reads(self.keys):
                pipe.execute_command(command, key)
            found = decode_state(pipe.execute(), Policy())
        return None if found is None else found[0]

    def wait(self, pred: Callable[[Snapshot], bool], what: str, timeout_s: float = 120.0) -> Snapshot:
        deadline = time.monotonic() + timeout_s
        snap = None
        while time.monotonic() < deadline:
            snap = self.snapshot()
            if snap is not None and pred(snap):
                return snap
            assert self.proc is not None
            if self.supervised is None and self.proc.poll() is not None:
                raise AssertionError(f"unicornd exited {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}\n{self.tail()}\n{summary(snap)}")

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines of unicornd's log that are its own (findings, decisions,
        actions), not its libraries' chatter: a CI log shows only its own tail."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join([line for line in lines if '"logger": "asyncssh"' not in line][-n:])

    def _run(self, coro_fn: Callable[[object], object]) -> None:
        async def go() -> None:
            client = redis_io.connect(self.redis_config())
            try:
                await coro_fn(client)  # type: ignore[misc]
            finally:
                await client.aclose()

        asyncio.run(go())

    def register(self, task: TaskRecord) -> None:
        socket = self.env.get("UNICORN_SLURM__MUNGE_SOCKET", "")
        self._run(lambda c: ControlClient(c, self.keys).register(task, munge_socket=socket))  # type: ignore[arg-type]

    def resume(self, node: str) -> None:
        self._run(lambda c: ControlClient(c, self.keys).resume(node))  # type: ignore[arg-type]

    def hold_job(self, name: str, nodes: str) -> tuple[int, tuple[str, ...]]:
        """A batch job holding ``nodes`` (what the sbatch wrapper will be), running."""
        out = self.cluster.slurm(
            "sbatch", "--parsable", "-N", str(len(nodes.split(","))), "-w", nodes, "--no-kill",
            "-J", name, "-o", "/dev/null", "--wrap", "sleep 100000",
        )  # fmt: skip
        job = int(out.stdout.strip().split(";")[0])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = self.cluster.slurm("squeue", "-h", "-j", str(job), "-o", "%T %N").stdout.split()
            if st and st[0] == "RUNNING":
                return job, tuple(nodes.split(","))
            time.sleep(0.2)
        raise AssertionError(f"job {job} did not start")


def _drained_by_unicornd(cluster: DevCluster) -> set[str]:
    """Nodes Slurm shows drained, draining or down with unicornd's reason ("unicorn: ...")."""
    out = cluster.slurm("sinfo", "-h", "-N", "-o", "%N|%t|%E", check=False).stdout.splitlines()
    rows = [line.split("|", 2) for line in out if line.count("|") >= 2]
    return {
        node
        for node, state, reason in rows
        if state.rstrip("*~#!%$@^-").startswith(("drain", "drng", "down")) and reason.startswith("unicorn")
    }


@contextlib.contextmanager
def coordinator(cluster: DevCluster, tmp: Path, **env: str) -> Iterator[Coordinator]:
    prefix = f"e2e{os.getpid()}x{next(_prefixes)}"
    full_env = {**os.environ, **cluster.env, "UNICORN_REDIS__KEY_PREFIX": prefix, **env}
    c = Coordinator(cluster, full_env, RedisKeys(prefix), tmp / f"unicornd-{prefix}.log")
    c.start()
    jobs_before = set(cluster.slurm("squeue", "-h", "-o", "%i").stdout.split())
    drained_before = _drained_by_unicornd(cluster)
    try:
        # Ready once its first state is committed (Redis roles exist by then): a job whose
        # wrapper registers before that would fail to log in as the user role.
        c.wait(lambda _: True, "unicornd to commit its first state", 60)
        yield c
    finally:
        if c.supervised is not None:
            c.supervised.stop()
        c.stop(signal.SIGINT)
        for job in set(cluster.slurm("squeue", "-h", "-o", "%i").stdout.split()) - jobs_before:
            cluster.slurm("scancel", job, check=False)
        deadline = time.monotonic() + 30
        while cluster.slurm("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        # A node this unicornd drained and the test left so (a failed test never reached its
        # own resume) would fail the module's next tests for no fault of theirs (found in CI:
        # "job did not start" after the node-loss test failed before resuming n2).
        for node in sorted(_drained_by_unicornd(cluster) - drained_before):
            print(f"teardown: resuming {node}, drained by unicornd during the test", file=sys.stderr)
            cluster.slurm("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        shutil.rmtree(AGENT_RUN_ROOT / prefix, ignore_errors=True)  # the agents' run folders
        with contextlib.suppress(OSError):
            AGENT_RUN_ROOT.rmdir()  # and their root once nobody else's are left (benches)


class Supervisor:
    """Keeps ``count`` unicornd on the coordinator's keys running, as systemd does on two
    head nodes (``Restart=on-failure``): one that exits is started again ``restart_s``
    later. The first is the coordinator's own process. ``exits`` records (when, pid, code).
    """

    def __init__(self, c: Coordinator, tmp: Path, *, count: int = 2, restart_s: float = 1.0) -> None:
        assert c.proc is not None
        self.c = c
        self.restart_s = restart_s
        self.logs = [c.log_path, *(tmp / f"unicornd-{c.keys.prefix}-{i}.log" for i in range(1, count))]
        self.procs = [c.proc, *(c.spawn(log) for log in self.logs[1:])]
        self.exits: list[tuple[float, int, int]] = []
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="unicornd-supervisor", daemon=True)
        c.supervised = self
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None:
                    continue
                self.exits.append((time.monotonic(), proc.pid, code))
                if self._stop.wait(self.restart_s):
                    return
                self.procs[i] = self.c.spawn(self.logs[i])
                self.restarts += 1
                if i == 0:
                    self.c.proc = self.procs[0]

    def by_pid(self, pid: int) -> subprocess.Popen[bytes] | None:
        return next((p for p in self.procs if p.pid == pid), None)

    def stop(self) -> None:
        """Stop watching, then SIGINT every unicornd (a clean stop) and wait for them."""
        self._stop.set()
        self._thread.join(10)
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a paused one must run to stop
                proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.c.supervised = None
