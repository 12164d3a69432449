"""A server's bans (parameter_server/bans.py) as a part on its own, with fake servers behind `call`:
a ban here drops the volunteer and re-queues its leases; a check that catches a liar holds the steps
and reports it to the run's coordinator; the coordinator bans it on every server and makes the
rollback epoch from their answers; a ban heard of and never ordered is ordered by the next
coordinator; reports to a server that does not coordinate, or of a server, are refused."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from core.protocol.wire import PayloadError
from parameter_server.arrivals import Arrivals
from parameter_server.bans import Bans
from parameter_server.outbox import Outbox

SERVERS = ["s0f0", "s0b0", "s1f0"]


class Pool:
    def __init__(self):
        self.left = []

    def client_left(self, peer):
        self.left.append(peer)
        return ["F1.0.0.0-4"]


def make(device="s0f0", answers=None, steps=40, versions=(12,), kept_from=0, memory_from=0):
    layout = SimpleNamespace(
        stages=[SimpleNamespace(servers=SERVERS[:2]), SimpleNamespace(servers=SERVERS[2:])], to_dict=lambda: {}
    )
    state = {"calls": [], "epochs": [], "adopted": [], "held": 0, "record": None}
    banned, clients = {}, {"liar": object(), "honest": object()}
    shards = [
        SimpleNamespace(version=v, kept_from=lambda: kept_from, memory_from=lambda: memory_from) for v in versions
    ]

    async def call(to, method, meta):
        state["calls"].append((to, method, dict(meta)))
        return (answers or {}).get(to, {"first_batch": -1, "versions": list(versions), "kept_from": kept_from}), []

    async def send_epoch(record, devices):
        state["epochs"].append((record, list(devices)))

    def adopt(record):
        state["adopted"].append(record)
        state["record"] = record
        return True

    arrivals = Arrivals(
        verify_rate=0.0,
        probation=0,
        rng=random.Random(0),
        drift=None,
        counts={},
        banned=banned,
        clients=clients,
        is_server=lambda p: p.startswith("peer-s"),
        replaying=lambda: False,
        kept_from=lambda: 0,
    )
    pool = Pool()
    bans = Bans(
        device_id=device,
        banned=banned,
        clients=clients,
        pool=lambda: pool,
        counts={"caught": 0},
        arrivals=arrivals,
        pins=SimpleNamespace(hold_for_ban=lambda: state.__setitem__("held", state["held"] + 1)),
        outbox=Outbox(device, layout=lambda: layout, epoch=lambda: 0, connector=lambda d: None),
        call=call,
        layout=lambda: layout,
        epoch=lambda: 3,
        epoch_record=lambda: state["record"],
        shards=lambda: shards,
        replaying=lambda: False,
        is_server=lambda p: p.startswith("peer-s"),
        steps=steps,
        send_epoch=send_epoch,
        adopt=adopt,
    )
    return bans, state, pool, clients, arrivals


def test_a_ban_here_drops_the_volunteer_and_requeues_its_leases_once():
    bans, _, pool, clients, arrivals = make()
    bans.ban_here("liar", "re-run 0.5 off")
    bans.ban_here("liar", "again")
    assert bans.banned == {"liar": "re-run 0.5 off"} and "liar" not in clients and pool.left == ["liar"]
    with pytest.raises(PayloadError):
        arrivals.refuse_banned("liar")  # the same bans, read by the arrivals part


def test_a_caught_liar_holds_the_steps_and_is_reported_to_the_coordinator():
    bans, state, _, _, _ = make(device="s1f0")

    async def go():
        bans.caught("liar", "outputs of batch 4 are 0.3 from this server's re-run")
        await asyncio.gather(*bans.outbox.background)

    asyncio.run(go())
    assert bans.counts["caught"] == 1 and state["held"] == 1 and bans.pending == {"liar": bans.banned["liar"]}
    assert state["calls"] == [("s0f0", "report_cheat", {"peer": "liar", "why": bans.banned["liar"]})]


def test_the_coordinator_rolls_back_to_the_liars_first_batch_from_every_servers_answer():
    answers = {
        "s0f0": {"first_batch": 6, "versions": [12], "kept_from": 2, "memory_from": 2},
        "s0b0": {"first_batch": 5, "versions": [12], "kept_from": 3, "memory_from": 3},
        "s1f0": {"first_batch": -1, "versions": [11], "kept_from": 1, "memory_from": 1},
    }
    bans, state, _, _, _ = make(answers=answers)
    record = asyncio.run(bans.ban_and_roll_back("liar", "caught"))
    assert [c[:2] for c in state["calls"]] == [(d, "ban") for d in SERVERS]
    assert record["epoch"] == 4 and record["banned"] == ["liar"] and record["rollback_to"] == 5
    assert record["from_batch"] == 5 and state["epochs"][0][1] == SERVERS and state["adopted"] == [record]
    assert asyncio.run(bans.ban_and_roll_back("liar", "again")) is None  # ordered by that epoch already


def test_a_ban_that_never_got_its_epoch_is_ordered_by_the_coordinator():
    bans, state, _, _, _ = make()
    answer = asyncio.run(bans.on_ban({"peer": "liar", "why": "told by a coordinator now gone"}, [], "peer-s1f0"))
    assert answer["first_batch"] == -1 and bans.pending == {"liar": "told by a coordinator now gone"}

    async def go():
        bans.order_pending()
        await asyncio.gather(*bans.outbox.background)

    asyncio.run(go())
    assert state["adopted"] and "liar" in state["adopted"][0]["banned"] and "rollback_to" not in state["adopted"][0]
    bans.order_pending()
    assert bans.pending == {}


def test_reports_to_a_server_that_does_not_coordinate_or_of_a_server_are_refused():
    other, _, _, _, _ = make(device="s0b0")
    with pytest.raises(PayloadError, match="does not coordinate"):
        asyncio.run(other.on_report_cheat({"peer": "liar", "why": "x"}, [], "peer-s1f0"))
    coordinator, _, _, _, _ = make()
    with pytest.raises(PayloadError, match="servers are trusted"):
        asyncio.run(coordinator.on_report_cheat({"peer": "peer-s0b0", "why": "x"}, [], "peer-s1f0"))
    with pytest.raises(PayloadError, match="peer"):
        asyncio.run(coordinator.on_report_cheat({"why": "x"}, [], "peer-s1f0"))
    assert coordinator.banned == {}
