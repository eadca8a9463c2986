"""Backend selection (cli / pyslurm / auto) and the pyslurm backend's reads, on a fake pyslurm.

The fake mirrors the attribute names of pyslurm >= 23 (pyslurm/core/node.pyx,
pyslurm/core/job/job.pyx, pyslurm/core/error.pyx); pyslurm itself cannot be built here.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from unicorn_core.config import SlurmConfig
from unicorn_core.errors import (
    CommandFailed,
    CommandNotFound,
    CommandTimeout,
    ConfigError,
    ExternalCallError,
    UnknownJob,
    UnknownNode,
)
from unicorn_core.slurm import CliSlurm, PyslurmBackend, make_backend
from unicorn_core.slurm.parse import jobs_from_squeue_json, node_from_sinfo_json, nodes_from_sinfo_json
from unicorn_core.slurm.select import major_minor

DATA = Path(__file__).parent / "data"


# --------------------------------------------------------------------------- the fake pyslurm


class PyslurmError(Exception):
    pass


class RPCError(PyslurmError):
    def __init__(self, errno: int = -1, msg: str | None = None) -> None:
        self.errno = errno
        self.msg = msg or f"slurm error {errno}"
        super().__init__(self.msg)


@dataclass
class FakeNode:
    name: str
    state: str
    reason: str | None = None
    total_cpus: int = 8
    effective_cpus: int = 8
    allocated_cpus: int = 0
    configured_gres: dict[str, Any] = field(default_factory=lambda: {"gpu": 4})
    allocated_gres: dict[str, Any] = field(default_factory=lambda: {"gpu": 0})
    real_memory: int = 8192
    partitions: list[str] = field(default_factory=lambda: ["debug"])
    next_state: str | None = None


@dataclass
class FakeJob:
    id: int
    name: str
    state: str
    state_reason: str = "None"
    allocated_nodes: str | None = None
    num_nodes: int | None = 1
    is_batch_job: bool = True
    requeue_count: int = 0
    user_name: str = "root"
    cluster: str = "linux"
    batch_host: str | None = None


class FakeMultiClusterMap:
    """Like pyslurm.xcollections.MultiClusterMap: ``data`` per cluster, ``values()`` over all."""

    def __init__(self, data: dict[str, dict[int, FakeJob]]) -> None:
        self.data = data

    def values(self) -> Iterator[FakeJob]:
        for cluster in self.data.values():
            yield from cluster.values()


class FakePyslurm(types.ModuleType):
    """A module object shaped like pyslurm: Nodes/Node/Jobs/Job with static ``load``."""

    def __init__(self, version: str = "22.5.1") -> None:
        super().__init__("pyslurm")
        self.__version__ = version
        self.nodes: list[FakeNode] = []
        self.jobs: list[FakeJob] = []
        self.fail: Exception | None = None
        self.hang = threading.Event()
        self.hanging = False
        self.calls: list[str] = []
        self.PyslurmError = PyslurmError
        self.RPCError = RPCError
        fake = self

        def gate(what: str) -> None:
            fake.calls.append(what)
            if fake.hanging:
                fake.hang.wait(10)
            if fake.fail is not None:
                raise fake.fail

        class Nodes:
            @staticmethod
            def load(preload_passwd_info: bool = False) -> dict[str, FakeNode]:
                gate("Nodes.load")
                return {n.name: n for n in fake.nodes}

        class Node:
            @staticmethod
            def load(name: str) -> FakeNode:
                gate("Node.load")
                for n in fake.nodes:
                    if n.name == name:
                        return n
                raise RPCError(msg=f"Node '{name}' does not exist")

        class Jobs:
            @staticmethod
            def load(preload_passwd_info: bool = False, frozen: bool = False) -> FakeMultiClusterMap:
                gate("Jobs.load")
                return FakeMultiClusterMap({"linux": {j.id: j for j in fake.jobs}})

        class Job:
            @staticmethod
            def load(job_id: int) -> FakeJob:
                gate("Job.load")
                for j in fake.jobs:
                    if j.id == job_id:
                        return j
                raise RPCError(2017, "Invalid job id specified")

        self.Nodes, self.Node, self.Jobs, self.Job = Nodes, Node, Jobs, Job

    def version(self) -> str:
        return str(self.__version__)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePyslurm]:
    module = FakePyslurm()
    monkeypatch.setitem(sys.modules, "pyslurm", module)
    monkeypatch.delenv("SLURM_CONF", raising=False)
    yield module
    module.hang.set()  # let a thread left hanging by a timeout test finish


@pytest.fixture
def no_pyslurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # import pyslurm -> ModuleNotFoundError


def cfg(backend: str, **kw: Any) -> SlurmConfig:
    return SlurmConfig(backend=backend, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- selection


def test_major_minor_reads_slurm_and_pyslurm_spellings() -> None:
    assert major_minor("22.05.8") == major_minor("22.5.0") == (22, 5)
    assert major_minor("slurm 25.11.0") == major_minor("25.11.2") == (25, 11)
    assert major_minor("24.05.0") == (24, 5)
    assert major_minor("dev") is None


async def test_cli_backend_never_looks_at_pyslurm(fake: FakePyslurm) -> None:
    backend = await make_backend(cfg("cli"), cluster_version="22.05.8")
    assert type(backend) is CliSlurm


async def test_auto_without_pyslurm_is_cli(no_pyslurm: None) -> None:
    backend = await make_backend(cfg("auto"), cluster_version="22.05.8")
    assert type(backend) is CliSlurm
    assert backend.name == "cli"


async def test_auto_with_matching_pyslurm_is_pyslurm(fake: FakePyslurm) -> None:
    backend = await make_backend(cfg("auto", command_timeout_s=7.0), cluster_version="22.05.8")
    assert isinstance(backend, PyslurmBackend)
    assert backend.name == "pyslurm"
    assert backend.timeout_s == 7.0
    assert backend.pyslurm is fake


async def test_auto_accepts_zero_padded_pyslurm_version(fake: FakePyslurm) -> None:
    fake.__version__ = "24.05.0"
    assert isinstance(await make_backend(cfg("auto"), cluster_version="24.05.3"), PyslurmBackend)


async def test_auto_uses_version_function_when_no_dunder_version(fake: FakePyslurm) -> None:
    del fake.__version__
    fake.version = lambda: "22.5.0"  # type: ignore[method-assign]
    assert isinstance(await make_backend(cfg("auto"), cluster_version="22.05.8"), PyslurmBackend)


async def test_auto_with_mismatched_pyslurm_is_cli(fake: FakePyslurm) -> None:
    fake.__version__ = "25.11.0"
    backend = await make_backend(cfg("auto"), cluster_version="22.05.8")
    assert type(backend) is CliSlurm


async def test_forced_pyslurm_with_mismatch_names_both_versions(fake: FakePyslurm) -> None:
    fake.__version__ = "25.11.0"
    with pytest.raises(ConfigError) as info:
        await make_backend(cfg("pyslurm"), cluster_version="22.05.8")
    assert "25.11.0" in str(info.value)
    assert "22.05.8" in str(info.value)
    assert "Slurm 25.11" in str(info.value)


async def test_forced_pyslurm_without_pyslurm_says_it_does_not_import(no_pyslurm: None) -> None:
    with pytest.raises(ConfigError, match="pyslurm does not import"):
        await make_backend(cfg("pyslurm"), cluster_version="22.05.8")


async def test_forced_pyslurm_with_match_is_pyslurm(fake: FakePyslurm) -> None:
    assert isinstance(await make_backend(cfg("pyslurm"), cluster_version="22.05.8"), PyslurmBackend)


async def test_pyslurm_that_fails_while_loading_counts_as_not_importable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class BrokenLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Finds pyslurm, then fails loading it as a build against another libslurm does."""

        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            if name != "pyslurm":
                return None
            return importlib.util.spec_from_loader(name, self)

        def create_module(self, spec: Any) -> Any:
            raise OSError("libslurm.so.38: cannot open shared object file")

        def exec_module(self, module: Any) -> None:
            raise AssertionError("not reached")

    monkeypatch.delitem(sys.modules, "pyslurm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenLoader(), *sys.meta_path])
    assert type(await make_backend(cfg("auto"), cluster_version="22.05.8")) is CliSlurm
    with pytest.raises(ConfigError, match=r"libslurm\.so\.38"):
        await make_backend(cfg("pyslurm"), cluster_version="22.05.8")


async def test_auto_asks_the_cluster_for_its_version(
    fake: FakePyslurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []

    async def version(self: CliSlurm) -> str:
        asked.append(True)
        return "22.05.8"

    monkeypatch.setattr(CliSlurm, "version", version)
    assert isinstance(await make_backend(cfg("auto")), PyslurmBackend)
    assert asked == [True]


async def test_auto_without_pyslurm_does_not_run_sinfo(
    no_pyslurm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def version(self: CliSlurm) -> str:
        raise AssertionError("sinfo --version should not run")

    monkeypatch.setattr(CliSlurm, "version", version)
    assert type(await make_backend(cfg("auto"))) is CliSlurm


async def test_unknown_cluster_version_is_cli_for_auto_and_an_error_when_forced(
    fake: FakePyslurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def version(self: CliSlurm) -> str:
        raise CommandNotFound(["sinfo", "--version"], None, message="not found")

    monkeypatch.setattr(CliSlurm, "version", version)
    assert type(await make_backend(cfg("auto"))) is CliSlurm
    with pytest.raises(ConfigError, match="cannot learn the cluster's Slurm version"):
        await make_backend(cfg("pyslurm"))


async def test_pyslurm_is_refused_when_slurm_conf_differs_from_the_process(
    fake: FakePyslurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = "/etc/dev-cluster/slurm.conf"
    assert type(await make_backend(cfg("auto", conf=conf), cluster_version="22.05.8")) is CliSlurm
    with pytest.raises(ConfigError, match="SLURM_CONF"):
        await make_backend(cfg("pyslurm", conf=conf), cluster_version="22.05.8")
    monkeypatch.setenv("SLURM_CONF", conf)
    assert isinstance(await make_backend(cfg("auto", conf=conf), cluster_version="22.05.8"), PyslurmBackend)


# --------------------------------------------------------------------------- reads through pyslurm


def fixture_nodes() -> list[FakeNode]:
    """sinfo-22.05.json's nodes as pyslurm reports them."""
    return [
        FakeNode("n1", "IDLE"),
        FakeNode("n2", "IDLE+DRAIN", reason="unicorn: ecc_error gpu=1 job=7"),
        FakeNode("n3", "ALLOCATED", allocated_cpus=1),  # older pyslurm: the controller's raw state
        FakeNode("n4", "MIXED", allocated_cpus=1),  # newer pyslurm computes MIXED itself
    ]


def fixture_jobs() -> list[FakeJob]:
    """squeue-22.05.json's jobs as pyslurm reports them."""
    return [
        FakeJob(
            6, "wrap", "CANCELLED", allocated_nodes="n[1-2]", num_nodes=2, requeue_count=2, batch_host="n1"
        ),
        FakeJob(
            7, "no-shell", "COMPLETED", allocated_nodes=None, num_nodes=1, is_batch_job=False, batch_host="n3"
        ),
        FakeJob(8, "wrap", "CANCELLED", allocated_nodes="n[1-2]", num_nodes=2, batch_host="n1"),
        FakeJob(9, "my train", "RUNNING", allocated_nodes="n[3-4]", num_nodes=2, batch_host="n3"),
        FakeJob(10, "wrap", "PENDING", state_reason="ReqNodeNotAvail", num_nodes=4),
    ]


@pytest.fixture
def backend(fake: FakePyslurm) -> PyslurmBackend:
    fake.nodes = fixture_nodes()
    fake.jobs = fixture_jobs()
    return PyslurmBackend(timeout_s=5.0, env={}, module=fake)


async def test_list_nodes_equals_the_cli_parse_of_the_same_cluster(backend: PyslurmBackend) -> None:
    expected = nodes_from_sinfo_json((DATA / "sinfo-22.05.json").read_text())
    got = await backend.list_nodes()
    assert got == expected
    n2 = got[1]
    assert n2.drained and n2.flags == {"DRAIN"} and not n2.usable
    assert n2.reason == "unicorn: ecc_error gpu=1 job=7"
    assert (n2.gpus, n2.gpus_used) == (4, 0)


async def test_typed_and_indexed_gres_count_like_the_cli(backend: PyslurmBackend, fake: FakePyslurm) -> None:
    fake.nodes = [
        FakeNode(
            "g1",
            "MIXED+DRAIN+NOT_RESPONDING",
            reason="bad gpu",
            configured_gres={"gpu:a100": 8, "nic": 2},
            allocated_gres={"gpu:a100": {"count": "2", "indexes": "0-1"}},
            partitions=["gpu", "debug"],
        )
    ]
    cli = node_from_sinfo_json(
        {
            "name": "g1",
            "state": "mixed",
            "state_flags": ["DRAIN", "NOT_RESPONDING"],
            "reason": "bad gpu",
            "cpus": 8,
            "gres": "gpu:a100:8(S:0-1),nic:2",
            "gres_used": "gpu:a100:2(IDX:0-1),nic:0",
            "real_memory": 8192,
            "partitions": ["gpu", "debug"],
        }
    )
    assert await backend.list_nodes() == [cli]
    assert (cli.gpus, cli.gpus_used, cli.responding) == (8, 2, False)


async def test_get_node_and_unknown_node(backend: PyslurmBackend) -> None:
    node = await backend.get_node("n2")
    assert node.drained
    with pytest.raises(UnknownNode, match="n1, n2, n3, n4"):
        await backend.get_node("n9")


async def test_list_jobs_equals_the_cli_parse_of_the_same_cluster(backend: PyslurmBackend) -> None:
    expected = jobs_from_squeue_json((DATA / "squeue-22.05.json").read_text())
    assert await backend.list_jobs() == expected


async def test_get_job_and_unknown_job(backend: PyslurmBackend) -> None:
    job = await backend.get_job(9)
    assert (job.nodes, job.num_nodes, job.batch, job.user) == (("n3", "n4"), 2, True, "root")
    with pytest.raises(UnknownJob):
        await backend.get_job(999)


async def test_a_hanging_pyslurm_call_times_out(fake: FakePyslurm) -> None:
    fake.hanging = True
    backend = PyslurmBackend(timeout_s=0.2, env={}, module=fake)
    with pytest.raises(CommandTimeout) as info:
        await backend.list_nodes()
    assert info.value.command == ("pyslurm", "Nodes.load")
    assert info.value.temporary
    fake.hang.set()


async def test_a_pyslurm_exception_becomes_an_external_call_error(
    backend: PyslurmBackend, fake: FakePyslurm
) -> None:
    fake.fail = RPCError(1007, "Unable to contact slurm controller (connect failure)")
    with pytest.raises(CommandFailed) as info:
        await backend.list_jobs()
    err = info.value
    assert isinstance(err, ExternalCallError)
    assert err.command == ("pyslurm", "Jobs.load")
    assert err.exit_code == 1007
    assert "connect failure" in err.stderr
    assert "RPCError (slurm errno 1007)" in str(err)


async def test_mutations_still_go_through_the_commands(backend: PyslurmBackend, fake: FakePyslurm) -> None:
    """drain is CliSlurm's: it runs scontrol (here a missing bin_dir) and never calls pyslurm."""
    b = PyslurmBackend(timeout_s=5.0, env={}, bin_dir="/nonexistent/slurm/bin", module=fake)
    with pytest.raises(CommandNotFound) as info:
        await b.drain("n1", "test")
    assert info.value.command[0] == "/nonexistent/slurm/bin/scontrol"
    assert fake.calls == []
