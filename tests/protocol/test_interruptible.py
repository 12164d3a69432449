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


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_a_process_forked_inside_ends_by_the_signal_without_a_traceback(kind):
    """hivemind forks the DHT process inside the blocking start that `interruptible` guards: the
    child inherits the handler. SIGTERM there ends the child as it would by default, instead of
    raising Interrupted into the child's own event loop (a traceback in the volunteer's log, and a
    child that went on running)."""
    before = signal.getsignal(signal.SIGTERM)
    read, write = os.pipe()
    stop = asyncio.Event()
    try:
        with interruptible(stop):
            pid = os.fork()
            if pid == 0:  # the child: its own loop, idle until the signal (or 30 s)
                os.close(read)
                os.dup2(write, 2)  # what it would log goes to the pipe
                os.write(write, b"ready\n")
                try:
                    run_on(kind, lambda: asyncio.sleep(30))
                finally:
                    os._exit(7)
            os.close(write)
            with os.fdopen(read, "rb") as out:
                assert out.readline() == b"ready\n"  # the event it means: the child's loop is about to run
                os.kill(pid, signal.SIGTERM)
                _, status = os.waitpid(pid, 0)
                said = out.read()
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        assert b"Traceback" not in said and b"Interrupted" not in said, said
        assert not stop.is_set()  # the parent's stop is the parent's own
    finally:
        assert signal.getsignal(signal.SIGTERM) == before
