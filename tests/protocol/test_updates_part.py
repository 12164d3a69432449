"""A server's parameter versions, gradient credits and steps (parameter_server/updates.py) as a part
on its own, with fake shards: a version not reached yet is waited for and served once a step makes
it, one no longer held is refused, bf16 runs send half the bytes; a push that does not fit the run
is refused before it is credited; a step waits while a ban holds the steps."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from core.protocol.wire import PayloadError
from parameter_server.datapath import DataPath
from parameter_server.place import ServerPlace
from parameter_server.updates import Updates
from taskpool import TaskPool


class Shard:
    names = ["w"]

    def __init__(self):
        self.version, self.snapshots, self.tokens, self.credited, self.steps = 2, {2: {"w": torch.ones(3)}}, {}, [], 0

    def params_at(self, v):
        return self.snapshots.get(v)

    def credit(self, **kw):
        self.credited.append(kw["batch"])
        return "credited", 1

    def ready_to_step(self):
        return bool(self.credited) and self.steps == 0

    def step(self, scale, total):
        self.steps += 1
        self.version += 1
        self.snapshots[self.version] = {"w": torch.full((3,), 2.0)}
        return self.version


def make(precision="fp32", last=True, held=False):
    shard = Shard()
    stepped = []
    updates = Updates(
        place=ServerPlace("s1f0", 1, "frontal", 0, last),
        peer_id="peer-s1f0",
        slot=0,
        micro_batches=2,
        precision=precision,
        rows=2,
        hosted={0: shard},
        registry=SimpleNamespace(caller=lambda sender: None),
        checks=SimpleNamespace(check_epoch=lambda meta, later_ok=False: None, answers_lease=lambda *a: None),
        directory=SimpleNamespace(is_server=lambda p: False),
        arrivals=SimpleNamespace(
            unusual_norm=lambda *a: False,
            unusual_direction=lambda *a: False,
            note_contribution=lambda *a, **k: False,
            forget_departed=lambda: None,
        ),
        pins=SimpleNamespace(steps_held=lambda: held, update_pins=lambda: None, checks_hold=lambda v: False),
        clipping=SimpleNamespace(
            announce_sums=lambda: None, clip_hold=lambda *a: False, clip_step=lambda *a: (1.0, None)
        ),
        copies=SimpleNamespace(behind=lambda *a: False, send=lambda slot: asyncio.sleep(0)),
        frontal=SimpleNamespace(maybe_start_batches=lambda: None, release_waiting=lambda: None),
        outbox=SimpleNamespace(spawn=lambda coro: coro.close()),
        deltas=lambda: None,
        dp=lambda: DataPath(seg=(0, 2), pool=TaskPool(clock=lambda: 0.0, default_timeout=60.0)),
        stage_servers=lambda: SimpleNamespace(hosts=("s1f0",)),
        epoch=lambda: 0,
        version=lambda: shard.version,
        replaying=lambda: False,
        check_push=lambda *a: None,
        back_input_grads=lambda *a: None,
    )
    updates.on_step.append(stepped.append)
    return updates, shard, stepped


def push(updates, meta, sender="peer-v"):
    return asyncio.run(updates.on_push_grads(meta, [torch.zeros(3)], sender))


def test_a_version_is_waited_for_until_a_step_makes_it():
    updates, _, stepped = make()
    answer, tensors = asyncio.run(_wait_then_step(updates))
    assert answer == {"names": ["w"], "version": 3} and torch.equal(tensors[0], torch.full((3,), 2.0))
    assert stepped == [3]


async def _wait_then_step(updates):
    later = asyncio.ensure_future(updates.on_get_params({"version": 3, "wait": 5.0}, [], "peer-v"))
    await asyncio.sleep(0)
    assert not later.done()
    await updates.on_push_grads({"batch": 2, "tasks": ["F2.0.1.0-2"], "loss_sum": 1.0, "leases": [None]}, [], "peer-v")
    return await asyncio.wait_for(later, 1.0)


def test_a_version_no_longer_held_is_refused_and_bf16_runs_send_half_the_bytes():
    updates, _, _ = make(precision="bf16")
    with pytest.raises(PayloadError, match="no longer held"):
        asyncio.run(updates.on_get_params({"version": 1, "wait": 0.0}, [], "peer-v"))
    _, tensors = asyncio.run(updates.on_get_params({"version": 2, "wait": 0.0}, [], "peer-v"))
    assert tensors[0].dtype == torch.bfloat16
    assert asyncio.run(updates.on_get_params({"version": 3, "wait": 0.0}, [], "peer-v")) == {
        "retry": True,
        "version": 2,
    }


@pytest.mark.parametrize(
    "meta, words",
    [
        ({"batch": 2, "tasks": [f"F2.0.1.{i}-{i + 1}" for i in range(5)], "loss_sum": 1.0}, "at most 4 rows"),
        ({"batch": 2, "tasks": ["F2.0.1.0-2", "F2.0.1.0-2"], "loss_sum": 1.0}, "names a task twice"),
        ({"batch": 3, "tasks": ["F2.0.1.0-2"], "loss_sum": 1.0}, "not of batch 3 of stage 1"),
        ({"batch": 2, "tasks": ["B2.0.1.0-2"], "loss_sum": 1.0}, "only forward tasks"),
        ({"batch": 2, "tasks": ["F2.0.1.0-2"]}, "must carry 'loss_sum'"),
    ],
)
def test_a_push_that_does_not_fit_the_run_is_refused_before_it_is_credited(meta, words):
    updates, shard, _ = make()
    with pytest.raises(PayloadError, match=words):
        push(updates, meta)
    assert shard.credited == []


def test_a_step_waits_while_a_ban_holds_the_steps():
    updates, shard, stepped = make(held=True)
    push(updates, {"batch": 2, "tasks": ["F2.0.1.0-2"], "loss_sum": 1.0, "leases": [None]})
    assert shard.credited == [2] and shard.version == 2 and stepped == []
