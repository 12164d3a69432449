"""The held-out evaluation (parameter_server/evaluate.py) as a part on its own: which server starts
evaluations, the activations it takes from the previous stage (and the malformed ones it refuses,
changing nothing), a version it waits for, and a rollback that drops what was said of undone versions."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from core.model.data import EVAL_ROWS
from core.protocol.wire import PayloadError
from parameter_server.evaluate import Evaluation
from parameter_server.outbox import Outbox
from parameter_server.place import ServerPlace

SEQ, HIDDEN = 4, 8


def make(place: ServerPlace, every: int = 2, version: int = 2):
    """A part of a 2-stage run whose `recompute` returns its input: the last stage's 'loss' is read
    of the input it was handed."""
    layout = SimpleNamespace(stages=[SimpleNamespace(frontal=["s0f0"]), SimpleNamespace(frontal=["s1f0"])])
    state = {"version": version, "event": asyncio.Event(), "ran": [], "waiting": asyncio.Event()}

    def step_event() -> asyncio.Event:  # (asked for only to wait on it)
        state["waiting"].set()
        return state["event"]

    async def recompute(v, fn):
        state["ran"].append(v)
        return torch.zeros(EVAL_ROWS, SEQ, 3)

    part = Evaluation(
        every,
        place=place,
        run=SimpleNamespace(steps=10, seed=0),
        cfg=SimpleNamespace(hidden=HIDDEN),
        corpus=None,
        seq=SEQ,
        epoch=lambda: 0,
        layout=lambda: layout,
        version=lambda: state["version"],
        step_event=step_event,
        replaying=lambda: False,
        recompute=recompute,
        device="cpu",
        connector=lambda d: None,
        outbox=Outbox(place.device_id, layout=lambda: layout, epoch=lambda: 0, connector=lambda d: None),
    )
    return part, state


def acts(rows=EVAL_ROWS, dtype=torch.float32, fill=0.0):
    return [torch.full((rows, SEQ, HIDDEN), fill, dtype=dtype)]


def test_only_stage_0s_first_frontal_server_starts_evaluations_and_only_when_evaluating():
    assert make(ServerPlace("s0f0", 0, "frontal", 0, False))[0].starts
    assert not make(ServerPlace("s0f0", 0, "frontal", 0, False), every=0)[0].starts
    assert not make(ServerPlace("s0b0", 0, "backward", 0, False))[0].starts
    assert not make(ServerPlace("s1f0", 1, "frontal", 0, True))[0].starts


@pytest.mark.parametrize(
    "place, meta, tensors, words",
    [
        (ServerPlace("s1f0", 1, "frontal", 0, True), {"version": 3}, acts(), "not one this run evaluates"),
        (ServerPlace("s1b0", 1, "backward", 0, True), {"version": 2}, acts(), "not a frontal server past stage 0"),
        (ServerPlace("s0f0", 0, "frontal", 0, False), {"version": 2}, acts(), "not a frontal server past stage 0"),
        (ServerPlace("s1f0", 1, "frontal", 0, True), {"version": 2}, [], "carries one tensor"),
        (ServerPlace("s1f0", 1, "frontal", 0, True), {"version": 2}, acts(rows=3), "finite float32"),
        (ServerPlace("s1f0", 1, "frontal", 0, True), {"version": 2}, acts(dtype=torch.float16), "finite float32"),
        (ServerPlace("s1f0", 1, "frontal", 0, True), {"version": 2}, acts(fill=float("nan")), "finite float32"),
    ],
)
def test_malformed_activations_are_refused_and_change_nothing(place, meta, tensors, words):
    part, state = make(place)
    with pytest.raises(PayloadError, match=words):
        asyncio.run(part.on_eval_forward(meta, tensors, "peer-s0f0"))
    assert part.evals_seen == set() and state["ran"] == []


def test_a_version_not_made_yet_is_waited_for_then_evaluated_once_and_a_rollback_forgets_it(monkeypatch):
    import parameter_server.evaluate as evaluate

    place = ServerPlace("s1f0", 1, "frontal", 0, True)
    part, state = make(place, version=1)
    labels = torch.zeros(EVAL_ROWS, SEQ, dtype=torch.long)
    monkeypatch.setattr(evaluate, "eval_windows", lambda corpus, seed, seq: (None, labels))
    monkeypatch.setattr(evaluate, "loss_sum", lambda out, y: torch.tensor(2.0 * y.numel()))
    said = []
    part.on_eval.append(lambda v, loss: said.append((v, loss)))

    async def scenario():
        call = asyncio.ensure_future(part.on_eval_forward({"version": 2}, acts(), "peer-s0f0"))
        await asyncio.wait_for(state["waiting"].wait(), 5)  # (version 2 is not made here yet)
        assert not call.done() and state["ran"] == []
        state["version"] = 2
        state["event"].set()
        assert await call == {"ok": True}
        assert await part.on_eval_forward({"version": 2}, acts(), "peer-s0f0") == {"ok": True, "duplicate": True}

    asyncio.run(scenario())
    assert state["ran"] == [2] and said == [(2, 2.0)] and part.eval_losses == {2: 2.0}
    part.forget_evals_from(1)
    assert part.eval_losses == {} and part.evals_seen == set()
