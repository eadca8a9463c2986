"""unicornd's threads share one malloc arena (unicornd.daemon.one_malloc_arena)."""

from __future__ import annotations

import subprocess
import sys


def test_the_daemons_threads_share_one_malloc_arena() -> None:
    """glibc takes the setting (this project runs on Debian); in a child, so this test
    process keeps its allocator as it is. What it saves is measured in
    scripts/bench/malloc_arena.py (a solve in a thread: 13-20 MiB kept, 0 with one arena)."""
    code = "from unicornd.daemon import one_malloc_arena; print(one_malloc_arena())"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "True", done.stderr
