#!/usr/bin/env python3
"""What Redis durability costs on unicornd's commit path: prints one JSON object.

One private redis-server per mode, on this machine's disk (``--dir``, default the system
temp folder), each started fresh: ``off`` (no persistence, what the dev cluster ran),
``everysec`` (AOF, fsync once a second: a crash of Redis loses nothing, a crash of the
machine up to 1 s of acknowledged commits) and ``always`` (AOF, fsync before every reply:
nothing acknowledged is lost) and ``everysec_wait1`` (everysec plus a replica on this
machine, and each commit WAITs for it: ``[redis] wait_replicas = 1``, what a Sentinel
failover would otherwise lose). The workload is unicornd's real commit
(:meth:`unicornd.store.Store.commit`, the fenced Lua script) of a snapshot of ``--nodes``
nodes, ``--tasks`` tasks and ``--incidents`` closed incidents (the observability bench's
cluster), with one owed action appended and one finished per commit, ``--commits`` times.

Per mode: commit latency median and p99 (ms); ``*_over_off`` are the ratios to ``off``
measured in the same run. The physical limit of ``always`` is the disk's fsync latency,
reported as ``fsync_ms`` (median of 50 fsyncs of a 4 KiB write in the same folder).

Run: ``nice -n 10 .venv/bin/python scripts/bench/commit.py [--commits 500]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

import redis.asyncio as aioredis  # noqa: E402
from observability import build  # noqa: E402

from unicorn_core.config import RedisConfig  # noqa: E402
from unicorn_core.keys import RedisKeys  # noqa: E402
from unicornd.actions import CloseIncident  # noqa: E402
from unicornd.state import Policy  # noqa: E402
from unicornd.store import Store  # noqa: E402

MODES = {
    "off": ["--appendonly", "no"],
    "everysec": ["--appendonly", "yes", "--appendfsync", "everysec"],
    "always": ["--appendonly", "yes", "--appendfsync", "always"],
    "everysec_wait1": ["--appendonly", "yes", "--appendfsync", "everysec"],
}
REPLICATED = {"everysec_wait1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fsync_ms(folder: Path) -> float:
    path = folder / "fsync-probe"
    times = []
    with path.open("wb") as f:
        for _ in range(50):
            f.write(os.urandom(4096))
            f.flush()
            t = time.perf_counter()
            os.fsync(f.fileno())
            times.append(time.perf_counter() - t)
    path.unlink()
    return statistics.median(times) * 1000


async def commits(port: int, n: int, nodes: int, tasks: int, incidents: int, wait: int) -> list[float]:
    client = aioredis.Redis(port=port)
    replication = RedisConfig(sentinels=("127.0.0.1:1",), wait_replicas=wait, wait_timeout_ms=1000)
    store = Store(client, RedisKeys("bench"), Policy(), token=0, replication=replication)
    snap = build(nodes, tasks, incidents)
    times = []
    try:
        for i in range(n):
            action = CloseIncident(f"bench/{i}", "c.0")
            t = time.perf_counter()
            await store.commit(snap, [action])
            owed = (await store.owed())[0]
            await store.commit(snap, finished=owed)
            times.append(time.perf_counter() - t)
    finally:
        await client.aclose()
    if store.unreplicated:
        raise SystemExit(f"{store.unreplicated} commits were not acknowledged by the replica in 1 s")
    return [x / 2 for x in times]  # two commits per round


def start(
    exe: str, folder: Path, flags: list[str], replica_of: int | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    folder.mkdir()
    port = free_port()
    extra = ["--replicaof", "127.0.0.1", str(replica_of)] if replica_of else []
    server = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(folder), *flags, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return server, port
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.05)


def replica_online(port: int) -> bool:
    info = subprocess.run(
        ["redis-cli", "-p", str(port), "INFO", "replication"],
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    ).stdout
    return "state=online" in info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--commits", type=int, default=500)
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--incidents", type=int, default=500)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (scripts/bootstrap installs it)")
    out: dict[str, object] = {"bench": "commit", "commits": args.commits, "nodes": args.nodes}
    with tempfile.TemporaryDirectory(prefix="unicorn-bench-commit-", dir=args.dir) as d:
        out["fsync_ms"] = round(fsync_ms(Path(d)), 3)
        medians = {}
        for mode, flags in MODES.items():
            servers = []
            try:
                server, port = start(exe, Path(d) / mode, flags)
                servers.append(server)
                wait = 0
                if mode in REPLICATED:
                    replica, _ = start(exe, Path(d) / f"{mode}-replica", flags, replica_of=port)
                    servers.append(replica)
                    deadline = time.monotonic() + 20
                    while not replica_online(port):
                        if time.monotonic() > deadline:
                            raise SystemExit("the replica did not come online")
                        time.sleep(0.1)
                    wait = 1
                times = asyncio.run(commits(port, args.commits, args.nodes, args.tasks, args.incidents, wait))
            finally:
                for server in servers:
                    server.terminate()
                    server.wait(10)
            ms = sorted(t * 1000 for t in times)
            medians[mode] = statistics.median(ms)
            out[f"{mode}_median_ms"] = round(medians[mode], 3)
            out[f"{mode}_p99_ms"] = round(ms[int(0.99 * (len(ms) - 1))], 3)
        for mode in ("everysec", "always", "everysec_wait1"):
            out[f"{mode}_over_off"] = round(medians[mode] / medians["off"], 3)
        out["wait1_over_everysec"] = round(medians["everysec_wait1"] / medians["everysec"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
