"""unicornd's threads share one malloc arena (unicornd.daemon.one_malloc_arena), and it hands
the free pages inside its heap back (unicornd.daemon.trim_malloc); a stop that hangs logs
where each stuck task waits."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from unicorn_core.aio import stacks


def test_the_daemons_threads_share_one_malloc_arena() -> None:
    """glibc takes the setting (this project runs on Debian); in a child, so this test
    process keeps its allocator as it is. What it saves is measured in
    scripts/bench/malloc_arena.py (a solve in a thread: 13-20 MiB kept, 0 with one arena)."""
    code = "from unicornd.daemon import one_malloc_arena; print(one_malloc_arena())"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "True", done.stderr


_TRIM_CHILD = """
import ctypes, os
from unicornd.daemon import trim_malloc
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
size = 100_000  # under glibc's mmap threshold (128 KiB): from the heap
blocks = [libc.malloc(size) for _ in range(800)]
for b in blocks:
    libc.memset(b, 1, size)
for b in blocks[:-1]:  # the last block stays: the freed 80 MB lie below the heap's top
    libc.free(b)
before = rss()
done = trim_malloc()
print(done, (before - rss()) / 2**20)
"""


def test_a_trim_hands_back_the_free_pages_below_the_heaps_top() -> None:
    """free() gives memory back only from the top of the heap: 80 MB freed below a live
    block stay resident until malloc_trim (glibc; in a child, so this process's heap is
    left alone)."""
    done = subprocess.run(
        [sys.executable, "-c", _TRIM_CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    released, mib = done.stdout.split()
    assert released == "True", done.stderr
    assert float(mib) > 60, mib


async def test_a_stuck_tasks_log_names_the_await_it_waits_in() -> None:
    async def waits_here() -> None:
        await asyncio.sleep(60)

    async def root() -> None:
        await waits_here()

    task = asyncio.create_task(root(), name="executor")
    await asyncio.sleep(0)
    try:
        where = stacks([task])
    finally:
        task.cancel()
    assert list(where) == ["executor"]
    lines = where["executor"].splitlines()
    assert [line.rsplit(" in ", 1)[1] for line in lines[:2]] == ["root", "waits_here"], lines
