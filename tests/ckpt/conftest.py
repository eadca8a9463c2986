"""Fixtures for the checkpoint engine: a private shm root per test, a sample training state."""

from __future__ import annotations

import asyncio
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt.peer import PeerServer
from ckpt.tier import TierDir

SHM = Path("/dev/shm")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A folder in real shared memory (tmpfs), unique to the test and removed after it."""
    base = SHM if SHM.is_dir() else Path("/tmp")
    root = base / f"unicorn-test-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def training_state(seed: int = 0) -> dict[str, Any]:
    """A small but complete training state: model, Adam state, RNG states, data position."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    rng = np.random.default_rng(seed)
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": rng.bit_generator.state},
        "data": {"position": 4096 + seed, "epoch": 1},
        "iteration": 17,
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep equality where tensors and arrays must match element for element, dtype included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"


class ServerThread:
    """A PeerServer on its own event loop in a thread, for tests that restore synchronously."""

    def __init__(self, backup: TierDir, serve: list[TierDir]) -> None:
        self.server = PeerServer(backup, serve)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.host, self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def server_factory() -> Iterator[Any]:
    started: list[ServerThread] = []

    def start(backup: TierDir, serve: list[TierDir]) -> ServerThread:
        started.append(ServerThread(backup, serve))
        return started[-1]

    yield start
    for server in started:
        server.stop()
