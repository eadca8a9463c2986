"""unicornd's threads share one malloc arena (unicornd.daemon.one_malloc_arena); a stop
that hangs logs where each stuck task waits."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from unicornd.daemon import _stacks


def test_the_daemons_threads_share_one_malloc_arena() -> None:
    """glibc takes the setting (this project runs on Debian); in a child, so this test
    process keeps its allocator as it is. What it saves is measured in
    scripts/bench/malloc_arena.py (a solve in a thread: 13-20 MiB kept, 0 with one arena)."""
    code = "from unicornd.daemon import one_malloc_arena; print(one_malloc_arena())"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "True", done.stderr


async def test_a_stuck_tasks_log_names_the_await_it_waits_in() -> None:
    async def waits_here() -> None:
        await asyncio.sleep(60)

    async def root() -> None:
        await waits_here()

    task = asyncio.create_task(root(), name="executor")
    await asyncio.sleep(0)
    try:
        where = _stacks([task])
    finally:
        task.cancel()
    assert list(where) == ["executor"]
    lines = where["executor"].splitlines()
    assert [line.rsplit(" in ", 1)[1] for line in lines[:2]] == ["root", "waits_here"], lines
