"""The holds and pins (parameter_server/pins.py) as a part on its own, on an injected clock: a ban's
hold and its end, a step held for a check of work a rollback must still reach, the pin said to every
other server when it changes and applied to every shard kept here, and other servers' pins ordered by
their sequence numbers, forgotten when not said again, malformed ones refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from core.model.update_rule import version_for_batch
from core.protocol.wire import PayloadError
from parameter_server.outbox import Outbox
from parameter_server.pins import CHECK_HOLD_SECONDS, HOLD_SECONDS, PIN_EXPIRY, Pins
from parameter_server.updates import RETAIN


def make():
    layout = SimpleNamespace(stages=[SimpleNamespace(servers=["s0f0", "s0b0"]), SimpleNamespace(servers=["s1f0"])])
    state = {"now": 100.0, "pending": {}, "unsettled": None, "sent": []}
    shards = [SimpleNamespace(pinned_from=None), SimpleNamespace(pinned_from=None)]

    async def call(device, method, meta):
        state["sent"].append((device, method, dict(meta)))
        return {"ok": True}, []

    pins = Pins(
        device_id="s0f0",
        peer_id="peer-s0f0",
        clock=lambda: state["now"],
        layout=lambda: layout,
        shards=lambda: shards,
        checks_pending=lambda: state["pending"],
        unsettled=lambda: state["unsettled"],
        counts={},
        call=call,
        outbox=Outbox("s0f0", layout=lambda: layout, epoch=lambda: 0, connector=lambda d: None),
        steps=20,
    )
    return pins, state, shards


def test_a_bans_hold_lasts_until_its_epoch_or_hold_seconds():
    pins, state, _ = make()
    assert not pins.steps_held() and not pins.held_or_waiting
    pins.hold_for_ban()
    assert pins.steps_held()
    pins.release()
    assert not pins.steps_held()
    pins.hold_for_ban()
    state["now"] += HOLD_SECONDS
    assert pins.held_or_waiting and not pins.steps_held() and pins.hold_steps_until is None


def test_a_step_waits_for_a_check_of_work_a_rollback_must_reach_at_most_check_hold_seconds():
    pins, state, _ = make()
    version = 10
    reach = version + 2 - RETAIN
    state["pending"] = {t: 1 for t in range(12) if version_for_batch(t) >= reach}  # all within reach
    assert not pins.checks_hold(version)
    early = next(t for t in range(12) if version_for_batch(t) < reach)
    state["pending"][early] = 1
    assert pins.checks_hold(version) and pins.counts == {"steps_held_for_checks": 1} and pins.held_or_waiting
    state["now"] += CHECK_HOLD_SECONDS
    assert not pins.checks_hold(version)  # (bounded: a check stuck on a lost server's answers)


def test_the_runs_last_version_waits_for_every_check():
    """A check of work well within a rollback's reach holds no step, except the run's last (version
    20 here, made from 19): the run's end is a ban's last chance."""
    pins, state, _ = make()
    state["pending"] = {18: 1}
    assert not pins.checks_hold(18)  # (version 19: a ban from that check still reaches batch 18)
    assert pins.checks_hold(19) and pins.counts == {"steps_held_for_checks": 1}
    state["pending"] = {}
    assert not pins.checks_hold(19)


def test_the_pin_goes_to_every_other_server_when_it_changes_and_keeps_every_shard_here():
    pins, state, shards = make()

    async def scenario():
        state["unsettled"] = 4
        pins.update_pins()
        await asyncio.gather(*pins.outbox.background)
        pins.update_pins()  # unchanged, said within PIN_REFRESH: not sent again
        await asyncio.gather(*pins.outbox.background)
        state["unsettled"] = None
        pins.update_pins()
        await asyncio.gather(*pins.outbox.background)

    asyncio.run(scenario())
    assert [(d, m["batch"], m["seq"]) for d, _, m in state["sent"]] == [
        ("s0b0", 4, 1),
        ("s1f0", 4, 1),
        ("s0b0", -1, 2),
        ("s1f0", -1, 2),
    ]
    assert all(s.pinned_from is None for s in shards)  # (its own pin cleared, none heard)


def test_other_servers_pins_follow_their_sequence_and_are_forgotten_unsaid():
    pins, state, shards = make()
    asyncio.run(pins.on_pin({"batch": 6, "seq": 2}, [], "peer-s1f0"))
    asyncio.run(pins.on_pin({"batch": 3, "seq": 1}, [], "peer-s1f0"))  # older, arrived late: refused
    assert pins.asked == {"peer-s1f0": 6} and all(s.pinned_from == version_for_batch(6) for s in shards)
    with pytest.raises(PayloadError, match="field 'batch'"):
        asyncio.run(pins.on_pin({"batch": -2, "seq": 3}, [], "peer-s1f0"))
    assert pins.asked == {"peer-s1f0": 6}
    state["now"] += PIN_EXPIRY + 1

    async def later():
        pins.update_pins()
        await asyncio.gather(*pins.outbox.background)

    asyncio.run(later())
    assert pins.asked == {} and all(s.pinned_from is None for s in shards)
