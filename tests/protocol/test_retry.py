"""core/protocol/retry.py's Attempts: the one way a call is tried again and a look is taken every
period; its budget, its pause, its stop, cancellation and the log of failures."""

from __future__ import annotations

import asyncio
import logging

import pytest

from core.protocol.retry import Attempts, Backoff


def collect(attempts: Attempts, body=None) -> list[int]:
    async def go():
        seen = []
        async for attempt in attempts:
            seen.append(attempt.number)
            if body is not None:
                body(attempt)
        return seen

    return asyncio.run(go())


def test_a_count_of_tries_and_the_last_one_said():
    lasts = []
    assert collect(Attempts(tries=3, pause=0.0), lambda a: lasts.append(a.last)) == [1, 2, 3]
    assert lasts == [False, False, True]
    with pytest.raises(ValueError, match="tries must be at least 1"):
        Attempts(tries=0)


def test_a_deadline_on_an_injected_clock_and_a_pause_cut_to_it():
    now = [0.0]

    def body(attempt):
        now[0] += 3.0  # each attempt takes 3 s of the clock

    assert collect(Attempts(within=10.0, pause=0.0, clock=lambda: now[0]), body) == [1, 2, 3, 4]  # at 0, 3, 6, 9
    now[0] = 0.0
    attempts = Attempts(within=10.0, pause=4.0, clock=lambda: now[0])
    pauses = []
    for t in (0.0, 7.0, 9.0, 12.0):
        now[0] = t
        pauses.append(attempts._pause_now())
    assert pauses == [4.0, 3.0, 1.0, 0.0]  # (what is left of the 10 s, when less than the pause)


def test_an_attempt_told_it_is_not_the_last_is_followed_by_another():
    """The deadline is read once an attempt: `last` said False, the loop goes on even if the clock
    passes the deadline before the next step (else a caller that raises on the last attempt would
    fall out of the loop without raising)."""
    now = [0.0]
    told = []

    def body(attempt):
        told.append(attempt.last)
        now[0] += 0.6

    assert collect(Attempts(within=1.0, pause=0.0, clock=lambda: now[0]), body) == [1, 2, 3]
    assert told == [False, False, True]


def test_a_backoff_grows_to_its_most():
    assert [Backoff(0.05, 1.0).after(n) for n in range(1, 7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]


def test_a_stop_ends_the_loop_during_its_pause():
    async def go():
        stop = asyncio.Event()
        seen = []

        async def looking():
            async for attempt in Attempts(pause=3600.0, stop=stop):
                seen.append(attempt.number)

        task = asyncio.ensure_future(looking())
        while not seen:
            await asyncio.sleep(0)
        stop.set()
        await asyncio.wait_for(task, 10.0)  # (an hour's pause: it ended because of the stop)
        return seen, Attempts(stop=stop)

    seen, after = asyncio.run(go())
    assert seen == [1]
    assert collect(after) == []  # a stop already set: no attempt at all


def test_a_cancellation_turned_into_an_error_still_ends_the_loop():
    """A call that answers its task's cancellation with an error of its own (as a stream closed under
    a cancelled call does) must not make the loop try again for ever."""

    async def go():
        calls = []

        async def swallowing_call():
            calls.append(1)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                raise ConnectionError("the stream closed") from None

        async def loop():
            async for attempt in Attempts(pause=0.0):
                try:
                    await swallowing_call()
                except ConnectionError as e:
                    attempt.failed(e)

        task = asyncio.ensure_future(loop())
        while not calls:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10.0)
        return calls

    assert asyncio.run(go()) == [1]


def test_failures_are_said_once_then_once_a_period(caplog):
    now = [0.0]
    attempts = Attempts("s0f0: ban to s1b0", tries=5, pause=0.0, log_every=30.0, clock=lambda: now[0])

    def body(attempt):
        attempt.failed(ConnectionError("no route"))
        now[0] += 10.0

    with caplog.at_level(logging.INFO, logger="hivepipe.retry"):
        collect(attempts, body)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert said == [  # at 0 and 30 s of the clock, of the failures at 0, 10, 20, 30 and 40 s
        "s0f0: ban to s1b0: ConnectionError('no route') (1 failed so far); trying again",
        "s0f0: ban to s1b0: ConnectionError('no route') (4 failed so far); trying again",
    ]
