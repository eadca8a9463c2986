"""Reuse of finished micro-batches when a DP rank dies mid-iteration (issue 23, item 4).

Pure parts (which micro-batches, the survivors' agreement on a store, validation), then
real torchrun on CPU (gloo): TP1 PP1 DP4, 12 micro-batches per iteration; rank 2 SIGKILLs
itself after 1 of its 3 micro-batches of iteration 3. The survivors complete iteration 3
from their 9 finished micro-batches plus rank 2's 3, save it and exit 4; the state saved
after iteration 3 equals the uninterrupted run's (the gradients are summed in float64, so
the grouping does not change them), and a relaunch resumes at iteration 4 from the memory
tier with the uninterrupted run's losses.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import HashStore
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from launcher.trainer.config import FaultInjection, TrainConfig
from launcher.trainer.data import replica_samples
from launcher.trainer.reuse import (
    REUSED_EXIT_CODE,
    Heartbeat,
    LeftOut,
    agree_members,
    microbatch_samples,
    missing_microbatches,
    replica_microbatches,
    share,
)
from tests.launcher.test_trainer_units import TINY, layout_for
from tests.launcher.torchrun import run
from unicorn_core import protocol
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import IterationPhase, IterationTiming

REL_TOL = 1e-6
K = 3  # the iteration in flight when rank 2 dies
MODEL = ("--layers=4", "--hidden=32", "--heads=4", "--seq=16", "--vocab=64", "--lr=3e-3", "--iterations=5")
REUSE = (*MODEL, "--micro-batch=1", "--global-batch=12", "--reuse-microbatches", "--dist-timeout-s=60")
FAULT = (f"--fail-at-iteration={K}", "--fail-rank=2", "--fail-mode=kill", "--fail-after-microbatches=1")
_LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")


# --- which micro-batches ---------------------------------------------------------------------------


@pytest.mark.parametrize(("dp", "micro_batch"), [(1, 1), (2, 2), (3, 1), (4, 1), (6, 2)])
def test_global_microbatches_are_the_replicas_samples_in_order(dp: int, micro_batch: int) -> None:
    global_batch, per_replica = 12, 12 // (dp * micro_batch)
    for r in range(dp):
        first, count = replica_samples(K, global_batch=global_batch, dp=dp, dp_rank=r)
        parts = [
            microbatch_samples(K, i, global_batch=global_batch, micro_batch=micro_batch)
            for i in replica_microbatches(r, per_replica)
        ]
        assert [s for f, c in parts for s in range(f, f + c)] == list(range(first, first + count))
    with pytest.raises(ValueError, match="outside"):
        microbatch_samples(K, 12 // micro_batch, global_batch=12, micro_batch=micro_batch)


@pytest.mark.parametrize(
    ("members", "missing"), [((0, 1, 3), (6, 7, 8)), ((1,), (0, 1, 2, 6, 7, 8, 9, 10, 11))]
)
def test_lost_replicas_microbatches_are_split_once_over_the_survivors(
    members: tuple[int, ...], missing: tuple[int, ...]
) -> None:
    assert missing_microbatches(members, 4, 3) == missing
    parts = [share(missing, members, m) for m in members]
    assert sorted(i for p in parts for i in p) == list(missing)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert missing_microbatches((0, 1, 2, 3), 4, 3) == ()


# --- the survivors' agreement ------------------------------------------------------------------


def _agree(
    store: Any,
    rank: int,
    settle_s: float,
    out: dict[int, object],
    *,
    world_size: int = 4,
    tag: str = "7",
    delay_s: float = 0.0,
    timeout_s: float = 10.0,
) -> None:
    """Rank ``rank`` joins agreement ``tag`` after ``delay_s``; its result (or LeftOut) goes to ``out``."""
    time.sleep(delay_s)
    try:
        out[rank] = agree_members(
            store, tag=tag, rank=rank, world_size=world_size, settle_s=settle_s, timeout_s=timeout_s
        )
    except LeftOut as exc:
        out[rank] = exc


def test_survivors_agree_on_one_member_list_and_a_latecomer_is_left_out() -> None:
    store = HashStore()
    beating = [Heartbeat(store, r, 0.05) for r in (3, 0, 1)]  # the survivors; rank 2 never beats
    out: dict[int, object] = {}
    try:
        _run_all(
            [
                threading.Thread(target=_agree, args=(store, r, SETTLE_S, out), kwargs=dict(timeout_s=20))
                for r in (3, 0, 1)
            ]
        )
    finally:
        for beat in beating:
            beat.stop()
    lists = {r: v for r, v in out.items() if isinstance(v, tuple)}
    assert sorted(lists) == [0, 1, 3], out
    assert {members for _, members in lists.values()} == {(0, 1, 3)}
    waited = [w for w, _ in lists.values()]
    assert max(waited) >= SETTLE_S and all(w < 10 for w in waited), waited  # rank 2 never came
    _agree(store, 2, SETTLE_S, out)  # rank 2 was only late: the others went on without it
    assert isinstance(out[2], LeftOut)


SETTLE_S = 1.0
"""The agreement's settle time in these tests: twenty heartbeat periods, so a loaded machine
does not stall a live beat that long."""


def _run_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "an agreement did not end"


def test_a_slow_survivor_that_still_beats_is_waited_for_and_a_silent_one_is_not() -> None:
    """World 5: ranks 0, 1 and 3 arrive at once; rank 2 beats and arrives 2.5 s later (what a
    fixed settle time left out: the CI failure); rank 4 beat, then stopped (died). The
    survivors wait for rank 2 and agree on [0, 1, 2, 3] without rank 4; rank 2, arriving after
    the list was written, does not wait again."""
    store = HashStore()
    slow, dead = Heartbeat(store, 2, 0.05), Heartbeat(store, 4, 0.05)
    dead.stop()
    out: dict[int, object] = {}
    delays = {0: 0.0, 1: 0.0, 3: 0.0, 2: 2.5}
    try:
        _run_all(
            [
                threading.Thread(
                    target=_agree,
                    args=(store, r, SETTLE_S, out),
                    kwargs=dict(world_size=5, delay_s=d, timeout_s=20),
                )
                for r, d in delays.items()
            ]
        )
    finally:
        slow.stop()
    assert sorted(out) == [0, 1, 2, 3], out
    assert all(isinstance(v, tuple) and v[1] == (0, 1, 2, 3) for v in out.values()), out
    waited = {r: v[0] for r, v in out.items() if isinstance(v, tuple)}
    assert min(waited[r] for r in (0, 1, 3)) >= 2.5, waited  # they waited for the beating rank
    assert waited[2] < SETTLE_S, waited  # the list was written: it did not wait for rank 4


def test_a_rank_agreeing_on_another_iteration_is_not_waited_for() -> None:
    """Rank 2's all-reduce of iteration 9 completed, and it is agreeing on iteration 10 (its
    next all-reduce failed): it beats, but the survivors of iteration 9 do not wait for it."""
    store = HashStore()
    beating = Heartbeat(store, 2, 0.05)
    out: dict[int, object] = {}
    other: dict[int, object] = {}
    try:
        _run_all(
            [
                threading.Thread(
                    target=_agree,
                    args=(store, 2, SETTLE_S, other),
                    kwargs=dict(world_size=3, tag="10", timeout_s=20),
                ),
                *(
                    threading.Thread(
                        target=_agree,
                        args=(store, r, SETTLE_S, out),
                        kwargs=dict(world_size=3, tag="9", delay_s=0.3, timeout_s=20),
                    )
                    for r in (0, 1)
                ),
            ]
        )
    finally:
        beating.stop()
    assert all(isinstance(v, tuple) and v[1] == (0, 1) and v[0] < SETTLE_S for v in out.values()), out
    assert isinstance(other[2], tuple) and other[2][1] == (2,), other  # alone on iteration 10


def test_the_heartbeat_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="period must be positive"):
        Heartbeat(HashStore(), 0, 0.0)


def test_agreement_ends_at_once_when_every_rank_arrives() -> None:
    store = HashStore()
    out: dict[int, object] = {}
    threads = [threading.Thread(target=_agree, args=(store, r, 30.0, out)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(out) == [0, 1, 2, 3]
    assert all(isinstance(v, tuple) and v[1] == (0, 1, 2, 3) and v[0] < 10 for v in out.values()), out


# --- validation -------------------------------------------------------------------------------


def test_reuse_needs_somewhere_to_save_and_is_active_at_tp1_pp1_only(tmp_path: Path) -> None:
    dp4 = layout_for(4)
    with pytest.raises(InvalidArgument, match="--reuse-microbatches needs --save-dir"):
        TrainConfig(model=TINY, layout=dp4, iterations=5, reuse_microbatches=True)
    save = str(tmp_path)
    assert TrainConfig(model=TINY, layout=dp4, iterations=5, save_dir=save, reuse_microbatches=True).reusing
    # unicorn may relaunch the same command at another layout: the run goes on without it
    for layout in (layout_for(4, tp=2), layout_for(4, pp=2)):
        cfg = TrainConfig(model=TINY, layout=layout, iterations=5, save_dir=save, reuse_microbatches=True)
        assert not cfg.reusing
    with pytest.raises(InvalidArgument, match="--reuse-settle-s"):
        TrainConfig(
            model=TINY, layout=dp4, iterations=5, save_dir=save, reuse_microbatches=True, reuse_settle_s=0.0
        )
    mid = FaultInjection(iteration=2, rank=0, after_microbatches=1)
    with pytest.raises(InvalidArgument, match="--fail-after-microbatches needs pipeline parallelism 1"):
        TrainConfig(model=TINY, layout=layout_for(4, pp=2), iterations=5, fault=mid)
    with pytest.raises(InvalidArgument, match="--fail-after-microbatches must be >= 0"):
        FaultInjection(iteration=2, rank=0, after_microbatches=-1)


# --- real torchrun ------------------------------------------------------------------------------


def losses(output: str) -> dict[int, str]:
    """Iteration -> lm loss as printed (7 significant digits)."""
    return {int(m[1]): m[2] for m in _LOSS.finditer(output)}


def saved_state(version: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``--save-dir`` version (model and optimizer), by flattened name."""
    target = scratch / f"{version.parent.name}-{version.name}.pt"
    dcp_to_torch_save(str(version), str(target))
    out: dict[str, torch.Tensor] = {}

    def walk(value: object, name: str) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                walk(child, f"{name}/{key}")
        elif isinstance(value, torch.Tensor):
            out[name] = value

    walk(torch.load(target, weights_only=True), "")
    return out


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ``|a - b| / |b|`` (Frobenius norms) over every tensor, in float64."""
    assert a.keys() == b.keys() and a
    worst = 0.0
    for name, ref in b.items():
        diff = (a[name].double() - ref.double()).norm().item()
        worst = max(worst, diff / max(ref.double().norm().item(), 1e-30))
    return worst


def hook_messages(sock: socket.socket) -> list[protocol.Message]:
    sock.setblocking(False)
    out = []
    with contextlib.suppress(BlockingIOError):
        while True:
            out.append(protocol.decode(sock.recv(65536)))
    return out


@pytest.mark.timeout(600)
def test_a_dp_rank_killed_mid_iteration_costs_only_its_microbatches(tmp_path: Path, shm_root: Path) -> None:
    env = {"TMPDIR": str(tmp_path)}  # torchrun's torchelastic_* folders go with the test
    ref = tmp_path / "ref"
    reference = run(4, *REUSE, f"--save-dir={ref}", f"--save-interval={K}", timeout_s=180, env=env)
    assert reference.returncode == 0, reference.output[-3000:]
    expected = losses(reference.output)
    assert sorted(expected) == [1, 2, 3, 4, 5]

    ckpt = tmp_path / "ckpt"
    memory = (f"--snapshot-dir={shm_root}", "--snapshot-job=reuse")
    hook_path = tmp_path / "agent.sock"
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(hook_path))
    try:
        hook = {"UNICORN_HOOK_SOCKET": str(hook_path), "UNICORN_JOB_ID": "5", "UNICORN_NODE": "n1"}
        fault = run(4, *REUSE, *memory, f"--save-dir={ckpt}", *FAULT, timeout_s=180, env={**env, **hook})
        messages = hook_messages(agent)
    finally:
        agent.close()
    out = fault.output
    assert fault.returncode != 0
    assert f"injecting fault kill at iteration {K} after 1 micro-batches" in out, out[-3000:]
    # torchrun's summary: the killed rank and three survivors that completed the iteration
    assert out.count(f"exitcode  : {REUSED_EXIT_CODE} ") == 3, out[-3000:]
    assert "exitcode  : -9" in out
    assert re.search(
        rf"iteration {K} completed without DP replicas \[2\] \(lost mid-iteration\): survivors \[0, 1, 3\] "
        r"agreed in [0-9.]+ s, reused 9 finished micro-batches, "
        r"recomputed_microbatches=3 microbatches_per_iteration=12, [0-9.]+ s after the failure",
        out,
    ), out[-3000:]
    assert re.search(rf"exiting {REUSED_EXIT_CODE} after saving iteration {K} \(memory, {ckpt}\)", out)
    assert losses(out) == {i: expected[i] for i in range(1, K + 1)}
    assert (ckpt / "latest").read_text() == f"{K}\n"
    difference = max_relative_difference(
        saved_state(ckpt / f"iter_{K:07d}", tmp_path), saved_state(ref / f"iter_{K:07d}", tmp_path)
    )
    print(f"max relative difference of model and optimizer after iteration {K}: {difference:.3e}")
    assert difference <= REL_TOL
    reports = [
        m
        for m in messages
        if isinstance(m, IterationTiming) and m.phase is IterationPhase.TRAIN and m.iteration == K
    ]
    assert sorted(m.rank for m in reports) == [0, 1, 3]
    assert {(m.microbatches, m.recomputed_microbatches) for m in reports} == {(12, 3)}

    # The relaunch (what unicornd's restart does) restores iteration K from the memory tier
    # (the survivors' 3-shard save, resharded to DP4) and trains on as if nothing happened.
    resumed = run(4, *REUSE, *memory, timeout_s=180, env=env)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"restored iteration {K} from the memory tiers" in resumed.output
    assert f"resumed_from={K}" in resumed.output
    assert losses(resumed.output) == {i: expected[i] for i in range(K + 1, 6)}
