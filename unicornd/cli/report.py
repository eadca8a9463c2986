"""``unicornctl report --html FILE [--since 7d]``: the cluster as one self-contained HTML page.

Reads unicornd's snapshot and goodput ledger from Redis, renders them with the pure
:func:`unicornd.report.render_html` (nodes, task layouts, incident Gantt chart, achieved vs
ideal WAF, lost work by cause) and writes the page atomically: a temporary file beside
``FILE``, then a rename, so a reader never sees half a page (``-`` writes to stdout).
Progress goes to stderr. Exit codes: 0 written; 1 Redis unreachable, the state or the
ledger unreadable, a bad config or ``FILE`` not writable; 2 bad usage; 3 no unicornd state.
A missing ledger is no error: the page says unicornd keeps none yet.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import click

from unicorn_core.errors import UnicornError
from unicornd.cli.common import StateUnreadableError, config_of, snapshot_of
from unicornd.cli.goodput import Since, read_ledger_of
from unicornd.report import incidents_in, render_html, window


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: written to a temporary file in the same folder,
    flushed to disk, then renamed over it (the old file's mode is kept, a new file gets
    0666 less the umask). On any error the temporary file is removed and ``path`` is as it
    was; raises OSError."""
    folder = path.parent
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, name = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(mode)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _progress(text: str) -> None:
    click.echo(f"report: {text}", err=True)


@click.command()
@click.option(
    "--html",
    "target",
    required=True,
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    help="Write the page to FILE (atomically; - for stdout).",
)
@click.option("--since", "since_s", type=Since(), default=None, help="Only the last DURATION (e.g. 7d, 12h).")
@click.pass_context
def report(ctx: click.Context, target: Path, since_s: float | None) -> None:
    """Write the cluster as one self-contained HTML page: nodes, each task's layout history,
    incident timelines (Gantt), achieved vs ideal WAF over time and lost work by cause.

    The page loads nothing (no network, no script). Exit codes: 0 written; 1 Redis
    unreachable, state or ledger unreadable, a bad config or FILE not writable; 2 bad
    usage; 3 no unicornd state in Redis.
    """
    cfg = config_of(ctx)
    _progress(f"reading unicornd's state and goodput ledger (key prefix {cfg.redis.key_prefix!r})")
    snap = snapshot_of(ctx)
    try:
        ledger = asyncio.run(read_ledger_of(cfg))
    except UnicornError as e:
        raise StateUnreadableError(f"cannot read the goodput ledger: {e}") from None
    now_s = time.time()
    win = window(ledger, snap, now_s, since_s)
    samples = 0 if ledger is None else sum(1 for s in ledger.series if s.t_s >= win.start_s)
    _progress(
        f"rendering {len(snap.nodes)} nodes, {len(snap.tasks)} tasks, "
        f"{len(incidents_in(snap, win.start_s, now_s))} incidents, {samples} WAF samples"
        + ("" if ledger is not None else " (no goodput ledger yet)")
    )
    page = render_html(snap, ledger, now_s, since_s, gpu_type=cfg.plan.gpu).encode()
    if str(target) == "-":
        sys.stdout.buffer.write(page)
        sys.stdout.buffer.flush()
        _progress(f"wrote {len(page)} bytes to stdout")
        return
    try:
        write_atomically(target, page)
    except OSError as e:
        raise StateUnreadableError(f"cannot write {target}: {e}") from None
    _progress(f"wrote {len(page)} bytes to {target}")
