"""A backward server's data path (parameter_server/backward.py) as a part on its own, with a real
task pool and fake checks: outputs kept in its ledger and sent on, evenly segmented, once their
micro-batch is whole; a backward task for each ledger piece once its output gradient is here,
preferring the client of the forward pass; repeats counted as duplicates; misplaced pushes refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from core.layout import RunLayout
from core.protocol.wire import PayloadError
from parameter_server.backward import Backward
from parameter_server.datapath import DataPath
from parameter_server.place import ServerPlace
from taskpool import TaskPool

LAYOUT = RunLayout.even(2, 4, 2, 1)  # stage 1's frontal servers: s1f0, s1f1


def make(place=ServerPlace("s0b0", 0, "backward", 0, False)):
    dp = DataPath(seg=(0, 4), pool=TaskPool(clock=lambda: 0.0, default_timeout=60.0))
    sent, checked, added = [], [], []

    def deliver(device, method, meta, tensors):
        sent.append((device, method, meta, tensors[0].shape[0]))

    async def noop():
        return None

    outbox = SimpleNamespace(deliver=lambda *a: (deliver(*a), noop())[1], spawn=lambda coro: coro.close())
    checks = SimpleNamespace(
        rows_payload=lambda meta, tensors, what, kinds: (meta["batch"], meta["micro"], *meta["rows"]),
        answers_lease=lambda *args: None,
        server_of=lambda sender, stage, *roles: sender,
    )
    backward = Backward(
        place=place,
        rows=4,
        registry=SimpleNamespace(caller=lambda sender: None),
        checks=checks,
        arrivals=SimpleNamespace(note_contribution=lambda sender, t: sender == "peer-new"),
        leases=SimpleNamespace(add_task=added.append),
        outbox=outbox,
        counters={"output_duplicates": 0, "relay_duplicates": 0},
        dp=lambda: dp,
        layout=lambda: LAYOUT,
        replaying=lambda: False,
        check_outputs=lambda *work: checked.append(work[:5]),
    )
    return backward, dp, sent, checked, added


def outputs(backward, sender, rows, task="F3.1.0.0-4"):
    meta = {"batch": 3, "micro": 1, "rows": list(rows), "task": task, "frontal": "s0f0"}
    return asyncio.run(backward.on_push_outputs(meta, [torch.zeros(rows[1] - rows[0], 8, 2)], sender))


def test_outputs_are_sent_on_evenly_once_their_micro_batch_is_whole():
    backward, dp, sent, checked, _ = make()
    assert outputs(backward, "peer-a", (0, 1)) == {"result": "accepted"} and sent == []
    assert (
        outputs(backward, "peer-a", (0, 1)) == {"result": "duplicate"} and backward.counters["output_duplicates"] == 1
    )
    assert outputs(backward, "peer-new", (1, 4))["result"] == "accepted"
    assert [(d, m, meta["rows"], n) for d, m, meta, n in sent] == [
        ("s1f0", "push_inputs", [0, 2], 2),
        ("s1f1", "push_inputs", [2, 4], 2),
    ]
    assert [(e.client, e.rows) for e in dp.ledger[(3, 1)]] == [("peer-a", (0, 1)), ("peer-new", (1, 4))]
    assert checked == [("peer-new", 3, 1, 1, 4)]  # drawn for a check: the newcomer's


def test_a_backward_task_waits_for_its_output_gradient_and_prefers_the_forward_client():
    backward, dp, _, _, added = make()
    outputs(backward, "peer-a", (0, 2))
    outputs(backward, "peer-b", (2, 4))
    meta = {"batch": 3, "micro": 1, "rows": [0, 2]}
    asyncio.run(backward.on_push_output_grads(meta, [torch.zeros(2, 8, 2)], "peer-s1f0"))
    assert [(t.task_id, t.preferred_client) for t in added] == [("B3.1.0.0-2", "peer-a")]
    assert asyncio.run(backward.on_push_output_grads(meta, [torch.zeros(2, 8, 2)], "peer-s1f0")) == {
        "result": "duplicate"
    }
    asyncio.run(backward.on_push_output_grads(dict(meta, rows=[2, 4]), [torch.zeros(2, 8, 2)], "peer-s1f1"))
    assert [t.preferred_client for t in added] == ["peer-a", "peer-b"] and len(dp.ledger[(3, 1)]) == 2


def test_misplaced_pushes_are_refused():
    last, _, _, _, _ = make(ServerPlace("s1b0", 1, "backward", 0, True))
    with pytest.raises(PayloadError, match="not the last"):
        outputs(last, "peer-a", (0, 4))
    backward, dp, _, _, _ = make()
    with pytest.raises(PayloadError, match="not a frontal server of stage 0"):
        asyncio.run(
            backward.on_push_outputs(
                {"batch": 3, "micro": 1, "rows": [0, 4], "task": "F", "frontal": "s1f0"}, [], "peer-a"
            )
        )
    assert dp.buffers == {} and dp.ledger == {}
