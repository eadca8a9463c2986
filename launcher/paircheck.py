"""Run the two-round paired node check on the cluster and name the bad node(s).

The decisions (who pairs with whom, who is convicted) are :mod:`detect.pairing`'s;
this module only runs each test, :mod:`launcher.pairtest` as one srun task per node,
concurrently for the tests of one round (they share no node).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from detect.pairing import Diagnosis, GroupResult, diagnose, pair_nodes, repair_suspects
from unicorn_core.errors import CommandTimeout
from unicorn_core.slurm.backend import SlurmBackend


@dataclass(frozen=True)
class PairedCheckReport:
    results: tuple[GroupResult, ...]
    diagnosis: Diagnosis

    def to_json(self) -> dict[str, Any]:
        return {
            "bad": list(self.diagnosis.bad),
            "cleared": list(self.diagnosis.cleared),
            "unresolved": list(self.diagnosis.unresolved),
            "tests": [{"nodes": list(r.nodes), "ok": r.ok, "detail": r.detail} for r in self.results],
        }


async def _run_group(
    slurm: SlurmBackend,
    group: Sequence[str],
    port: int,
    *,
    master_addr: str | None,
    timeout_s: float,
    job_id: int | None,
    env: Mapping[str, str] | None,
    python: str,
) -> GroupResult:
    argv = [
        python,
        "-m",
        "launcher.pairtest",
        "--master-addr",
        master_addr or group[0],
        "--master-port",
        str(port),
        "--timeout-s",
        str(max(1.0, timeout_s - 5)),
    ]
    try:
        out = await slurm.run_on_nodes(group, argv, timeout_s=timeout_s, job_id=job_id, env=env)
    except CommandTimeout:
        return GroupResult(tuple(group), False, f"timed out after {timeout_s:g}s")
    for line in reversed(out.stdout.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "ok" in doc:
            detail = "; ".join(str(p) for p in doc.get("problems", [])) or "ok"
            return GroupResult(tuple(group), bool(doc["ok"]) and out.exit_code == 0, detail)
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    return GroupResult(tuple(group), False, f"exit {out.exit_code}: {' | '.join(tail)[:500]}")


async def paired_check(
    slurm: SlurmBackend,
    nodes: Sequence[str],
    *,
    master_addr: str | None = None,
    port_base: int = 29400,
    timeout_s: float = 60.0,
    job_id: int | None = None,
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> PairedCheckReport:
    """Round 1 over ``nodes`` in pairs, round 2 re-pairing suspects with cleared nodes."""
    ports = iter(range(port_base, port_base + 10_000))
    kw: dict[str, Any] = {
        "master_addr": master_addr,
        "timeout_s": timeout_s,
        "job_id": job_id,
        "env": env,
        "python": python,
    }
    results = list(
        await asyncio.gather(*(_run_group(slurm, g, next(ports), **kw) for g in pair_nodes(nodes)))
    )
    plan = repair_suspects(results)
    for wave in plan.waves:
        results += await asyncio.gather(*(_run_group(slurm, g, next(ports), **kw) for g in wave))
    return PairedCheckReport(tuple(results), diagnose(results))
