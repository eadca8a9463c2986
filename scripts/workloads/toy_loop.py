"""A tiny training-like loop for agent tests and detection benchmarks.

Each iteration sleeps (or does a small matmul) for ``--iter-s`` seconds and, under
torchrun (``WORLD_SIZE`` > 1), all-reduces a tensor with gloo so that a stopped rank
stalls everyone, as a hung collective does. It reports every iteration through the
unicorn hook. Fault options make it misbehave on purpose:

--raise-at N     raise RuntimeError in ``--fault-rank`` at iteration N
--print-at N     print ``--line`` to stderr in ``--fault-rank`` at iteration N
--flood          write to stderr as fast as possible from ``--fault-rank`` (agent starvation test)
--exit-at N      exit with ``--exit-code`` in ``--fault-rank`` at iteration N

It follows the agent's signal contract: SIGUSR1 = "checkpoint now" (here: the next
iteration is reported with phase ``checkpoint``), SIGTERM = finish this iteration, exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy

from launcher.hook import get_hook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=1_000_000)
    p.add_argument("--iter-s", type=float, default=0.05)
    p.add_argument("--fault-rank", type=int, default=0)
    p.add_argument("--raise-at", type=int, default=-1)
    p.add_argument("--print-at", type=int, default=-1)
    p.add_argument("--line", default="")
    p.add_argument("--exit-at", type=int, default=-1)
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--flood", action="store_true")
    p.add_argument("--no-hook", action="store_true")
    p.add_argument(
        "--compute", type=int, default=0, help="numpy 160x160 matmuls per iteration, besides --iter-s"
    )
    p.add_argument("--ckpt-s", type=float, default=0.0, help="extra seconds of a step after SIGUSR1")
    p.add_argument(
        "--steady-from",
        type=int,
        default=0,
        help="also print steady_s: the loop's time from this iteration on",
    )
    args, _layout = p.parse_known_args()  # layout flags (--tp, --dp, ...) from unicornd are ignored

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    hook = get_hook()
    if not args.no_hook:
        hook.install()
    dist = None
    if world > 1:
        import torch
        import torch.distributed as tdist

        tdist.init_process_group("gloo")
        dist = (torch, tdist)
    print(f"rank {rank}/{world} started pid {os.getpid()}", flush=True)
    faulty = rank == args.fault_rank
    mat = numpy.random.default_rng(0).random((160, 160))
    flags = {"ckpt": False, "term": False}
    signal.signal(signal.SIGUSR1, lambda *_: flags.__setitem__("ckpt", True))
    signal.signal(signal.SIGTERM, lambda *_: flags.__setitem__("term", True))
    t_loop = time.perf_counter()
    t_steady = t_loop
    for it in range(1, args.iterations + 1):
        t0 = time.perf_counter()
        if it == args.steady_from:
            t_steady = t0
        if args.flood and faulty:
            junk = "x" * 200 + "\n"
            end = time.monotonic() + args.iter_s
            while time.monotonic() < end:
                sys.stderr.write(junk * 50)
        else:
            for _ in range(args.compute):
                mat = mat @ mat
                mat /= float(abs(mat).max()) or 1.0
            if args.iter_s > 0:
                time.sleep(args.iter_s)
        if flags["ckpt"] and args.ckpt_s > 0:
            hook.slow_step("checkpoint")  # announced before the slow part, as the trainer does
            time.sleep(args.ckpt_s)
        if dist is not None:
            torch, tdist = dist
            t = torch.ones(16)
            tdist.all_reduce(t)
        if faulty and it == args.raise_at:
            raise RuntimeError(f"injected failure at iteration {it}")
        if faulty and it == args.print_at:
            print(args.line, file=sys.stderr, flush=True)
        if faulty and it == args.exit_at:
            sys.exit(args.exit_code)
        phase = "checkpoint" if flags["ckpt"] else "train"
        flags["ckpt"] = False
        if not args.no_hook:
            hook.iteration(it, time.perf_counter() - t0, samples=1, phase=phase)
        if flags["term"]:
            print(f"rank {rank}: SIGTERM, stopping after iteration {it}", flush=True)
            break
    steady = f" steady_s={time.perf_counter() - t_steady:.6f}" if args.steady_from > 0 else ""
    print(f"loop_s={time.perf_counter() - t_loop:.6f} iterations={it}{steady}", flush=True)
    if dist is not None:
        dist[1].destroy_process_group()


if __name__ == "__main__":
    main()
