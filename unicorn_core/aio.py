"""asyncio helpers shared by unicornd and the node agent: ending tasks that may have lost a
cancellation, and saying where a task that would not end is suspended."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final, TypeVar

_F = TypeVar("_F", bound="asyncio.Future[Any]")
RECANCEL_S: Final = 0.5
"""How often :func:`cancel_all` cancels again the tasks that have not ended."""


async def cancel_all(tasks: Iterable[_F], within_s: float) -> set[_F]:
    """Cancel ``tasks`` and wait up to ``within_s`` for them to end, cancelling again every
    :data:`RECANCEL_S` those still running; returns those that did not end.

    A cancellation can be lost: code that catches it, or an awaited call that completes as
    it is cancelled (Python 3.11's ``asyncio.wait_for`` then returns its result), and the
    task goes on to its next await; redis-py can swallow one around a blocking read
    (redis/redis-py#2028). Found by the 4,096-node hour: unicornd's event reader was still
    blocked in XREADGROUP 10 s after its one cancellation, and unicornd exited 1 (which of
    those lost it was not pinned down); and by detection.py's overhead runs (session 30): a
    node agent's command task went on calling XREAD 25 minutes after its training ended, and
    the agent's stop waited for it. A later cancellation lands in that read."""
    pending = set(tasks)
    deadline = asyncio.get_running_loop().time() + within_s
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
    return pending


def stacks(tasks: Iterable[asyncio.Task[Any]]) -> dict[str, str]:
    """Where each task is suspended (its innermost frames), for the log of a stop that
    hung: the task name alone does not say which await ignored the cancellation."""
    out: dict[str, str] = {}
    for t in tasks:
        # Task.print_stack shows a suspended task's outer coroutine only: follow what each
        # coroutine awaits (cr_await) down to the innermost one.
        frames: list[str] = []
        obj: Any = t.get_coro()
        while obj is not None and len(frames) < 32:
            frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
            if frame is not None:
                code = frame.f_code
                frames.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
            obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
        out[t.get_name()] = "\n".join(frames) or repr(t)
    return out
