"""One test of the paired node check: a small all-gather and a matmul across 2-3 nodes.

Run as one task per node by ``srun`` (``python -m launcher.pairtest``): ranks come from
``SLURM_PROCID``/``SLURM_NTASKS``, the rendezvous from ``--master-addr/--master-port``.
Every rank all-gathers a tensor (checking the values, so corrupted data fails the test),
then times a matmul on its own device (CUDA when available, else CPU); rank 0 prints one
JSON line ``{"ok": bool, "nodes": [...], "allgather_s": ..., "matmul_s": {node: s}}``.

A test fails when a collective errors or times out (``--timeout-s``) or a rank's matmul
is slower than ``--slow-factor`` x the fastest rank's (a degraded GPU). The timing is
judged on GPUs only: on CPU ranks it is reported, not judged, because a CPU matmul's time
says more about what else the cores run than about the node (measured on the dev
cluster, whose nodes share two cores: 0.016 s against 0.004 s on a healthy node, which the
paired check then named bad).

``UNICORN_PAIRTEST_FAULT_NODE`` (TEST ONLY) makes the rank on that node corrupt its
all-gather contribution, so tests can plant a bad node on a CPU cluster.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from typing import cast


def main() -> None:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m launcher.pairtest")
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--size", type=int, default=1 << 16, help="all-gather elements per rank")
    p.add_argument("--matmul-n", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7, help="matmul timings; the fastest counts")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--slow-factor", type=float, default=3.0)
    args = p.parse_args()

    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))
    world = int(os.environ.get("SLURM_NTASKS", os.environ.get("WORLD_SIZE", "1")))
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    problems: list[str] = []
    mine = torch.full((args.size,), float(rank + 1), device=device)
    if os.environ.get("UNICORN_PAIRTEST_FAULT_NODE") == node:
        mine[::7] = -1.0  # TEST ONLY: a node whose data arrives corrupted
    out = [torch.empty_like(mine) for _ in range(world)]
    t0 = time.perf_counter()
    dist.all_gather(out, mine)
    allgather_s = time.perf_counter() - t0
    for r, got in enumerate(out):
        if not torch.equal(got, torch.full_like(got, float(r + 1))):
            problems.append(f"{node}: all-gather data from rank {r} corrupted")
    a = torch.randn(args.matmul_n, args.matmul_n, device=device)
    # The best of several repetitions: a node's capability, not its momentary load.
    matmul_s = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        matmul_s = min(matmul_s, time.perf_counter() - t0)
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, (node, matmul_s, problems))
    dist.destroy_process_group()
    if rank != 0:
        return
    reports = [cast(tuple[str, float, list[str]], item) for item in gathered]
    timings = {name: float(secs) for name, secs, _ in reports}
    all_problems = [msg for _, _, probs in reports for msg in probs]
    fastest = min(timings.values())
    for n, s in timings.items():
        if device.type == "cuda" and s > args.slow_factor * fastest:
            all_problems.append(f"{n}: matmul {s:.3f}s > {args.slow_factor:g}x fastest {fastest:.3f}s")
    doc = {
        "ok": not all_problems,
        "nodes": list(timings),
        "allgather_s": round(allgather_s, 6),
        "matmul_s": timings,
        "problems": all_problems,
    }
    print(json.dumps(doc), flush=True)
    sys.exit(0 if doc["ok"] else 1)


if __name__ == "__main__":
    main()
