"""Run a real ``unicorn-agent`` against a real Redis and read what it reports."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.protocol import AgentAction, AgentCommand, Message, decode, encode

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "scripts" / "workloads" / "toy_loop.py"
AGENT = Path(sys.executable).parent / "unicorn-agent"
TORCHRUN = Path(sys.executable).parent / "torchrun"
_prefixes = itertools.count()


def toy(*args: str) -> list[str]:
    return [sys.executable, str(TOY), *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        str(TORCHRUN),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        str(TOY),
        *args,
    ]


@dataclass
class AgentRun:
    proc: subprocess.Popen[bytes]
    keys: RedisKeys
    client: redis.Redis
    job_id: int
    node: str
    run_dir: Path
    seen: list[tuple[float, Message]] = field(default_factory=list)
    _last: dict[str, str] = field(default_factory=dict)

    def poll(self) -> list[tuple[float, Message]]:
        """New events and command results since the last poll, with the monotonic read time."""
        fresh: list[tuple[float, Message]] = []
        for stream in (self.keys.events(self.job_id), self.keys.command_results(self.job_id)):
            last = self._last.get(stream)
            entries = self.client.xrange(stream, min=f"({last}" if last else "-")
            now = time.monotonic()
            for entry_id, fields in entries:
                self._last[stream] = entry_id.decode()
                fresh.append((now, decode(fields[PAYLOAD_FIELD.encode()])))
        self.seen.extend(fresh)
        return fresh

    def wait_for(
        self, pred: Callable[[Message], bool], timeout_s: float = 20.0, interval_s: float = 0.01
    ) -> tuple[float, Message]:
        deadline = time.monotonic() + timeout_s
        for t, m in self.seen:
            if pred(m):
                return t, m
        while time.monotonic() < deadline:
            for t, m in self.poll():
                if pred(m):
                    return t, m
            if self.proc.poll() is not None:
                self.poll()
                for t, m in self.seen:
                    if pred(m):
                        return t, m
                raise AssertionError(f"agent exited {self.proc.returncode}: {self.stderr()}")
            time.sleep(interval_s)
        raise AssertionError(f"timed out; seen: {[type(m).__name__ for _, m in self.seen][-30:]}")

    def command(self, action: AgentAction, argv: Sequence[str] = (), command_id: str = "c1") -> None:
        cmd = AgentCommand(
            job_id=self.job_id,
            node=self.node,
            wall_time_s=time.time(),
            command_id=command_id,
            action=action,
            argv=list(argv),
            deadline_s=30.0,
        )
        self.client.xadd(self.keys.agent_commands(self.job_id, self.node), {PAYLOAD_FIELD: encode(cmd)})

    def stderr(self) -> str:
        path = self.run_dir / "agent.stderr"
        return path.read_text()[-4000:] if path.exists() else ""


@contextlib.contextmanager
def run_agent(
    redis_url: str,
    tmp: Path,
    command: Sequence[str],
    *extra: str,
    job_id: int = 1,
    node: str = "n1",
    env: dict[str, str] | None = None,
    prefix: str | None = None,
    run_dir: Path | None = None,
) -> Iterator[AgentRun]:
    """A real agent (``prefix``: its Redis key prefix, new by default; ``run_dir``: its
    run folder, new by default: give another agent's to replace that agent)."""
    prefix = prefix or f"t{os.getpid()}x{next(_prefixes)}"
    run_dir = run_dir or tmp / f"agent-{prefix}"
    run_dir.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "UNICORN_REDIS__URL": redis_url,
        "UNICORN_REDIS__KEY_PREFIX": prefix,
        **(env or {}),
    }
    argv = [str(AGENT), "--job-id", str(job_id), "--node", node, "--run-dir", str(run_dir), *extra]
    if command:
        argv += ["--", *command]
    with (run_dir / "agent.stderr").open("ab") as err:
        proc = subprocess.Popen(
            argv, env=full_env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    client = redis.Redis.from_url(redis_url)
    run = AgentRun(proc, RedisKeys(prefix), client, job_id, node, run_dir)
    try:
        yield run
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        client.close()
