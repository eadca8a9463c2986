"""``unicornctl goodput [--since 7d] [--json]``: the goodput ledger by cause and by task.

Reads the ledger unicornd keeps in Redis (:mod:`unicornd.goodput`). ``--since`` subtracts
the newest hourly checkpoint at or before that time (the window actually shown is printed).
Exit codes: 0 shown; 1 Redis unreachable, the ledger unreadable or a bad config; 2 bad
usage (a ``--since`` that is no duration); 3 no ledger in Redis (unicornd keeps none yet).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, Final

import click

from unicorn_core import acl
from unicorn_core.errors import UnicornError
from unicorn_core.keys import RedisKeys
from unicornd.cli.common import NoStateError, StateUnreadableError, clock, config_of
from unicornd.goodput import Cause, Ledger, Phase, Totals, summary
from unicornd.ledgerstore import read_ledger

_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_since(text: str) -> float:
    """Seconds in a duration such as ``90m``, ``7d`` or ``2w``; ValueError otherwise."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a duration: a number and one of s, m, h, d, w (e.g. 7d)")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"{text!r}: the duration must be > 0")
    return seconds


class Since(click.ParamType[float]):
    """A ``--since`` duration (:func:`parse_since`); bad ones are usage errors (exit 2)."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_since(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def goodput_json(ledger: Ledger, since_s: float | None, now_s: float) -> dict[str, Any]:
    """The ``--json`` document: the window, ``ideal``, ``achieved``, ``lost`` by cause,
    ``unattributed``, GPU-seconds, the WAF now, and the same per task (with its GPUs, its
    weighted TFLOP per iteration, its achieved rate now (0 unless it is running), and the
    time and iterations of its running stretches)."""
    start, totals, tasks = ledger.since(-float("inf") if since_s is None else now_s - since_s)
    return {
        "from_s": start,
        "until_s": ledger.t_s,
        "units": {"work": "weighted TFLOP", "time": "GPU-seconds"},
        **summary(totals),
        "achieved_waf_tflops": ledger.achieved_wtflops(),
        "ideal_waf_tflops": ledger.ideal_wtflops(),
        "tasks": {
            tid: {
                **summary(t),
                "phase": ledger.tasks[tid].phase.value,
                "calibration": ledger.tasks[tid].efficiency,
                "gpus": ledger.tasks[tid].gpus,
                "iteration_wtflop": ledger.tasks[tid].iteration_wtflop,
                "running_s": ledger.tasks[tid].running_s,
                "running_iterations": ledger.tasks[tid].running_iterations,
                "running_ranges": [list(r) for r in ledger.tasks[tid].running_ranges],
                "achieved_waf_tflops": (
                    ledger.tasks[tid].achieved_wtflops if ledger.tasks[tid].phase is Phase.RUNNING else 0.0
                ),
            }
            for tid, t in sorted(tasks.items())
        },
    }


def _row(name: str, t: Totals) -> list[str]:
    def pct(v: float) -> str:
        return f"{100 * v / t.ideal_wtflop:5.1f}%" if t.ideal_wtflop else "    -"

    gap = t.ideal_wtflop - t.achieved_wtflop
    lost = [pct(t.lost_wtflop.get(c, 0.0)) for c in Cause]
    return [name, f"{t.ideal_wtflop / 3600:.3g}", pct(t.achieved_wtflop), pct(gap), *lost]


def render_goodput(ledger: Ledger, since_s: float | None, now_s: float) -> str:
    """The human view: the window, a table by cause (share of the ideal) for the cluster and
    each task, and GPU-hours by cause."""
    start, totals, tasks = ledger.since(-float("inf") if since_s is None else now_s - since_s)
    head = ["", "IDEAL wTFLOP-h", "ACHIEVED", "GAP", *(c.value.upper() for c in Cause)]
    rows = [head, _row("cluster", totals), *(_row(f"task {tid}", t) for tid, t in sorted(tasks.items()))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        f"goodput {clock(start)} .. {clock(ledger.t_s)}  (achieved WAF now {ledger.achieved_wtflops():.4g} "
        f"of ideal {ledger.ideal_wtflops():.4g} weighted TFLOP/s)",
        *("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows),
        f"unattributed (since each task's last iteration): {totals.unattributed_wtflop / 3600:.3g} wTFLOP-h",
        "GPU-hours: "
        + ", ".join(
            [f"total {totals.gpu_s / 3600:.3g}", f"productive {totals.productive_gpu_s / 3600:.3g}"]
            + [f"{c.value} {totals.lost_gpu_s.get(c, 0.0) / 3600:.3g}" for c in Cause]
        ),
    ]
    return "\n".join(lines)


async def read_ledger_of(cfg: Any) -> Ledger | None:
    """The goodput ledger in the configured Redis (None: none kept yet); ``unicornctl
    goodput`` and ``report`` read it so."""
    client = acl.connect_caller(cfg.redis, client_name="unicornctl")
    try:
        return await read_ledger(client, RedisKeys(cfg.redis.key_prefix))
    finally:
        await client.aclose()


@click.command()
@click.option("--since", "since_s", type=Since(), default=None, help="Only the last DURATION (e.g. 7d, 12h).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def goodput(ctx: click.Context, since_s: float | None, as_json: bool) -> None:
    """The goodput ledger: achieved vs ideal WAF and the gap by cause (detection, decision and
    drain, transition, recomputation, sub-healthy, idle), for the cluster and each task.

    Exit codes: 0 shown; 1 Redis unreachable, ledger unreadable or a bad config; 2 bad
    usage; 3 no ledger in Redis (unicornd has kept none).
    """
    cfg = config_of(ctx)
    try:
        ledger = asyncio.run(read_ledger_of(cfg))
    except UnicornError as e:
        raise StateUnreadableError(f"cannot read the goodput ledger: {e}") from None
    if ledger is None:
        raise NoStateError(
            f"no goodput ledger in Redis (key prefix {cfg.redis.key_prefix!r}): unicornd keeps none"
        )
    now_s = time.time()
    if as_json:
        click.echo(json.dumps(goodput_json(ledger, since_s, now_s), indent=2))
    else:
        click.echo(render_goodput(ledger, since_s, now_s))
