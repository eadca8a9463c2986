"""Child processes for crash tests: ``python -m tests.ckpt._procs <what> <args>``.

``rank ROOT JOB ITERATION``: a training rank that snapshots ``training_state(ITERATION)``
and is SIGKILLed the instant ``snapshot`` returns (before any sealing or persistence).

``persist SHM LOCAL JOB ITERATION RANK``: an agent persisting one shard that is
SIGKILLed after its first chunk reaches the disk.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from ckpt.persist import Persister
from ckpt.snapshot import SnapshotWriter
from ckpt.tier import Retention, Tier, TierDir
from tests.ckpt.conftest import training_state


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


if __name__ == "__main__":
    {"rank": rank, "persist": persist}[sys.argv[1]](*sys.argv[2:])
