"""A server's take, complete and fail (parameter_server/leases.py) as a part on its own, with a real
task pool, client registry and lease tickets: a take answers a forward task with its rows and a
ticket, a waiting take is woken by a new task, a task is completed only by a holder of its lease, a
completion carried by a take counts, and unknown ids are refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from core.protocol.leases import LeaseTickets
from core.protocol.tasks import task_id
from core.protocol.wire import PayloadError
from parameter_server.clients import ClientInfo
from parameter_server.contributions import Contributions
from parameter_server.datapath import DataPath
from parameter_server.leases import NOT_HELD, Leases
from parameter_server.ledger import RowBuffer
from taskpool import Task, TaskKind, TaskPool

TICKETS = LeaseTickets(b"a test's lease key, 32 bytes ok!")


def make():
    pool = TaskPool(clock=lambda: 0.0, default_timeout=60.0)
    clients = {p: ClientInfo(p[-2:], 1.0, 0.0) for p in ("peer-v1", "peer-v2")}
    registry = SimpleNamespace(clients=clients, caller=lambda sender: clients[sender])
    buf = RowBuffer(0, 4)
    buf.add(0, 4, torch.arange(8.0).reshape(4, 2), torch.ones(4, dtype=torch.int64))
    dp = DataPath(seg=(0, 4), pool=pool, buffers={(3, 0): buf})
    leases = Leases(
        device_id="s0f0",
        peer_id="peer-s0f0",
        stage=0,
        last=False,
        micro_batches=2,
        clock=lambda: 0.0,
        lease_tickets=TICKETS,
        registry=registry,
        bans=SimpleNamespace(banned={}),
        directory=SimpleNamespace(run_min_version=lambda: 0),
        checks=SimpleNamespace(check_epoch=lambda meta: None),
        contributions=Contributions(),
        counters={},
        tasks_by_device={},
        epoch=lambda: 0,
        version=lambda: 2,
        dp=lambda: dp,
        log=lambda: None,
        replaying=lambda: False,
    )
    return leases, pool, dp.issued


def forward(rows=(0, 4)):
    return Task(
        task_id=task_id(TaskKind.FORWARD, 3, 0, 0, rows),
        kind=TaskKind.FORWARD,
        batch=3,
        micro_batch=0,
        stage=0,
        rows=rows,
    )


def test_a_take_answers_a_forward_task_with_its_rows_and_a_ticket():
    leases, _, issued = make()
    leases.add_task(forward((1, 3)))
    meta, tensors = asyncio.run(leases.on_take({}, [], "peer-v1"))
    assert meta["task"] in issued and (meta["batch"], meta["micro"], meta["rows"], meta["version"]) == (3, 0, [1, 3], 2)
    assert TICKETS.check(meta["lease"], meta["task"], "peer-v1", 0) == meta["attempt"]
    assert len(tensors) == 1 and torch.equal(
        tensors[0], torch.arange(2.0, 6.0).reshape(2, 2)
    )  # no labels before the last stage
    assert asyncio.run(leases.on_take({}, [], "peer-v2"))["task"] is None  # nothing queued: no tensors


def test_a_waiting_take_is_woken_by_a_new_task():
    leases, _, _ = make()

    async def go():
        take = asyncio.ensure_future(leases.on_take({"wait": 5.0}, [], "peer-v1"))
        await asyncio.sleep(0)
        assert not take.done()
        leases.add_task(forward())
        return await asyncio.wait_for(take, 1.0)

    meta, _ = asyncio.run(go())
    assert meta["task"] == forward().task_id


def test_only_a_holder_of_its_lease_completes_a_task():
    leases, pool, _ = make()
    leases.add_task(forward())
    tid = asyncio.run(leases.on_take({}, [], "peer-v1"))[0]["task"]
    assert asyncio.run(leases.on_complete({"task": tid}, [], "peer-v2")) == {"result": NOT_HELD}
    assert not pool.is_done(tid) and leases.counters["completes_not_held"] == 1
    asyncio.run(leases.on_take({"complete": [tid]}, [], "peer-v1"))  # handed in with its next take
    assert pool.is_done(tid) and leases.tasks_by_device == {"v1": 1}


def test_unknown_ids_are_refused_and_change_nothing():
    leases, pool, _ = make()
    leases.add_task(forward())
    with pytest.raises(PayloadError, match="unknown task id"):
        asyncio.run(leases.on_complete({"task": "F9.0.0.0-4"}, [], "peer-v1"))
    with pytest.raises(PayloadError, match="1 to"):
        asyncio.run(leases.on_complete({"tasks": []}, [], "peer-v1"))
    with pytest.raises(PayloadError, match="unknown task id"):
        asyncio.run(leases.on_fail({"task": "F9.0.0.0-4"}, [], "peer-v1"))
    assert pool.queued() == 1
