"""The main job on the built-in local cluster: self-healing training, end to end.

Run by ``scripts/demo`` (after ``scripts/bootstrap``). It starts its own local cluster
(4 nodes x 1 fake GPU, state in ``.dev-cluster-demo/``), starts unicornd, submits two
training tasks of the built-in trainer with different weights, kills a node of the first
one midway, and prints what unicornd did: the incident timeline, the new plan, and the
loss curve continuing at the new layout. Then the node is revived and resumed by the
operator, rejoins, and is used again. Everything it started is stopped at the end.

Until the sbatch wrapper exists (issue "User and operator surface"), each task's Slurm
job is a plain batch job holding its nodes, registered with unicornd through its
control stream, which is what the wrapper will do.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from unicorn_core import redis_io  # noqa: E402
from unicorn_core.config import RedisConfig  # noqa: E402
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys  # noqa: E402
from unicorn_core.model import ModelSpec  # noqa: E402
from unicorn_core.paths import AGENT_RUN_ROOT, agent_run_dir  # noqa: E402
from unicornd.registry import register_task, request  # noqa: E402
from unicornd.state import NodeHealth, Policy, Snapshot, TaskRecord, TaskState  # noqa: E402
from unicornd.store import snapshot_from_json  # noqa: E402

STATE = REPO / ".dev-cluster-demo"
DEV = [str(REPO / "scripts" / "dev-cluster"), "--state-dir", str(STATE)]
BIN = Path(sys.executable).parent
MODEL = ModelSpec(layers=24, hidden=2048, heads=16, sequence=2048, vocabulary=50257, global_batch=12)
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def sh(*argv: str, env: dict[str, str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout


class Demo:
    def __init__(self) -> None:
        subprocess.run([*DEV, "down"], capture_output=True, check=False)
        shutil.rmtree(AGENT_RUN_ROOT / "demo", ignore_errors=True)  # agents' logs of an earlier demo
        subprocess.run([*DEV, "up", "--nodes", "4", "--gpus-per-node", "1"], check=True)
        dev_env = subprocess.run([*DEV, "env", "--json"], check=True, capture_output=True, text=True).stdout
        self.env = {**os.environ, **json.loads(dev_env)}
        self.env["UNICORN_REDIS__KEY_PREFIX"] = "demo"
        self.env["UNICORN_DETECT__HANG_FACTOR"] = "3"  # 4 trainer ranks share 2 cores here
        self.keys = RedisKeys("demo")
        self.log = (STATE / "unicornd.log").open("ab")
        self.daemon = subprocess.Popen(
            [str(BIN / "unicornd")],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.jobs: dict[str, int] = {}

    def call(self, fn: Callable[..., object], *args: object) -> None:
        async def go() -> None:
            client = redis_io.connect(RedisConfig(url=self.env["UNICORN_REDIS__URL"]))
            try:
                await fn(client, self.keys, *args)  # type: ignore[misc]
            finally:
                await client.aclose()

        asyncio.run(go())

    def snapshot(self) -> Snapshot:
        async def go() -> bytes | None:
            client = redis_io.connect(RedisConfig(url=self.env["UNICORN_REDIS__URL"]))
            try:
                return await client.get(self.keys.state())  # type: ignore[no-any-return]
            finally:
                await client.aclose()

        raw = asyncio.run(go())
        assert raw is not None, "unicornd has not written its state"
        return snapshot_from_json(raw, Policy())

    def wait(self, pred: Callable[[Snapshot], bool], what: str, timeout_s: float = 240) -> Snapshot:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise SystemExit(f"unicornd exited {self.daemon.returncode}; see {STATE / 'unicornd.log'}")
            try:
                snap = self.snapshot()
                if pred(snap):
                    return snap
            except AssertionError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"timed out waiting for {what}; see {STATE / 'unicornd.log'}")

    def submit(self, name: str, nodes: str, weight: float) -> None:
        out = sh("sbatch", "--parsable", "-N2", "-w", nodes, "--no-kill", "-J", name, "-o", "/dev/null",
                 "--wrap", "sleep 100000", env=self.env)  # fmt: skip
        job = int(out.strip().split(";")[0])
        self.jobs[name] = job
        while sh("squeue", "-h", "-j", str(job), "-o", "%T", env=self.env).strip() != "RUNNING":
            time.sleep(0.1)
        ckpt = STATE / f"ckpt-{name}-{job}"
        command = (
            sys.executable, "-m", "launcher.train", "--iterations=100000", "--layers=12", "--hidden=32",
            "--heads=4", "--seq=16", "--vocab=64", f"--save-dir={ckpt}", f"--load={ckpt}",
            "--save-interval=5", "--log-interval=5",
        )  # fmt: skip
        task = TaskRecord(task_id=name, name=name, model=MODEL, command=command, weight=weight, min_gpus=1,
                          job_id=job, nodes=tuple(nodes.split(",")))  # fmt: skip
        self.call(register_task, task)
        print(f"task {name}: job {job} on {nodes}, weight {weight}")

    def show(self, snap: Snapshot) -> None:
        for t in sorted(snap.tasks.values(), key=lambda t: t.task_id):
            layout = t.layout.describe() if t.layout else "-"
            print(f"  task {t.task_id}: {t.state.value:<9} {layout:<22} on {','.join(t.nodes) or '-':<12} "
                  f"iteration {t.last_iteration}")  # fmt: skip
        for n in sorted(snap.nodes.values(), key=lambda n: n.name):
            print(f"  node {n.name}: {n.health.value:<9} {n.reason[:70]}")

    def incidents(self) -> None:
        async def go() -> list[tuple[bytes, dict[bytes, bytes]]]:
            client = redis_io.connect(RedisConfig(url=self.env["UNICORN_REDIS__URL"]))
            try:
                return await client.xrange(self.keys.incidents())  # type: ignore[no-any-return]
            finally:
                await client.aclose()

        snap = self.snapshot()
        for inc in sorted(snap.incidents.values(), key=lambda i: i.opened_s):
            t0 = inc.opened_s
            steps = " -> ".join(f"{e.stage.value} (+{e.t_s - t0:.1f}s)" for e in inc.timeline)
            print(f"  {inc.incident_id} {inc.status.value} {inc.severity.value} on {inc.node}: {steps}")
        for _, fields in asyncio.run(go()):
            doc = json.loads(fields[PAYLOAD_FIELD.encode()])
            if doc.get("kind") == "operator":
                print(f"  operator notified: {doc['why']}")

    def losses(self, name: str) -> None:
        job = self.jobs[name]
        for node in ("n1", "n2"):
            log = agent_run_dir("demo", job, node) / "train.log"
            if not log.exists():
                continue
            text = log.read_text(errors="replace")
            points = [(int(m.group(1)), float(m.group(2))) for m in LOSS.finditer(text)]
            resumed = re.findall(r"layout (\S+) .*resumed_from=(\S+)", text)
            for layout, start in resumed:
                print(f"  {node}: launch at {layout}, resumed from iteration {start}")
            if points:
                print("  loss " + ", ".join(f"{i}:{v:.3f}" for i, v in points[-12:]))

    def run(self) -> None:
        say("two training tasks, weights 1.0 and 1.2, 2 nodes each")
        self.submit("a", "n1,n2", 1.0)
        self.submit("b", "n3,n4", 1.2)

        def both_training(s: Snapshot) -> bool:
            ok = [t.state is TaskState.RUNNING and (t.last_iteration or 0) >= 8 for t in s.tasks.values()]
            return len(ok) == 2 and all(ok)

        snap = self.wait(both_training, "both training")
        self.show(snap)
        say("kill node n2 (slurmd, agent and ranks: SIGKILL)")
        t0 = time.monotonic()
        subprocess.run([*DEV, "kill-node", "n2"], check=True)
        mark = snap.tasks["a"].last_iteration or 0
        snap = self.wait(lambda s: "n2" not in s.tasks["a"].nodes and s.tasks["a"].state is TaskState.RUNNING
                         and (s.tasks["a"].last_iteration or 0) > mark, "task a resumed")  # fmt: skip
        print(f"task a training again {time.monotonic() - t0:.1f} s after the kill")
        self.show(snap)
        self.incidents()
        self.losses("a")
        say("the node comes back; the operator resumes it; a replan uses it again")
        subprocess.run([*DEV, "revive-node", "n2"], check=True)
        time.sleep(2)
        self.call(lambda c, k: request(c, k, {"op": "resume", "node": "n2"}))
        snap = self.wait(lambda s: s.nodes["n2"].health is NodeHealth.HEALTHY and "n2" in s.tasks["a"].nodes
                         and s.tasks["a"].state is TaskState.RUNNING, "n2 used again")  # fmt: skip
        self.show(snap)
        self.losses("a")

    def close(self) -> None:
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
        for job in self.jobs.values():
            subprocess.run(["scancel", str(job)], env=self.env, check=False)
        time.sleep(2)
        subprocess.run([*DEV, "down"], capture_output=True, check=False)


def main() -> None:
    demo = Demo()
    try:
        demo.run()
        say("done: both tasks trained through a node failure; cluster stopped")
    finally:
        demo.close()


if __name__ == "__main__":
    main()
