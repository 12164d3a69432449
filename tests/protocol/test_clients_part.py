"""A server's registry of its clients (parameter_server/clients.py) as a part on its own, with a real
task pool and lease tickets on an injected clock: registration (its refusals by code and by name, new
clients admitted at a bounded rate), a lease adopted only when its ticket proves it, a caller that is
not registered, and the silent, disconnected and struck-out clients dropped with their leases back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from core.protocol.leases import LeaseTickets
from core.protocol.refusals import Refusal
from core.protocol.tasks import task_id
from core.protocol.wire import PayloadError
from parameter_server.clients import DISCONNECT_GRACE, REGISTER_BURST, Clients
from taskpool import Task, TaskKind, TaskPool

TICKETS = LeaseTickets(b"a test's lease key, 32 bytes ok!")


def make(allow=None):
    now = [100.0]
    pool = TaskPool(clock=lambda: now[0], default_timeout=60.0)
    servers = {"peer-s0b0"}
    registry = Clients(
        device_id="s0f0",
        peer_id="peer-s0f0",
        stage=0,
        rows=4,
        micro_batches=2,
        clock=lambda: now[0],
        client_timeout=3.0,
        volunteers_allow=allow,
        requeue=True,
        lease_tickets=TICKETS,
        directory=SimpleNamespace(is_server=lambda p: p in servers or p == "peer-s0f0"),
        counters={},
        pool=lambda: pool,
        version=lambda: 4,
        epoch=lambda: 0,
        replaying=lambda: False,
        run_over=lambda: False,
        complete_carried=lambda ids, sender: None,
        seen=64,
        clients={},
    )
    return registry, pool, now


def register(registry, peer, **meta):
    return asyncio.run(registry.on_register({"device": peer[-2:], "compute": 2.0, "stage": 0} | meta, [], peer))


def test_registration_answers_the_version_and_refuses_what_is_wrong():
    registry, _, _ = make(allow=frozenset({"peer-v1"}))
    assert register(registry, "peer-v1") == {"ok": True, "version": 4, "epoch": 0}
    assert registry.clients["peer-v1"].compute == 2.0
    for meta, words in [
        ({"compute": 0.0}, "positive"),
        ({"stage": 1}, "serves stage 0, not 1"),
        ({"holding": [1]}, "holding"),
    ]:
        with pytest.raises(PayloadError, match=words):
            register(registry, "peer-v1", **meta)
    with pytest.raises(PayloadError) as e:
        register(registry, "peer-v2")
    assert e.value.refusal == Refusal.NOT_ALLOWED and "peer-v2" not in registry.clients
    register(registry, "peer-s0b0")  # a server's worker is not on the list, and need not be


def test_new_clients_are_admitted_at_a_bounded_rate():
    registry, _, now = make()
    for i in range(REGISTER_BURST):
        register(registry, f"peer-v{i:02d}")
    with pytest.raises(PayloadError, match="too many new clients"):
        register(registry, "peer-late")
    register(registry, "peer-v00")  # one already known is not counted
    now[0] += 1.0
    register(registry, "peer-late")


def test_a_lease_is_adopted_only_with_its_ticket():
    registry, pool, _ = make()
    ids = [task_id(TaskKind.FORWARD, 4, m, 0, (0, 4)) for m in range(2)]
    for m, tid in enumerate(ids):
        pool.add(Task(task_id=tid, kind=TaskKind.FORWARD, batch=4, micro_batch=m, stage=0, rows=(0, 4)))
    proof = TICKETS.issue(ids[0], "peer-v1", 1, 0)
    register(registry, "peer-v1", holding=ids, leases=[proof, None])
    assert [lease.task.task_id for lease in pool.leases_of("peer-v1")] == [ids[0]]
    assert registry.counters == {"leases_adopted": 1, "holding_unproven": 1}


def test_a_caller_must_be_registered():
    registry, _, now = make()
    with pytest.raises(PayloadError) as e:
        registry.caller("peer-v1")
    assert e.value.refusal == Refusal.NOT_REGISTERED
    register(registry, "peer-v1")
    now[0] += 2.0
    assert registry.caller("peer-v1").last_seen == now[0]


def test_silent_and_disconnected_clients_are_dropped_with_their_leases_back():
    registry, pool, now = make()
    pool.add(Task(task_id="F4.0.0.0-4", kind=TaskKind.FORWARD, batch=4, micro_batch=0, stage=0, rows=(0, 4)))
    register(registry, "peer-v1")
    register(registry, "peer-v2")
    assert pool.take("peer-v1") is not None
    gone = []
    for _ in range(18):  # the server checks every 0.2 s (a longer gap is its own stall, not silence)
        gone += registry.drop_stale_clients()
        now[0] += 0.2
        registry.clients["peer-v2"].last_seen = now[0]
    assert gone == ["peer-v1"] and pool.leases_of("peer-v1") == []
    assert registry.drop_disconnected_clients(set()) == []  # first read without it
    now[0] += DISCONNECT_GRACE
    assert registry.drop_disconnected_clients(set()) == ["peer-v2"] and registry.clients == {}
    assert registry.counters == {"clients_timed_out": 1, "clients_disconnected": 1}
