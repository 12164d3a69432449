"""A delivery being retried ends when its task is cancelled, even when the call in flight turns the
cancellation into an error of its own (a stopping server's retries kept its process alive for
minutes after it decided to leave, in a CI run of the frozen-server test)."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest

from parameter_server.outbox import Outbox


class SwallowingLink:
    calls = 0

    async def call(self, method, meta, tensors, timeout):
        SwallowingLink.calls += 1
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise ConnectionError("the connection closed before an answer") from None


def owed() -> Outbox:
    layout = SimpleNamespace(stages=[SimpleNamespace(servers=["s1f0"])])
    return Outbox("s0b0", layout=lambda: layout, epoch=lambda: 0, connector=lambda device: SwallowingLink())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+")
def test_a_cancelled_delivery_stops_even_if_the_call_swallows_the_cancellation():
    async def scenario():
        task = asyncio.ensure_future(owed().deliver_loop("s1f0", "push_inputs", {}, [], attempts=600))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert SwallowingLink.calls == 1
