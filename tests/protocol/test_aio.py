"""A loop whose call turns a cancellation into an error of its own still stops when cancelled
(core.protocol.aio): the failure behind servers that said "finished" and never ended."""

from __future__ import annotations

import asyncio

import pytest

from core.protocol.aio import cancel_requested, check_cancelled


async def call_that_hides_a_cancellation(calls: list, release: asyncio.Event):
    calls.append(1)
    try:
        await release.wait()
    except asyncio.CancelledError:
        raise ConnectionError("the connection closed before an answer") from None


async def retry_loop(calls: list, check: bool, release: asyncio.Event):
    while not release.is_set():
        if check:
            check_cancelled()
        try:
            await call_that_hides_a_cancellation(calls, release)
        except Exception:
            await asyncio.sleep(0)


@pytest.mark.parametrize("check", [True, False])
def test_a_retry_loop_stops_when_cancelled_only_if_it_checks(check):
    async def scenario():
        calls: list = []
        release = asyncio.Event()
        task = asyncio.ensure_future(retry_loop(calls, check, release))
        await asyncio.sleep(0.01)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.5)
        stopped = task in done and task.cancelled()
        n = len(calls)
        release.set()  # (how the loop that does not check is ended here)
        await asyncio.gather(task, return_exceptions=True)
        return stopped, n

    stopped, calls = asyncio.run(scenario())
    assert stopped is check
    assert calls == 1 if check else calls > 1


def test_no_cancellation_is_requested_of_a_running_task():
    async def scenario():
        return cancel_requested()

    assert asyncio.run(scenario()) is False
