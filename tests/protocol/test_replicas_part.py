"""A server's replicas of its stage's shards (parameter_server/replicas.py) as a part on its own, with
fake shards: the ring (each server copies to the next in shard order), a step held while the copy is
more than REPLICA_LAG behind and a catch-up sent, a layout epoch starting a new round, a push kept
for a replica step by reference only while it is the batch's one push, and bad copies refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from core.protocol import param_delta
from core.protocol.wire import PayloadError
from parameter_server.replicas import REPLICA_LAG, Replicas

STAGE = SimpleNamespace(servers=["s0f0", "s0b0", "s0b1"])


def make(device="s0b0", links=True):
    spawned, steps = [], []
    outbox = SimpleNamespace(spawn=lambda coro: (spawned.append(coro), coro.close()))
    directory = SimpleNamespace(peer_of=lambda d: f"peer-{d}")
    checks = SimpleNamespace(server_of=lambda sender, stage, *roles: sender[len("peer-") :])
    copies = Replicas(
        device_id=device,
        stage=0,
        compress="none",
        slots=3,
        new_shard=lambda slot: None,
        replicas={},
        outbox=outbox,
        directory=directory,
        checks=checks,
        counters={"replicas_received": 0, "replica_steps_by_reference": 0},
        stage_servers=lambda: STAGE,
        hosted=lambda: {1: SimpleNamespace(version=5)},
        epoch=lambda: 0,
        replaying=lambda: False,
        connector=lambda: (lambda d: None) if links else None,
        maybe_step=lambda: steps.append(True),
    )
    return copies, spawned, steps


def test_each_server_copies_to_the_next_in_shard_order():
    assert [make(d)[0].buddy() for d in STAGE.servers] == ["s0b0", "s0b1", "s0f0"]


def test_a_step_waits_while_the_copy_is_more_than_the_lag_behind():
    copies, spawned, steps = make()
    assert copies.behind(1, 5) and len(spawned) == 1  # no copy taken yet: a catch-up is sent
    assert copies.behind(1, 5) and len(spawned) == 1  # (one catch-up at a time)
    copies._replica_taken(1, "s0b1", 5 - (REPLICA_LAG - 1))
    assert steps == [True] and not copies.behind(1, 5) and copies.behind(1, 6)
    copies.new_epoch()  # the ring may have changed: nothing counts as taken
    assert copies.acked == {} and copies.round == 1
    assert not make(links=False)[0].behind(1, 5)  # no links to the others: nothing to wait for


def test_a_push_is_kept_for_a_step_by_reference_only_while_it_is_the_batchs_one_push():
    copies, _, _ = make()
    grads = [torch.ones(3)]
    copies.note_own_push(0, 7, grads)
    meta = {"version": 8, "names": ["w"], "grad_digest": param_delta.digest(["w"], grads)}
    assert copies._own_push(0, meta) == grads
    assert copies._own_push(0, dict(meta, grad_digest="other")) is None
    copies.note_own_push(0, 7, grads)  # a second push of the same batch: the host's sum is another one
    assert copies._own_push(0, meta) is None
    copies.note_own_push(0, 12, grads)
    assert (0, 7) not in copies.own_pushes  # old batches forgotten


@pytest.mark.parametrize(
    "meta, words",
    [
        ({"slot": 1, "form": "state"}, "not another server's slot"),  # hosted here
        ({"slot": 3, "form": "state"}, "not another server's slot"),
        ({"slot": 0, "form": "step", "version": 3}, "no replica of slot 0 here"),
    ],
)
def test_bad_copies_are_refused(meta, words):
    copies, _, _ = make()
    with pytest.raises(PayloadError, match=words):
        asyncio.run(copies.on_push_replica(meta, [], "peer-s0f0"))
    assert copies.replicas == {} and copies.counters["replicas_received"] == 0


def test_a_version_of_a_replica_is_waited_for_until_its_step_comes():
    copies, _, _ = make()
    replica = SimpleNamespace(version=3, snapshots={3: {"w": torch.zeros(1)}}, digest=lambda v: f"d{v}")
    copies.replicas[0] = replica

    async def go():
        later = asyncio.ensure_future(copies.replica_at(0, 4, timeout=5.0))
        await asyncio.sleep(0)  # (one turn of the loop: the call runs to its wait on the replica's event)
        assert not later.done()
        replica.version, replica.snapshots[4] = 4, {"w": torch.ones(1)}
        copies.event.set()
        return await later

    assert asyncio.run(go())[0] == "d4"
    assert asyncio.run(copies.replica_at(0, 2, timeout=0.0)) is None  # older than what it holds
    assert asyncio.run(copies.replica_at(2, 2, timeout=0.0)) is None  # no replica of slot 2 here
