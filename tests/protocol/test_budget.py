"""The bytes of unanswered requests a server holds, bounded per peer and in all (parameter_server/budget.py):
one outsider holding many unfinished large requests open grew a server by a gigabyte."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto.runtime_pb2 import ExpertRequest

from core.protocol.wire import PayloadError, pack
from parameter_server.budget import RequestBudget
from tests.swarm.inprocess import InProcessSwarm, make_run

MiB = 1 << 20


def test_the_budget_counts_per_peer_and_in_all_and_refuses_past_either():
    budget = RequestBudget(per_peer=3 * MiB, total=5 * MiB)
    budget.take("peer-a", 2 * MiB)
    with pytest.raises(PayloadError, match="one peer may"):
        budget.take("peer-a", 2 * MiB)
    budget.take("peer-b", 3 * MiB)
    with pytest.raises(PayloadError, match="over its"):
        budget.take("peer-c", 1 * MiB)
    assert budget.held == {"peer-a": 2 * MiB, "peer-b": 3 * MiB} and budget.refused == 2
    budget.give("peer-a", 2 * MiB)
    budget.give("peer-b", 3 * MiB)
    assert budget.held == {} and budget.in_all == 0
    with pytest.raises(ValueError):
        RequestBudget(per_peer=2, total=1)


def test_a_peer_holding_unfinished_requests_open_is_refused_past_its_share_and_gets_it_back():
    """A registered stranger opens 16 push_grads requests of 2 MiB each and never sends their last
    message: past its share (here 5 MiB) each further request is answered with an error naming the
    limit, while the server holds at most that share of its bytes; once the stranger's streams end,
    what they held is given back, and another peer's request is served."""
    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    fs.surface.request_budget = RequestBudget(per_peer=5 * MiB, total=8 * MiB)
    messages = pack({"tasks": ["B0.0.0.0-4"], "batch": 0, "leases": [None]}, [torch.zeros(MiB // 2)], ExpertRequest)
    assert len(messages) >= 2
    hang = asyncio.Event()

    async def unfinished():
        for message in messages[:-1]:
            yield message
        await hang.wait()  # the last message never comes (until the stranger's streams end)

    async def answer_of(stream, peer):
        return [m async for m in fs.surface.serve("push_grads", stream, SimpleNamespace(remote_id=peer), ExpertRequest)]

    async def scenario():
        calls = [asyncio.ensure_future(answer_of(unfinished(), "peer-stranger")) for _ in range(16)]
        per_request = sum(m.ByteSize() for m in messages[:-1])
        while sum(c.done() for c in calls) + fs.surface.request_budget.in_all // per_request < len(calls):
            await asyncio.sleep(0)  # (until every call is refused or holds its bytes: no clock involved)
        refused = [c for c in calls if c.done()]
        held = fs.surface.request_budget.in_all
        hang.set()
        await asyncio.gather(*calls)
        return len(refused), refused[0].result() if refused else None, held

    n_refused, first, held = asyncio.run(scenario())
    per_request = sum(m.ByteSize() for m in messages[:-1])
    assert held <= 5 * MiB and n_refused == 16 - (5 * MiB) // per_request, (held, n_refused, per_request)
    assert "one peer may" in first[0].metadata.decode(errors="replace") if first else False
    assert fs.surface.request_budget.in_all == 0 and fs.surface.request_budget.held == {}


def test_a_volunteers_request_is_bounded_by_what_a_volunteer_sends_and_a_servers_by_its_replicas():
    """A peer that is not one of the run's servers sends no replica: a request of its past the
    stage's parameters in fp32 (plus 4 MiB) is refused while it arrives, naming the bound, and its
    budget is two such requests; the run's servers keep the bound sized for a replica (3x)."""
    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    stage_bytes = sum(t.numel() for t in fs.stage_params.values()) * 4
    rows_bytes = 2 * fs.rows * cfg.seq_len * max(cfg.hidden, cfg.vocab_size) * 4
    surface = fs.surface
    assert surface.max_client_request_bytes == max(stage_bytes, rows_bytes) + 4 * MiB
    assert surface.max_request_bytes == 3 * stage_bytes + rows_bytes + 16 * MiB > surface.max_client_request_bytes
    assert fs.surface.request_budget.per_peer == 2 * fs.surface.max_client_request_bytes
    assert fs.surface.request_limit("peer-stranger") == surface.max_client_request_bytes
    assert fs.surface.request_limit(fs.peer_id) == surface.max_request_bytes
    over = fs.surface.max_client_request_bytes // 4 + MiB  # float32 values: past a volunteer's bound, not a server's
    messages = pack({"tasks": ["B0.0.0.0-4"], "batch": 0, "leases": [None]}, [torch.zeros(over)], ExpertRequest)

    async def answer_of(peer):
        async def stream():
            for m in messages:
                yield m

        return [
            m async for m in fs.surface.serve("push_grads", stream(), SimpleNamespace(remote_id=peer), ExpertRequest)
        ]

    answer = asyncio.run(answer_of("peer-stranger"))
    assert f"payload exceeds {fs.surface.max_client_request_bytes} bytes" in answer[0].metadata.decode(errors="replace")
    assert fs.surface.request_budget.in_all == 0  # what it held is given back
