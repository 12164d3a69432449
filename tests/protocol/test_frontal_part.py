"""A frontal server's data path (parameter_server/frontal.py) as a part on its own, with a real task
pool and the embedded corpus: stage 0 builds batch t only once version t - 1 is here, two batches in
flight at most; a later stage's inputs wait for their version before their tasks are cut, its labels
come from the run's data; input gradients are relayed to the previous stage's backward servers that
hold their rows; rows not held are refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from core.layout import RunLayout
from core.model.data import load_corpus, make_batch
from core.protocol.wire import PayloadError
from parameter_server.datapath import DataPath
from parameter_server.frontal import Frontal
from parameter_server.place import ServerPlace
from taskpool import TaskPool

LAYOUT = RunLayout.even(2, 4, 1, 2)  # stage 0's backward servers: s0b0, s0b1
CORPUS = load_corpus(seq_len=8)


def make(place, version=0):
    dp = DataPath(seg=(0, 4), pool=TaskPool(clock=lambda: 0.0, default_timeout=60.0))
    state = {"version": version, "added": [], "sent": []}

    async def noop():
        return None

    def deliver(device, method, meta, tensors):
        state["sent"].append((device, meta["rows"], tensors[0].shape[0]))
        return noop()

    frontal = Frontal(
        place=place,
        peer_id="peer-" + place.device_id,
        steps=10,
        micro_batches=2,
        seed=0,
        batch_size=8,
        rows=4,
        seq=8,
        corpus=CORPUS,
        min_task_rows=4,
        min_client_rows=4,
        local_first=True,
        clients={},
        registry=SimpleNamespace(caller=lambda sender: None),
        checks=SimpleNamespace(
            server_of=lambda sender, stage, *roles: sender,
            rows_payload=lambda meta, tensors, what, kinds: (meta["batch"], meta["micro"], *meta["rows"]),
            batch_micro=lambda meta: (meta["batch"], meta["micro"]),
            answers_lease=lambda *args, **kw: None,
        ),
        arrivals=SimpleNamespace(note_work=lambda sender, t: None),
        leases=SimpleNamespace(add_task=lambda task: state["added"].append(task)),
        directory=SimpleNamespace(devices={}),
        outbox=SimpleNamespace(deliver=deliver, spawn=lambda coro: coro.close()),
        counters={"relay_duplicates": 0},
        dp=lambda: dp,
        layout=lambda: LAYOUT,
        version=lambda: state["version"],
        replaying=lambda: False,
    )
    return frontal, dp, state


def test_stage_0_builds_a_batch_once_its_version_is_here_two_in_flight_at_most():
    frontal, dp, state = make(ServerPlace("s0f0", 0, "frontal", 0, False))
    frontal.maybe_start_batches()
    assert dp.next_batch == 2 and sorted({t.batch for t in state["added"]}) == [0, 1]  # batch 1 computes on version 0
    assert len(state["added"]) == 4  # a task a micro-batch: 4 rows each, min_task_rows 4
    inputs, labels = make_batch(CORPUS, 0, 1, 8, 8)
    x, y = dp.buffers[(1, 1)].slice(0, 4)
    assert torch.equal(x, inputs[4:8]) and torch.equal(y, labels[4:8])
    state["version"] = 1
    frontal.maybe_start_batches()
    assert dp.next_batch == 3


def test_a_later_stages_inputs_wait_for_their_version_and_its_labels_come_from_the_run():
    frontal, dp, state = make(ServerPlace("s1f0", 1, "frontal", 0, True), version=0)
    meta = {"batch": 2, "micro": 0, "rows": [0, 4]}
    assert asyncio.run(frontal.on_push_inputs(meta, [torch.zeros(4, 8, 3)], "peer-s0b0")) == {"result": "accepted"}
    assert state["added"] == [] and dp.waiting_inputs == [(2, 0)]  # batch 2 computes on version 1
    assert asyncio.run(frontal.on_push_inputs(meta, [torch.zeros(4, 8, 3)], "peer-s0b0")) == {"result": "duplicate"}
    state["version"] = 1
    frontal.release_waiting()
    assert [t.batch for t in state["added"]] == [2] and dp.waiting_inputs == []
    assert torch.equal(dp.buffers[(2, 0)].slice(0, 4)[1], make_batch(CORPUS, 0, 2, 8, 8)[1][0:4])


def test_input_gradients_go_to_the_backward_servers_that_hold_their_rows():
    frontal, dp, state = make(ServerPlace("s1f0", 1, "frontal", 0, True))
    meta = {"batch": 2, "micro": 1, "rows": [1, 4], "task": "F2.1.1.1-4"}
    answer = asyncio.run(frontal.on_push_input_grads(meta, [torch.ones(3, 8, 3)], "peer-v"))
    assert answer == {"result": "accepted", "task": "F2.1.1.1-4"} and dp.gin_senders == {(2, 1, 1, 4): "peer-v"}
    assert state["sent"] == [("s0b0", [1, 2], 1), ("s0b1", [2, 4], 2)]  # 4 rows: 0-1 at s0b0, 2-3 at s0b1


def test_rows_not_held_are_refused_and_misplaced_pushes_too():
    frontal, _, _ = make(ServerPlace("s0f0", 0, "frontal", 0, False))
    with pytest.raises(PayloadError, match="not held here"):
        asyncio.run(frontal.on_get_inputs({"batch": 0, "micro": 0, "rows": [0, 2]}, [], "peer-v"))
    with pytest.raises(PayloadError, match="stage > 0"):
        asyncio.run(frontal.on_push_inputs({"batch": 0, "micro": 0, "rows": [0, 4]}, [], "peer-s0b0"))
