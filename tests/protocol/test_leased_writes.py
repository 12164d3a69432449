"""Every write is bound to a lease (core/protocol/leases.py, the method table's `leased` column): each
method that hands a server a task's result is refused, changing nothing, from an outsider, from a
registered stranger, and from a volunteer answering another's task, even one that shows the real
holder's ticket; the holder's own answer is accepted. Run through the servers' real handlers in one
event loop."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from core.protocol import methods
from core.protocol.wire import RemoteError
from peer.server_links import LocalLink
from tests.swarm.inprocess import TICKETS, InProcessSwarm, make_run


def _state(server) -> dict:
    """What a refused write must leave as it was."""
    pool = {k: v for k, v in server.pool.stats().items() if k != "oldest_queued_age"}  # (the clock's)
    return {
        "pool": copy.deepcopy(pool),
        "buffers": sorted(server.buffers),
        "grad_buffers": sorted(server.grad_buffers),
        "ledger": {k: len(v) for k, v in server.ledger.items()},
        "credits": {s: sorted(sh.batches) for s, sh in server.hosted.items()},
        "rows": {s: {b: dict(c.rows_done) for b, c in sh.batches.items()} for s, sh in server.hosted.items()},
    }


async def _refused(link, method, meta, tensors, server) -> str:
    before = _state(server)
    with pytest.raises(RemoteError) as e:
        answer, _ = await link.call(method, meta, tensors)
        if method == "complete" and answer.get("result") == "not_held":  # answered, and ignored
            raise RemoteError(f"{method}: not_held")
    assert _state(server) == before, (method, meta)
    return str(e.value)


def test_every_leased_method_refuses_all_but_the_holder_of_the_lease():
    assert methods.LEASED == {"complete", "push_grads", "push_input_grads", "push_outputs"}
    cfg, layout, run = make_run(stages=2, steps=3)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    st0, st1 = layout.stages
    fs0, bs0, fs1 = (swarm.servers[d] for d in (st0.frontal[0], st0.backward[0], st1.frontal[0]))
    holder, other = [w for w in swarm.workers if w.stage == 0]
    seq, hidden = cfg.seq_len, cfg.hidden
    said: dict[str, list[str]] = {}

    async def scenario():
        fs0.maybe_start_batches()
        await holder.member.register()
        await other.member.register()
        _, mine, _ = await holder.intake.take_one()
        _, theirs, _ = await other.intake.take_one()
        assert mine["task"] != theirs["task"] and mine["lease"] and theirs["lease"]
        stranger = LocalLink(bs0, "peer-stranger")
        await stranger.call("register", {"device": "stranger", "compute": 1.0, "stage": 0})
        await LocalLink(fs0, "peer-stranger").call("register", {"device": "stranger", "compute": 1.0, "stage": 0})
        outsider = {d: LocalLink(s, "peer-outsider") for d, s in swarm.servers.items()}
        as_other = {d: LocalLink(s, other.links[d].sender) for d, s in swarm.servers.items() if d in other.links}
        t, m, (a, b) = mine["batch"], mine["micro"], mine["rows"]

        # push_outputs: the outputs of a forward task, to the stage's backward server
        out = {"task": mine["task"], "batch": t, "micro": m, "rows": [a, b], "frontal": fs0.device_id}
        hid = [torch.zeros(b - a, seq, hidden)]
        said["push_outputs"] = [
            await _refused(outsider[bs0.device_id], "push_outputs", dict(out, lease=mine["lease"]), hid, bs0),
            await _refused(stranger, "push_outputs", dict(out), hid, bs0),
            await _refused(stranger, "push_outputs", dict(out, lease=mine["lease"]), hid, bs0),
            await _refused(as_other[bs0.device_id], "push_outputs", dict(out, lease=theirs["lease"]), hid, bs0),
            await _refused(as_other[bs0.device_id], "push_outputs", dict(out, lease=mine["lease"]), hid, bs0),
            # the holder itself, for rows its task does not cover
            await _refused(
                holder.links[bs0.device_id],
                "push_outputs",
                dict(out, task=theirs["task"], lease=mine["lease"]),
                hid,
                bs0,
            ),
        ]
        # complete: the pool's own record of who held the lease
        said["complete"] = [
            await _refused(outsider[fs0.device_id], "complete", {"task": mine["task"]}, [], fs0),
            await _refused(LocalLink(fs0, "peer-stranger"), "complete", {"task": mine["task"]}, [], fs0),
            await _refused(as_other[fs0.device_id], "complete", {"task": mine["task"]}, [], fs0),
        ]
        # push_grads of stage 0 (backward tasks), to every server of the stage: tickets as the backward
        # server would issue them to the holder; shown by someone else, or missing, they open nothing
        back = f"B{t}.{m}.0.{a}-{b}"
        ticket = TICKETS.issue(back, holder.links[fs0.device_id].sender, 1, 0)
        grads = [torch.zeros_like(fs0.shard.params[n]) for n in fs0.shard.names]
        push = {"tasks": [back], "batch": t, "slot": fs0.slot}
        said["push_grads"] = [
            await _refused(outsider[fs0.device_id], "push_grads", dict(push, leases=[ticket]), grads, fs0),
            await _refused(LocalLink(fs0, "peer-stranger"), "push_grads", dict(push), grads, fs0),
            await _refused(LocalLink(fs0, "peer-stranger"), "push_grads", dict(push, leases=[ticket]), grads, fs0),
            await _refused(as_other[fs0.device_id], "push_grads", dict(push, leases=[ticket]), grads, fs0),
        ]
        # push_input_grads of the last stage (a forward task there), to its frontal server
        last = f"F{t}.{m}.1.{a}-{b}"
        ticket1 = TICKETS.issue(last, "peer-u10", 1, 0)
        await LocalLink(fs1, "peer-stranger").call("register", {"device": "stranger", "compute": 1.0, "stage": 1})
        gin = {"task": last, "batch": t, "micro": m, "rows": [a, b]}
        g = [torch.zeros(b - a, seq, hidden)]
        said["push_input_grads"] = [
            await _refused(LocalLink(fs1, "peer-outsider"), "push_input_grads", dict(gin, lease=ticket1), g, fs1),
            await _refused(LocalLink(fs1, "peer-stranger"), "push_input_grads", dict(gin), g, fs1),
            await _refused(LocalLink(fs1, "peer-stranger"), "push_input_grads", dict(gin, lease=ticket1), g, fs1),
        ]
        # the holder's own answer is taken
        answer, _ = await holder.links[bs0.device_id].call("push_outputs", dict(out, lease=mine["lease"]), hid)
        assert answer["result"] == "accepted"
        answer, _ = await holder.links[fs0.device_id].call("complete", {"task": mine["task"]})
        assert answer["result"] == "accepted"

    asyncio.run(scenario())
    assert set(said) == methods.LEASED
    for method, answers in said.items():
        for answer in answers:
            assert any(
                w in answer
                for w in (
                    "not registered",
                    "no lease",
                    "one lease ticket per task",
                    "holds no lease",
                    "not_held",
                    "not the rows",
                    "not within",
                    "is not a forward task",
                )
            ), (method, answer)


def test_labels_come_from_the_runs_data_never_through_a_volunteer():
    """A stage-0 volunteer gets no labels and can hand none on: outputs with labels are refused even from
    the lease's holder, and the last stage's frontal server serves the labels of the run's own data."""
    from core.model.data import make_batch

    cfg, layout, run = make_run(stages=2, steps=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    st0, st1 = layout.stages
    fs0, bs0, fs1 = (swarm.servers[d] for d in (st0.frontal[0], st0.backward[0], st1.frontal[0]))
    first, last = swarm.workers

    async def scenario():
        fs0.maybe_start_batches()
        await first.member.register()
        link, meta, tensors = await first.intake.take_one()
        assert len(tensors) == 1  # the inputs only
        t, m, (a, b) = meta["batch"], meta["micro"], meta["rows"]
        out = {
            "task": meta["task"],
            "batch": t,
            "micro": m,
            "rows": [a, b],
            "frontal": fs0.device_id,
            "lease": meta["lease"],
        }
        forged = torch.zeros(b - a, cfg.seq_len, dtype=torch.int64)  # "every label is token 0"
        with pytest.raises(RemoteError, match=r"expects \[hidden\], got 2 tensors"):
            await first.links[bs0.device_id].call(
                "push_outputs", out, [torch.zeros(b - a, cfg.seq_len, cfg.hidden), forged]
            )
        await first.passes.process(link, meta, tensors)
        state = await swarm.train(timeout=120)
        return state

    asyncio.run(scenario())
    _, labels = make_batch(swarm.corpus, run.seed, 1, run.batch_size, cfg.seq_len)
    rows = run.batch_size // run.micro_batches
    for m in range(run.micro_batches):  # what the last stage computed its losses against (batch 1 is kept)
        held = fs1.buffers[(1, m)]
        assert torch.equal(held.labels, labels[m * rows + held.lo : m * rows + held.hi])


def test_the_run_data_a_frontal_server_keeps_survives_a_rollback_to_an_older_batch():
    """A rollback asks for a batch older than every one kept: it is read again (the cache once dropped
    the very batch it had just read, and the server died on it)."""
    from core.model.data import make_batch

    cfg, layout, run = make_run(stages=2, steps=12)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs1 = swarm.servers[layout.stages[1].frontal[0]]
    rows = run.batch_size // run.micro_batches
    for t in range(10):
        fs1.frontal.run_labels(t, 0, 0, 1)
    for t in (5, 0, 9):
        _, labels = make_batch(swarm.corpus, run.seed, t, run.batch_size, cfg.seq_len)
        assert torch.equal(fs1.frontal.run_labels(t, 1, 0, 2), labels[rows : rows + 2])
