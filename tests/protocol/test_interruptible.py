"""peer.runtime.interruptible: SIGTERM inside it interrupts a blocking call with Interrupted, and
sets the stop event without a logged traceback when it arrives while the event loop is idle (a
volunteer SIGTERMed while it waited for the run printed "Exception in callback ... Interrupted")."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

import pytest
import uvloop

from peer.runtime import Interrupted, interruptible, quiet_peer_departures

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run_on(kind: str, coro_fn):
    loop = LOOPS[kind]()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_a_signal_while_the_loop_is_idle_sets_stop_and_logs_nothing(kind, caplog):
    before = signal.getsignal(signal.SIGTERM)

    async def idle():
        stop = asyncio.Event()
        quiet_peer_departures(asyncio.get_running_loop())  # as run_until_signalled does
        with interruptible(stop):
            asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 30)  # the event it means: set by the handler
        return stop.is_set()

    with caplog.at_level(logging.DEBUG):
        assert run_on(kind, idle) is True
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert signal.getsignal(signal.SIGTERM) is before  # the handler that was there is back


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_a_signal_during_a_blocking_call_raises_interrupted(kind):
    went_off = threading.Event()

    async def blocking():
        stop = asyncio.Event()
        with interruptible(stop):
            with pytest.raises(Interrupted, match="SIGTERM"):
                threading.Thread(target=lambda: (os.kill(os.getpid(), signal.SIGTERM), went_off.set())).start()
                while True:  # blocks the loop, as start_dht's wait for the initial peers does
                    went_off.wait(0.01)
        return stop.is_set()

    assert run_on(kind, blocking) is True
