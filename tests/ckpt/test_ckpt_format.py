"""Shard format: the state table, flattening without pickle, names and paths."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.errors import InvalidTransition
from ckpt.format import (
    TRANSITIONS,
    ShardState,
    check_transition,
    flatten_state,
    layout_entries,
    unflatten_state,
)
from ckpt.snapshot import SnapshotWriter
from tests.ckpt.conftest import assert_same, training_state
from unicorn_core.errors import InvalidArgument


@pytest.mark.parametrize(("old", "new"), list(itertools.product(ShardState, ShardState)))
def test_every_transition_pair_follows_the_table(old: ShardState, new: ShardState) -> None:
    if new in TRANSITIONS[old]:
        check_transition(old, new)
    else:
        with pytest.raises(InvalidTransition):
            check_transition(old, new)


def test_flatten_round_trip_keeps_structure_and_types() -> None:
    state = {
        **training_state(),
        "misc": {
            3: ("a", None, True),
            (1, 2): [1.5, float("inf"), float("nan")],
            "big": 2**100,
            "blob": b"\x00\x01",
            "np": np.arange(6, dtype=">u4").reshape(2, 3),
        },
    }
    flat = flatten_state(state)
    assert all(not isinstance(leaf, dict) for leaf in flat.leaves)
    restored = unflatten_state(flat.tree, list(flat.leaves))
    assert_same(state, restored)
    assert math.isnan(restored["misc"][(1, 2)][2])


def test_layout_aligns_every_entry() -> None:
    flat = flatten_state(
        {"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5, dtype=torch.float64), "c": b"x"}
    )
    entries, total = layout_entries(flat)
    assert [e.offset % 64 for e in entries] == [0, 0, 0]
    assert total == entries[-1].offset + entries[-1].nbytes


@pytest.mark.parametrize("bad", [object(), {1, 2}, np.array([object()])])
def test_a_value_that_needs_pickle_is_refused_before_anything_is_written(shm_root: Path, bad: object) -> None:
    writer = SnapshotWriter(shm_root, "job1", 0, 1)
    with pytest.raises(InvalidArgument, match=r"state\[model/x\]"):
        writer.snapshot({"model": {"x": bad}}, 3)
    assert not (shm_root / "job1").exists() or not any((shm_root / "job1").rglob("*.json"))


@pytest.mark.parametrize("job", ["", "../x", "a/b", ".hidden", "x" * 200])
def test_bad_job_ids_are_rejected(shm_root: Path, job: str) -> None:
    with pytest.raises(InvalidArgument, match="job id"):
        SnapshotWriter(shm_root, job, 0, 1)
