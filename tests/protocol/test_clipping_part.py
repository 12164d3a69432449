"""The gradient-norm round (parameter_server/clipping.py) as a part on its own: built with what it
reads of a server, no server around it. A run of 2 stages x 2 slots; the slot sums it is told and
the totals it computes, the hold of a step until every slot's sum is known, a rollback's stale sums,
and malformed `grad_norm` payloads refused without changing anything."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from core.protocol.wire import PayloadError
from parameter_server.clipping import Clipping
from parameter_server.outbox import Outbox


class Shard:
    """What the round reads of a hosted shard: its version, whether its batch is complete, the sum of
    squares of that batch's gradient, and the totals its steps used."""

    def __init__(self, version: int, sumsq: float, ready: bool = True):
        self.version, self.sumsq, self.ready, self.totals = version, sumsq, ready, {}

    def ready_to_step(self) -> bool:
        return self.ready

    def batch_sumsq(self) -> float:
        return self.sumsq


def make(clip=1.0, epoch=0, shard=None):
    layout = SimpleNamespace(
        stages=[SimpleNamespace(index=k, hosts=[f"s{k}f0", f"s{k}b0"], servers=[f"s{k}f0", f"s{k}b0"]) for k in (0, 1)]
    )
    state = {"epoch": epoch, "news": 0, "asked": []}
    hosted = {0: shard or Shard(3, 4.0)}

    async def call(device, method, meta):
        state["asked"].append((device, method, meta))
        return {"batch": meta["batch"], "epoch": state["epoch"], "sums": [], "total": None}, []

    outbox = Outbox("s0f0", layout=lambda: layout, epoch=lambda: state["epoch"], connector=lambda d: None)
    part = Clipping(
        clip,
        device_id="s0f0",
        stage=0,
        steps=10,
        layout=lambda: layout,
        epoch=lambda: state["epoch"],
        replaying=lambda: True,  # (nothing is sent: the round's own arithmetic only)
        hosted=lambda: hosted,
        replicas=lambda: {},
        outbox=outbox,
        call=call,
        on_news=lambda: state.__setitem__("news", state["news"] + 1),
    )
    return part, state, hosted


def test_a_step_waits_for_every_slots_sum_and_scales_by_the_runs_norm():
    part, state, hosted = make(clip=1.0)
    assert part.all_slots() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert part.clip_hold(0, hosted[0]) and part.run_total(3) is None  # only its own sum is known
    answer = asyncio.run(part.on_grad_norm({"batch": 3, "epoch": 0, "sums": [[0, 1, 5.0], [1, 0, 6.0]]}, [], "x"))
    assert answer["total"] is None and state["news"] == 1
    asyncio.run(part.on_grad_norm({"batch": 3, "epoch": 0, "sums": [[1, 1, 10.0]]}, [], "x"))
    assert not part.clip_hold(0, hosted[0]) and part.run_total(3) == 25.0
    scale, total = part.clip_step(0, hosted[0])
    assert total == 25.0 and math.isclose(scale, 1.0 / (5.0 + 1e-6)) and part.grad_norms == {3: 5.0}


def test_without_clipping_nothing_holds_and_nothing_scales():
    part, _, hosted = make(clip=None)
    assert not part.clip_hold(0, hosted[0]) and part.clip_step(0, hosted[0]) == (1.0, None)


def test_a_rollback_makes_the_sums_of_the_batches_it_undid_stale():
    part, state, hosted = make()
    asyncio.run(part.on_grad_norm({"batch": 3, "epoch": 0, "sums": [[0, 1, 5.0], [1, 0, 6.0], [1, 1, 10.0]]}, [], "x"))
    part.clip_hold(0, hosted[0])
    assert part.run_total(3) == 25.0
    state["epoch"] = 1
    part.forget_sums_from(2, 1)  # a ban's rollback to version 2, at epoch 1
    assert part.run_total(3) is None
    asyncio.run(part.on_grad_norm({"batch": 3, "epoch": 0, "sums": [[1, 1, 10.0]]}, [], "x"))  # late, of epoch 0
    assert part.slot_sums.get(3, {}) == {}


@pytest.mark.parametrize(
    "meta, words",
    [
        ({"batch": 3, "epoch": 0, "sums": [[0, 1, -1.0]]}, "sum of squares >= 0"),
        ({"batch": 3, "epoch": 0, "sums": [[0, 1, float("nan")]]}, "sum of squares >= 0"),
        ({"batch": 3, "epoch": 0, "sums": [[2, 0, 1.0]]}, "no slot 0 of stage 2"),
        ({"batch": 10, "epoch": 0, "sums": []}, "field 'batch' must be in 0..9"),
        ({"batch": 3, "epoch": -1, "sums": []}, "field 'epoch' must be >= 0"),
        ({"batch": 3, "epoch": 0, "sums": [[0, 0, 1.0]] * 5}, "holds 5 sums"),
        ({"batch": 3, "epoch": 0, "sums": [], "total": "x"}, "field 'total'"),
    ],
)
def test_a_malformed_grad_norm_is_refused_and_changes_nothing(meta, words):
    part, state, _ = make()
    with pytest.raises(PayloadError, match=words):
        asyncio.run(part.on_grad_norm(meta, [], "x"))
    assert part.slot_sums == {} and part.heard_totals == {} and state["news"] == 0
