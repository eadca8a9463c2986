#!/usr/bin/env python3
"""The scale bench's unicornd: the real :class:`unicornd.daemon.Daemon` with the scripted Slurm.

Run by ``scripts/bench/scale.py`` as its own process (so its CPU and memory are its own),
never by hand: ``scale_daemon.py SPEC.json``. It is ``unicornd`` (:func:`unicornd.daemon.run_daemon`)
with two differences: the Slurm backend is :class:`scale_slurm.ScriptedSlurm`, built from
the spec (nodes, jobs, timings) and publishing what Slurm did on the bench's stream, and
the process measures itself:

- event-loop lag: a task that sleeps :data:`LAG_PERIOD_S` and records how late it woke;
- every commit's cost (:attr:`unicornd.store.Store.on_commit`);
- every commit that opened or changed an incident, with its wall time, the findings it
  took in and its actions (a :class:`unicornd.core.Core` follower);
- Python's full garbage collections (``gc.callbacks``): when, how long they held the loop;
- with ``spec["tracemalloc_every_s"]`` > 0 (``scale.py --tracemalloc-every-s``; a
  diagnostic that slows every allocation, so its run's timings are not figures): a
  :mod:`tracemalloc` snapshot that often from the window's start, written by a forked child;
  the bench compares each with the one before, by allocating call site (where RSS growth
  comes from).

Configuration comes from the environment (``UNICORN_*``), as for unicornd. The node deaths
of the fault schedule are scripted relative to the measurement window's start, which the
bench writes to Redis (``<prefix>:bench:t0``) once unicornd is up. On SIGINT the daemon
stops (as unicornd does) and this process writes what it measured to ``spec["out"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import os
import signal
import sys
import time
import tracemalloc
from array import array
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, cast

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.append(str(HERE))  # after the packages: scripts/bench/ckpt.py must not shadow ckpt

import redis.asyncio as aioredis  # noqa: E402
from scale_slurm import ScriptedSlurm, SlurmEvent, SlurmTimings  # noqa: E402

from unicorn_core import redis_io  # noqa: E402
from unicorn_core.config import load_config  # noqa: E402
from unicorn_core.logs import configure_logging  # noqa: E402
from unicornd.actions import Decision  # noqa: E402
from unicornd.daemon import Daemon  # noqa: E402
from unicornd.state import Snapshot  # noqa: E402
from unicornd.store import CommitCost  # noqa: E402

LAG_PERIOD_S: Final = 0.05
GC_RECORD_S: Final = 0.01
TYPES_EVERY_S: Final = 900.0
"""How often the most numerous object types are counted inside the window (:meth:`Recorder.types_every`)."""
HEAP_EVERY_S: Final = 30.0
MALLINFO2_FIELDS: Final = ("arena", "hblkhd", "uordblks", "fordblks", "keepcost")
"""glibc's heap as ``mallinfo2`` gives it: bytes from sbrk, bytes in mmapped chunks, bytes in
use, bytes free inside the heap, bytes trimmable at its top."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's ``mallinfo2`` (2.33+), or None where there is none."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return cast(Callable[[], _MallInfo2], fn)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


SMAPS_FIELDS: Final = ("heap_rss", "anon_other_rss", "file_rss")
"""Resident bytes by mapping (``/proc/self/smaps``): glibc's sbrk heap (``[heap]``, what
``malloc_trim`` gives back shows here, not in ``mallinfo2``'s ``arena``), other anonymous
memory (pymalloc's arenas, mmapped chunks, thread stacks), and file-backed pages (code)."""


def _smaps() -> tuple[int, int, int]:
    heap = anon = total = 0
    in_heap = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(maxsplit=1)[0]:
                in_heap = line.rstrip().endswith("[heap]")
            elif line.startswith("Rss:"):
                kib = int(line.split()[1])
                total += kib
                if in_heap:
                    heap += kib
            elif line.startswith("Anonymous:") and not in_heap:
                anon += int(line.split()[1])
    return heap * 1024, anon * 1024, (total - heap - anon) * 1024


SNAPSHOT_WAIT_S: Final = 120.0
"""How long a forked child may take to write a tracemalloc snapshot (~10 s at 4,096 nodes)."""
BLOCKS_EVERY: Final = 600
"""Lag samples between two readings of Python's allocated blocks (30 s)."""


def slurm_stream(prefix: str) -> str:
    """The bench's stream of Slurm events (not unicorn's: only this bench writes it)."""
    return f"{prefix}:bench:slurm"


def t0_key(prefix: str) -> str:
    """The wall time the measurement window starts at (written by the bench)."""
    return f"{prefix}:bench:t0"


def _exit_code(pid: int) -> int | None:
    """The exit code of child ``pid`` once it has ended (reaping it), else None; never blocks."""
    done, status = os.waitpid(pid, os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def _kill_and_reap(pid: int) -> None:
    """End child ``pid`` if it still runs, and reap it; nothing when it was reaped already."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG) == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _rows(flat: array[float], width: int, ints: tuple[int, ...] = ()) -> list[list[float | int]]:
    """A flat array of ``width``-wide samples as rows (the columns in ``ints`` as ints)."""
    rows: list[list[float | int]] = []
    for i in range(0, len(flat), width):
        row: list[float | int] = list(flat[i : i + width])
        for c in ints:
            row[c] = int(row[c])
        rows.append(row)
    return rows


class Recorder:
    """What this unicornd measures about itself (see the module docstring)."""

    def __init__(self) -> None:
        # Samples are kept flat in typed arrays, not as tuples of floats: ~20 a second for an
        # hour made ~240,000 live Python objects an hour *in unicornd's process* (untracked
        # by the collector), which the bench then measured as unicornd's memory growth
        # (found in session 26; the tuples were most of the "creep"). An array costs 8 bytes
        # a number and allocates no Python object per sample (:meth:`recorder_bytes`).
        self.lag = array("d")
        """(wall time, seconds late) per sample, flat."""
        self.commits = array("d")
        """(wall time, state bytes, serialise seconds, total seconds) per commit, flat."""
        self.incidents: list[dict[str, Any]] = []
        self.gcs = array("d")
        """(wall start, generation, seconds, objects collected) per collection, flat: full
        collections, and any other of :data:`GC_RECORD_S` or more."""
        self._gc_start: float | None = None
        self.blocks: list[tuple[float, int]] = []
        """(wall time, ``sys.getallocatedblocks()``) every :data:`BLOCKS_EVERY` lag samples:
        whether RSS growth is Python objects or the allocator's own."""
        self.types_at: list[tuple[str, list[tuple[str, int]]]] = []
        self.traced: list[tuple[float, str]] = []
        """(wall time, file) of each tracemalloc snapshot (:meth:`trace_snapshots`), when asked for."""

    def commit(self, cost: CommitCost) -> None:
        self.commits.extend((time.time(), cost.state_bytes, cost.serialise_s, cost.total_s))

    def follow(self, before: Snapshot, after: Snapshot, decision: Decision) -> None:
        """A commit that opened or changed incidents: each one's new finding ids (they name
        the stream entry or the silent node that caused them) and the decision's actions."""
        changed = []
        for inc in decision.incidents:
            old = before.incidents.get(inc.incident_id)
            seen = set(old.finding_ids) if old is not None else set()
            changed.append(
                {
                    "id": inc.incident_id,
                    "task": inc.task_id,
                    "node": inc.node,
                    "rule": inc.rule,
                    "evidence": inc.evidence[:300],
                    "new": old is None,
                    "findings": [f for f in inc.finding_ids if f not in seen],
                }
            )
        if changed:
            actions = [
                [a.action_id, a.kind, getattr(a, "node", None), getattr(a, "job_id", None)]
                for a in decision.actions
            ]
            self.incidents.append({"t": time.time(), "incidents": changed, "actions": actions})

    def gc_phase(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks``: each collection's generation, wall start and duration, and what
        it collected (a full collection holds the loop for the whole heap's scan)."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            took = time.perf_counter() - self._gc_start
            self._gc_start = None
            if info["generation"] == 2 or took >= GC_RECORD_S:
                self.gcs.extend((time.time() - took, info["generation"], took, info["collected"]))

    async def sample_lag(self) -> None:
        loop = asyncio.get_running_loop()
        n = 0
        while True:
            t = loop.time()
            await asyncio.sleep(LAG_PERIOD_S)
            self.lag.extend((time.time(), loop.time() - t - LAG_PERIOD_S))
            n += 1
            if n % BLOCKS_EVERY == 0:  # Python's allocated blocks: O(1) to read
                self.blocks.append((time.time(), sys.getallocatedblocks()))

    def recorder_bytes(self) -> int:
        """Bytes this recorder's sample arrays hold (they grow with the window: subtract
        their growth from unicornd's RSS growth)."""
        return sum(a.buffer_info()[1] * a.itemsize for a in (self.lag, self.commits, self.gcs))

    async def trace_snapshots(self, every_s: float, folder: Path) -> None:
        """Every ``every_s``: a :mod:`tracemalloc` snapshot written to ``folder`` by a forked
        child (the copy of this process at that instant), so that taking it (seconds, at
        4,096 nodes) never stalls the loop; the bench compares them after the run."""
        n = 0
        while True:
            await asyncio.sleep(every_s)
            n += 1
            path = folder / f"trace-{n:03d}.snap"
            pid = os.fork()
            if pid == 0:  # the child: only the snapshot (complete or absent), then out
                status = 1
                try:
                    tracemalloc.take_snapshot().dump(f"{path}.part")
                    os.replace(f"{path}.part", path)
                    status = 0
                finally:
                    os._exit(status)
            try:  # a child stuck on a lock the fork copied is killed, never waited on forever
                for _ in range(int(SNAPSHOT_WAIT_S / 0.1)):
                    code = _exit_code(pid)
                    if code is not None:
                        if code == 0:
                            self.traced.append((time.time(), str(path)))
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise TimeoutError(f"tracemalloc snapshot {n} took over {SNAPSHOT_WAIT_S} s")
            finally:
                _kill_and_reap(pid)

    def object_types(self, top: int = 25) -> list[tuple[str, int]]:
        """The most numerous types among the objects the collector tracks (a walk of the
        whole heap: taken at the window's edges, outside the measurement, and every
        :data:`TYPES_EVERY_S` inside it: :meth:`types_every`)."""
        counts: Counter[str] = Counter(type(o).__qualname__ for o in gc.get_objects())
        return counts.most_common(top)

    async def types_every(self, every_s: float, t0: float) -> None:
        """Object types every ``every_s`` from the window's start (``t0``): which types a
        second-half RSS rise is made of. Each walk holds the loop (~0.1-1 s at 4,096 nodes):
        a few samples of the loop lag in an hour, not its p99."""
        n = 1
        while True:
            await asyncio.sleep(max(0.0, t0 + n * every_s - time.time()))
            self.types_at.append((f"t0+{n * every_s:.0f}s", self.object_types()))
            n += 1


async def main(spec: dict[str, Any]) -> int:
    """Run unicornd until it stops, then write what it measured about itself; its status."""
    every_s = float(spec.get("tracemalloc_every_s") or 0)
    if every_s > 0:
        tracemalloc.start(int(spec.get("tracemalloc_frames") or 4))
    cfg = load_config()
    configure_logging(cfg.log.level, "json")
    prefix = cfg.redis.key_prefix
    bench = redis_io.connect(cfg.redis, client_name="scale-bench-slurm")
    stream = slurm_stream(prefix)

    async def publish(ev: SlurmEvent) -> None:
        await redis_io.call(("XADD", stream), bench.xadd(stream, {"e": json.dumps(ev.to_dict())}))

    slurm = ScriptedSlurm(
        spec["nodes"],
        {int(j): tuple(ns) for j, ns in spec["jobs"].items()},
        gpus_per_node=int(spec["gpus_per_node"]),
        timings=SlurmTimings(**spec["slurm_timings"]),
        on_event=publish,
    )
    client: aioredis.Redis = redis_io.connect(cfg.redis, client_name="unicornd")
    trim = spec.get("malloc_trim_every_s")
    daemon = Daemon(  # as the unicornd command
        cfg, slurm, client, freeze_gc=True, **({} if trim is None else {"trim_every_s": float(trim)})
    )
    rec = Recorder()
    daemon.store.on_commit = rec.commit
    daemon.core.followers.append(rec.follow)

    async def deaths_at_t0() -> None:
        while True:
            raw = await redis_io.call(("GET", t0_key(prefix)), bench.get(t0_key(prefix)))
            if raw is not None:
                t0 = float(raw)
                slurm.schedule_deaths({n: t0 + float(s) for n, s in spec["deaths"].items()})
                if every_s > 0:  # (a walk of the heap under tracemalloc stalls the loop for seconds)
                    folder = Path(spec["out"]).parent
                    helpers.append(asyncio.create_task(rec.trace_snapshots(every_s, folder)))
                else:
                    rec.types_at.append(("window_start", rec.object_types()))
                    helpers.append(asyncio.create_task(rec.types_every(TYPES_EVERY_S, t0)))
                return
            await asyncio.sleep(0.1)

    pool_in_use: list[tuple[float, int]] = []

    async def sample_pool() -> None:
        """unicornd's Redis connections in use, every 10 s: redis-py's pool (100) fails a call
        beyond it at once, and the hour run of 2026-11-28 ended on that at 3,154 s. A burst
        shows as a spike, a leak as a climb."""
        pool = client.connection_pool
        while True:
            pool_in_use.append((time.time(), len(getattr(pool, "_in_use_connections", ()))))
            await asyncio.sleep(10.0)

    heap: list[list[float]] = []

    async def sample_heap() -> None:
        """Where the process's memory is, every :data:`HEAP_EVERY_S`: (wall time, RSS, then
        glibc's :data:`MALLINFO2_FIELDS` and the resident :data:`SMAPS_FIELDS` in bytes, then
        Python's allocated blocks)."""
        info = _mallinfo2()
        while True:
            row = [time.time(), float(_rss_bytes())]
            if info is not None:
                got = info()
                row.extend(float(getattr(got, f)) for f in MALLINFO2_FIELDS)
            row.extend(float(x) for x in _smaps())
            row.append(float(sys.getallocatedblocks()))
            heap.append(row)
            await asyncio.sleep(HEAP_EVERY_S)

    gc.callbacks.append(rec.gc_phase)
    helpers = [
        asyncio.create_task(sample_heap()),
        asyncio.create_task(rec.sample_lag()),
        asyncio.create_task(deaths_at_t0()),
        asyncio.create_task(sample_pool()),
    ]
    error = ""
    try:
        status = await daemon.run()
    except Exception as e:  # as unicornd's main: it failed; what it measured is still written
        error = repr(e)[:500]
        print(f"unicornd failed: {error}", file=sys.stderr)
        status = 1
    if every_s <= 0:
        rec.types_at.append(("end", rec.object_types()))
    # Written before anything else can hang: a unicornd whose root tasks did not end
    # within its shutdown time ("shutdown_stuck") may never finish asyncio's own cleanup.
    out = {
        "status": status,
        "error": error,
        "lag": _rows(rec.lag, 2),
        "commits": _rows(rec.commits, 4, ints=(1,)),
        "incidents": rec.incidents,
        "gcs": _rows(rec.gcs, 4, ints=(1, 3)),
        "recorder_bytes": rec.recorder_bytes(),
        "blocks": rec.blocks,
        "object_types": rec.types_at,
        "tracemalloc": rec.traced,
        "slurm_calls": [e.to_dict() for e in slurm.calls],
        "redis_pool_in_use": pool_in_use,
        "heap": heap,
        "heap_fields": [
            "t",
            "rss",
            *(MALLINFO2_FIELDS if _mallinfo2() is not None else ()),
            *SMAPS_FIELDS,
            "blocks",
        ],
        "trims_s": list(daemon.trims),
        "solves": {
            "hits": daemon.core.ctx.solves.hits,
            "misses": daemon.core.ctx.solves.misses,
            "hit_s": list(daemon.core.ctx.solves.hit_s),
            "miss_s": list(daemon.core.ctx.solves.miss_s),
            "missed": [list(m) for m in daemon.core.ctx.solves.missed],
            "misses_beyond_one_step": daemon.core.ctx.solves.misses_beyond_one_step,
        },
        "lookup": {
            "builds": daemon.lookup.builds,
            "build_s": daemon.lookup.build_s,
            "solved": daemon.lookup.solved,
            "reused": daemon.lookup.reused,
            "failures": daemon.lookup.failures,
        },
    }
    await asyncio.to_thread(Path(spec["out"]).write_text, json.dumps(out))
    for t in helpers:
        t.cancel()
    await asyncio.gather(*helpers, return_exceptions=True)
    await client.aclose()
    await bench.aclose()
    return status


if __name__ == "__main__":
    sys.exit(asyncio.run(main(json.loads(Path(sys.argv[1]).read_text()))))
