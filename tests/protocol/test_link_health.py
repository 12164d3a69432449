"""A peer that cannot reach a server logs one line when it starts failing, one a minute while it
goes on (with a count), and one when it recovers; dialling backs off. Time is injected."""

from __future__ import annotations

import logging

from core.layout import halt_reason
from peer.directory import HaltNotice
from peer.server_links import LinkHealth


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


def test_new_addresses_are_dialled_at_once():
    """A restarted server announces a fresh port: its new addresses skip the backoff of the old ones,
    and fail into a backoff of their own."""
    clock = Clock()
    h = LinkHealth("x", clock=clock, max_backoff=5.0)
    old, new = ["/ip4/10.0.0.1/tcp/1000/p2p/Qm1"], ["/ip4/10.0.0.1/tcp/2000/p2p/Qm1"]
    for _ in range(5):
        h.failed("refused", addresses=old)
    assert h.backing_off(old) == 4.0 and h.backing_off() == 4.0
    assert h.backing_off(new) == 0.0
    h.failed("refused", addresses=new)
    assert h.backing_off(new) == 5.0 and h.backing_off(old) == 0.0
    h.failed("cut short", dial=False, addresses=old)  # not a dial: where it went says nothing
    assert h.backing_off(new) == 5.0
    h.succeeded()
    assert h.backing_off(old) == 0.0 and h.failed_addresses is None


def test_a_stopped_run_is_said_once_then_once_a_minute_then_once_when_it_goes_on(caplog):
    clock = Clock()
    halt = HaltNotice("v3", clock=clock)
    caplog.set_level(logging.WARNING, logger="hivepipe.node")
    halt.update(None)
    assert caplog.records == []
    reason = halt_reason([(1, "backward", ("s1b0",))])
    for _ in range(150):  # two and a half minutes, a look every second
        clock.t += 1.0
        halt.update(reason)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == ("ERROR", f"v3: {reason}")
    assert lines[1:] == [
        ("ERROR", f"v3: still stopped after 60 s: {reason}"),
        ("ERROR", f"v3: still stopped after 120 s: {reason}"),
    ]
    other = halt_reason([(0, "frontal", ("s0f0",)), (1, "backward", ("s1b0",))])
    clock.t += 1.0
    halt.update(other)  # a different reason is said at once
    assert caplog.records[-1].getMessage() == f"v3: still stopped after 150 s: {other}"
    clock.t += 4.0
    halt.update(None)
    assert caplog.records[-1].getMessage() == "v3: the run goes on again after 154 s stopped"
    halt.update(None)
    assert len(caplog.records) == 5
    # a reader of others' records: a read that misses them is not yet the run going on
    reader = HaltNotice("v4", clock=clock, clear_after=3.0)
    reader.update(reason)
    clock.t += 2.0
    reader.update(None)
    clock.t += 0.5
    reader.update(reason)
    assert caplog.records[-1].getMessage() == f"v4: {reason}" and len(caplog.records) == 6
    for _ in range(4):
        clock.t += 1.0
        reader.update(None)
    assert caplog.records[-1].getMessage() == "v4: the run goes on again after 6 s stopped"
    assert len(caplog.records) == 7
    # ... or at once when a read shows the run past every version read while it was stopped
    reader.update(reason, progress=2)
    reader.update(reason, progress=3)  # an update in flight at the stop is applied meanwhile
    clock.t += 0.5
    reader.update(None, progress=3)
    assert len(caplog.records) == 8  # a read that misses the stop and shows no progress: not yet
    reader.update(None, progress=4)
    assert caplog.records[-1].getMessage() == "v4: the run goes on again after 0 s stopped"
    assert len(caplog.records) == 9
    # a version reached before the stop that the first read of the stop lagged behind is no progress
    reader.update(None, progress=7)  # (running: the servers are at 7)
    reader.update(reason, progress=5)  # a read of the stop that still shows older records
    reader.update(None, progress=7)
    assert len(caplog.records) == 10 and caplog.records[-1].getMessage() == f"v4: {reason}"
    reader.update(None, progress=8)
    assert caplog.records[-1].getMessage() == "v4: the run goes on again after 0 s stopped"
    assert halt_reason([]) is None
    assert "failover is off" in halt_reason([(0, "frontal", ("s0f0",))], failover=False)
