"""unicornd's stop (and the node agent's) cancels its tasks until they end
(:func:`unicorn_core.aio.cancel_all`): one lost cancellation no longer leaves a task running
and unicornd exiting 1."""

from __future__ import annotations

import asyncio
import contextlib

from unicorn_core.aio import RECANCEL_S, cancel_all


async def _loses_one_cancellation(ended: list[str]) -> None:
    """Goes on to its next await after the first cancellation, as a reader whose call
    completed as it was cancelled does."""
    with contextlib.suppress(asyncio.CancelledError):  # lost
        await asyncio.sleep(3600)
    try:
        await asyncio.sleep(3600)  # the next read
    finally:
        ended.append("second")


async def _ignores_cancellations(until: asyncio.Event) -> None:
    while not until.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)


async def test_a_task_that_loses_one_cancellation_is_cancelled_again() -> None:
    ended: list[str] = []
    lossy = asyncio.create_task(_loses_one_cancellation(ended))
    plain = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)  # both started
    t0 = asyncio.get_running_loop().time()
    assert await cancel_all([lossy, plain], 10.0) == set()
    assert lossy.cancelled() and plain.cancelled() and ended == ["second"]
    assert asyncio.get_running_loop().time() - t0 < 2 * RECANCEL_S + 3.0  # well before the 10 s limit


async def test_a_task_that_never_ends_is_returned_after_the_limit() -> None:
    until = asyncio.Event()
    stubborn = asyncio.create_task(_ignores_cancellations(until))
    await asyncio.sleep(0)
    t0 = asyncio.get_running_loop().time()
    assert await cancel_all([stubborn], 1.2) == {stubborn}
    assert 1.2 <= asyncio.get_running_loop().time() - t0 < 5.0
    until.set()  # leave no task behind the test
    stubborn.cancel()
    await asyncio.wait([stubborn], timeout=5)
    assert stubborn.done()
