"""A peer that cannot reach a server logs one line when it starts failing, one a minute while it
goes on (with a count), and one when it recovers; dialling backs off. Time is injected."""
from __future__ import annotations

import logging

from peer.node import LinkHealth


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_one_line_to_start_one_a_minute_one_to_recover(caplog):
    clock = Clock()
    h = LinkHealth("s0f0 (abcdefgh)", clock=clock)
    caplog.set_level(logging.WARNING, logger="hivepipe.node")
    h.failed(ConnectionError("closed"))  # a single cut call: not yet a problem
    assert caplog.records == [] and h.backing_off() == 0
    for _ in range(300):  # five minutes of a failed attempt every second
        clock.t += 1.0
        h.failed(ConnectionError("connection refused"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("cannot reach s0f0 (abcdefgh): connection refused")
    assert len(lines) == 1 + 4  # the first, then one per minute
    assert "still cannot reach s0f0 (abcdefgh) after 61 s (60 more failed attempts)" in lines[1]
    h.succeeded()
    assert caplog.records[-1].getMessage() == "reached s0f0 (abcdefgh) again after 300 s"
    assert h.backing_off() == 0
    h.succeeded()  # already fine: nothing more
    assert len(caplog.records) == 6


def test_backoff_doubles_to_a_cap():
    clock = Clock()
    h = LinkHealth("x", clock=clock, max_backoff=5.0)
    waits = []
    for _ in range(7):
        h.failed("refused")
        waits.append(h.backing_off())
    assert waits == [0.0, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
