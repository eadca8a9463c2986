"""Shared fixtures. System tests get a private dev cluster (own state folder and ports).

The cluster is started once per session by ``scripts/dev-cluster`` itself, so the tests
exercise the same script developers and the demo use, and it coexists with a
developer's own cluster.
"""

from __future__ import annotations

import contextlib
import getpass
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

REPO = Path(__file__).resolve().parent.parent
DEV_CLUSTER = REPO / "scripts" / "dev-cluster"
SLURM_RELEASE: Final = os.environ.get("UNICORN_TEST_SLURM", "")
"""The Slurm release test clusters run: empty for the host's (22.05), or one that
``dev-cluster up --slurm`` runs from a chroot (``24.11``); scripts/test runs the
``slurm_release`` tests once more with it set."""
AGENT_RUN_ROOT = Path("/tmp/unicorn")  # unicorn_core.paths.AGENT_RUN_ROOT: agents' run folders


def _entries(folder: Path) -> set[Path]:
    return set(folder.iterdir()) if folder.is_dir() else set()


_SESSION_PREFIX: Final = re.compile(r"e2e(\d+)x\d+")
"""The key prefix a test coordinator names its agents' run folder after
(:func:`tests.system.coordinator.coordinator`): the pid of the pytest process that made it."""


def _another_sessions(entry: Path) -> bool:
    """``entry`` is the run folder of another pytest process that is still running: its
    tests read it after this run ends (a second pytest beside a long one removed the
    Megatron test's training logs before it read them)."""
    m = _SESSION_PREFIX.fullmatch(entry.name)
    if m is None or int(m.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


_INDUCTOR: Final = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
"""torch's compile cache when $TORCHINDUCTOR_CACHE_DIR is unset: importing
``torch.distributed.pipelining`` makes it, in this process while pytest collects the
trainer's tests, before any fixture runs."""
_EXISTED: Final = frozenset(d for d in (_INDUCTOR, AGENT_RUN_ROOT) if d.exists())
"""Of the shared folders a run may make, those that were there before it (kept)."""


@pytest.fixture(scope="session", autouse=True)
def _leave_nothing_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One temporary folder per run, removed at the end: ``TMPDIR`` points there for the
    tests and every process they start (unicornd, srun steps, agents, torchrun and its
    ``torchelastic_*`` folders, torch's compile cache). The agents' run folders the run
    added under /tmp/unicorn go too, and /tmp/unicorn and the system temp folder's
    ``torchinductor_<user>`` when the run made them. pytest's own ``tmp_path`` folders stay
    where pytest keeps (and rotates) them."""
    tmp_path_factory.getbasetemp()
    shared = [d for d in (_INDUCTOR, AGENT_RUN_ROOT) if d not in _EXISTED]
    run_dir = Path(tempfile.mkdtemp(prefix="unicorn-test-"))
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    agents_before = _entries(AGENT_RUN_ROOT)
    os.environ["TMPDIR"] = str(run_dir)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(run_dir / "torchinductor")
    tempfile.tempdir = None
    try:
        yield run_dir
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tempfile.tempdir = None
        shutil.rmtree(run_dir, ignore_errors=True)
        for added in _entries(AGENT_RUN_ROOT) - agents_before:
            if not _another_sessions(added):
                shutil.rmtree(added, ignore_errors=True)
        if _INDUCTOR in shared:  # made by this run: a cache only
            shutil.rmtree(_INDUCTOR, ignore_errors=True)
        if AGENT_RUN_ROOT in shared:  # made by this run; kept while anything else uses it
            with contextlib.suppress(OSError):
                AGENT_RUN_ROOT.rmdir()


@dataclass
class Receiver:
    """A real HTTP server on 127.0.0.1 answering POSTs with ``status`` after ``delay_s``."""

    status: int = 200
    delay_s: float = 0.0
    bodies: list[dict[str, object]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    port: int = 0
    release: threading.Event = field(default_factory=threading.Event)


@contextlib.contextmanager
def http_receiver() -> Iterator[Receiver]:
    """A webhook receiver for the block: every POSTed JSON body lands in ``bodies``."""
    rec = Receiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.headers["Content-Type"] == "application/json"
            rec.bodies.append(json.loads(body))
            rec.paths.append(self.path)
            if rec.delay_s:
                rec.release.wait(rec.delay_s)
            self.send_response(rec.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    rec.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        rec.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (nobody listens once this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """Running and not a zombie (PID 1 on these machines may not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass(frozen=True)
class DevCluster:
    state_dir: Path
    env: dict[str, str]  # SLURM_CONF, UNICORN_REDIS__URL, UNICORN_DEV_CLUSTER_DIR

    @property
    def slurm_conf(self) -> str:
        return self.env["SLURM_CONF"]

    @property
    def redis_url(self) -> str:
        return self.env["UNICORN_REDIS__URL"]

    @property
    def bin_dir(self) -> str | None:
        """Where this cluster's Slurm clients are when they are not the host's (a chroot's)."""
        return self.env.get("UNICORN_SLURM__BIN_DIR")

    def script(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(DEV_CLUSTER), "--state-dir", str(self.state_dir), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=check,
        )

    def slurm(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=30,
            check=check,
            env={**os.environ, **self.env},
        )


def start_cluster(state_dir: Path, *args: str) -> DevCluster:
    if SLURM_RELEASE and "--slurm" not in args:
        args = (*args, "--slurm", SLURM_RELEASE)
    up = subprocess.run(
        [str(DEV_CLUSTER), "--state-dir", str(state_dir), "up", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if up.returncode != 0:
        raise RuntimeError(f"dev-cluster up failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
    out = subprocess.run(
        [str(DEV_CLUSTER), "--state-dir", str(state_dir), "env", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return DevCluster(state_dir, json.loads(out))


@contextlib.contextmanager
def private_cluster(
    tmp_path_factory: pytest.TempPathFactory, name: str, *up_args: str
) -> Iterator[DevCluster]:
    """A dev cluster of its own for the duration of the block (stopped by its own script)."""
    state_dir = tmp_path_factory.mktemp(name)
    state_dir.parent.chmod(0o755)
    c = start_cluster(state_dir, *up_args)
    try:
        yield c
    finally:
        c.script("down", check=False)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    with private_cluster(tmp_path_factory, "cluster", "--nodes", "4", "--gpus-per-node", "4") as c:
        yield c


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A private real redis-server on a free loopback port (no persistence); its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (scripts/test installs it)")
    port = free_port()
    server = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)
        from unicorn_core.logs import reset_logging

        reset_logging()
