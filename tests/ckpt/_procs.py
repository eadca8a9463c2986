"""Child processes for crash tests: ``python -m tests.ckpt._procs <what> <args>``.

``rank ROOT JOB ITERATION``: a training rank that snapshots ``training_state(ITERATION)``
and is SIGKILLed the instant ``snapshot`` returns (before any sealing or persistence).

``persist SHM LOCAL JOB ITERATION RANK``: an agent persisting one shard that is
SIGKILLed after its first chunk reaches the disk.

``commit SHM TARGET JOB ITERATION RANK POINT``: ``commit_shard`` of a sealed shm shard
into a durable tier, SIGKILLed at ``POINT`` (see ``COMMIT_CRASH_POINTS``).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckpt.commit
from ckpt.commit import commit_shard
from ckpt.format import write_atomic as real_write_atomic
from ckpt.persist import Persister
from ckpt.shard import OpenShard
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Retention, Tier, TierDir
from tests.ckpt.conftest import training_state

COMMIT_CRASH_POINTS = ("mid-data", "before-meta", "mid-verify", "before-done")
"""Where ``commit`` dies: half the bytes written; ``.bin`` renamed, no metadata yet;
metadata written, checksums being verified; verified, done marker not yet written."""


def rank(root: str, job: str, iteration: str) -> None:
    writer = SnapshotWriter(Path(root), job, 0, 1)
    writer.snapshot(training_state(int(iteration)), int(iteration))
    os.kill(os.getpid(), signal.SIGKILL)


def persist(shm: str, local: str, job: str, iteration: str, rank: str) -> None:
    persister = Persister(
        TierDir(Path(shm), job, Tier.SHM),
        [(TierDir(Path(local), job, Tier.LOCAL), Retention(3))],
        chunk_bytes=4096,
    )

    def die(_written: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    persister.persist(int(iteration), int(rank), on_chunk=die)


def commit(shm: str, target: str, job: str, iteration: str, rank: str, point: str) -> None:
    if point not in COMMIT_CRASH_POINTS:
        raise SystemExit(f"unknown crash point {point!r}")

    def die(*_args: object, **_kwargs: object) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    def write_atomic(path: Path, data: bytes, *, durable: bool) -> None:
        if (point, path.suffix) in (("before-meta", ".json"), ("before-done", ".done")):
            die()
        real_write_atomic(path, data, durable=durable)

    vars(ckpt.commit)["write_atomic"] = write_atomic  # what commit_shard calls
    if point == "mid-verify":
        OpenShard.verify = die  # type: ignore[method-assign]
    with OpenShard(TierDir(Path(shm), job, Tier.SHM).shard(int(iteration), int(rank))) as source:
        data = source.data()

        def write_data(fd: int) -> None:
            half = len(data) // 2
            os.write(fd, data[:half])
            if point == "mid-data":
                die()
            os.write(fd, data[half:])

        commit_shard(TierDir(Path(target), job, Tier.LOCAL), source.meta, write_data)


if __name__ == "__main__":
    commands: dict[str, Callable[..., None]] = {"rank": rank, "persist": persist, "commit": commit}
    commands[sys.argv[1]](*sys.argv[2:])
