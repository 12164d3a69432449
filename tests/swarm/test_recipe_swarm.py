"""A run's training recipe (schedule, AdamW's settings) through the swarm: every shard steps update t
at the schedule's rate for t, as `peer reference` with the same flags does, including a replica that
replays a step and the re-run after a server is lost for good."""

from __future__ import annotations

import asyncio
import contextvars

import pytest
import torch

from core.protocol.recipe import Recipe
from tests.swarm.harness import reference_run, reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run

COSINE = Recipe(
    lr=4e-3, schedule="cosine", warmup_steps=2, min_lr=4e-4, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.05
)


@pytest.mark.stress
def test_a_scheduled_run_that_loses_a_server_for_good_equals_the_reference_with_its_recipe():
    """Two servers of each role a stage (each slot's replica kept by step replays); s1b1 lost for good
    after version 3: the failover's re-run steps the replayed versions again at their own rates."""
    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2, frontal=2, backward=2, recipe=COSINE)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1)
    lost = []

    async def lose():
        lost.append(await swarm.lose("s1b1"))

    state = asyncio.run(swarm.train(timeout=180, at_version={3: lose}))
    assert lost and lost[0]["epoch"] == 1
    assert rel_diff(state, reference_state("tiny", steps, recipe=COSINE)) < 1e-5
    # the schedule mattered: the default recipe at the same peak rate ends elsewhere
    assert rel_diff(state, reference_state("tiny", steps, lr=COSINE.lr)) > 1e-3


CLIPPED = Recipe(lr=2e-3, clip_grad_norm=1.0)
CHECKED_BATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "checked_batch", default=None
)  # the tiny model's batch gradients have norms 1.4-2.3


@pytest.mark.stress
@pytest.mark.parametrize("lose", [None, "s1b1", "s0f0"])
def test_global_norm_clipping_equals_clip_grad_norm_over_the_whole_model(lose):
    """Every shard of both stages steps with the norm of the whole batch gradient, also when a server
    is lost for good after version 2 (its slots' sums then come from the replica's host, or from
    the totals the others' shards kept)."""
    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2, frontal=2, backward=2, recipe=CLIPPED)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1)
    at = {} if lose is None else {2: lambda: swarm.lose(lose)}
    state = asyncio.run(swarm.train(timeout=180, at_version=at))
    if lose is not None:
        assert lose not in swarm.servers and all(s.epoch == 1 for s in swarm.servers.values())
    ref, summary = reference_run(steps, CLIPPED)
    assert rel_diff(state, ref) < 1e-5
    assert rel_diff(state, reference_state("tiny", steps)) > 1e-3  # clipping changed the run
    for s in swarm.servers.values():  # every server saw the run's norms, the reference's to float32
        norms = {int(t): n for t, n in s.report.status(recent=None)["grad_norms"].items()}
        assert norms and all(
            abs(n - summary["grad_norms"][t]) < 1e-5 * summary["grad_norms"][t] for t, n in norms.items()
        )


def test_a_gradient_sum_message_that_does_not_fit_is_refused_and_changes_nothing():
    cfg, layout, run = make_run(steps=4, stages=2, frontal=1, backward=1, recipe=CLIPPED)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0)
    server = swarm.servers["s0f0"]
    other = "peer-s1f0"  # a server of the run

    async def call(meta):
        answer, _ = await server.surface.handle("grad_norm", meta, [], other)
        return answer

    good = {"batch": 1, "epoch": 0, "sums": [[1, 0, 2.5]], "total": None}
    bad = [
        (dict(good, batch=4), "field 'batch' must be in 0..3"),
        (dict(good, epoch=-1), "field 'epoch' must be >= 0"),
        (dict(good, sums=[[1, 0, -1.0]]), "a sum must be"),
        (dict(good, sums=[[1, 0, float("nan")]]), "a sum must be"),
        (dict(good, sums=[[7, 0, 1.0]]), "no slot 0 of stage 7"),
        (dict(good, sums=[[1, 0, 1.0]] * 9), "the run has 4 slots"),
        (dict(good, total=float("inf")), "field 'total'"),
        (dict(good, sums="x"), "sums"),
    ]

    async def scenario():
        for meta, words in bad:
            answer = await call(meta)
            assert words in answer.get("error", ""), (meta, answer)
        assert server.clipping.slot_sums == {}
        answer = await call(good)
        assert answer["sums"] == [[1, 0, 2.5]] and answer["total"] is None
        outsider, _ = await server.surface.handle("grad_norm", good, [], "peer-stranger")
        assert "error" in outsider

    asyncio.run(scenario())


class News:
    """Something the test waits to change: `fire()` wakes whoever waits on `event` and arms a new one,
    so that a waiter that takes `event` before it checks its condition misses no change (the servers'
    `step_event` works the same way)."""

    def __init__(self):
        self.event = asyncio.Event()

    def fire(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


def checked_after_its_step(server, peer: str, until=None, news=None) -> None:
    """The checks `server` makes of `peer`'s work of batch t re-run it once batch t is stepped here
    (or once `until(t)`, a condition that stays true once it is, re-read at each `news.fire()`): its
    work is in the batch's norm and
    update when it is judged, as when a server's queue of checks falls behind the steps (a check that
    ends before the step catches a liar before its work takes effect: nothing to undo). Only the
    re-run waits: the check fetches its rows when the work arrives, as the product's checks do (a
    check held back whole found them forgotten by their holders, 1 run in 20 beside load, and judged
    nothing)."""
    check_later, recompute = server.check_later, server.recompute
    if until is None:
        until, news = (lambda t: server.version > t), server  # (woken at each step: server.updates.step_event)

    def marked(t, check, *args):
        if args[0] != peer:
            return check_later(t, check, *args)

        async def of_the_peer(epoch, *rest):
            token = CHECKED_BATCH.set(t)  # (the check's own task: what its re-run reads below)
            try:
                await check(epoch, *rest)
            finally:
                CHECKED_BATCH.reset(token)

        return check_later(t, of_the_peer, *args)

    async def late(version, fn):
        t = CHECKED_BATCH.get()
        while t is not None:  # (the step it waits for: nothing holds it for this check)
            woken = news.updates.step_event if news is server else news.event  # (taken before the check)
            if until(t):
                break
            await woken.wait()
        return await recompute(version, fn)

    server.check_later, server.recompute = marked, late


@pytest.mark.stress
def test_a_liar_banned_in_a_clipped_run_leaves_no_stale_norm_behind():
    """A volunteer's gradient pushes x100 enter the norms of the batches it worked on; its ban rolls
    those batches back, and the sums made before the rollback are dropped: the batches are clipped
    again by the norms of the honest re-runs, and the run equals the clipped reference."""
    from peer.volunteer.cheat import Cheat

    steps = 8
    cfg, layout, run = make_run(steps=steps, stages=2, recipe=CLIPPED)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    for server in swarm.servers.values():  # no probation: its work may be applied before its check ends
        server.arrivals.probation, server.arrivals.verify_rate = 0, 1.0
    liar = next(w for w in swarm.workers if w.device_id == "u11")
    for server in swarm.servers.values():
        checked_after_its_step(server, "peer-u11")

    async def lie_from_now():  # (batches go to a stage's two volunteers in turn: it has batches left)
        liar.cheat = Cheat("scale", after=liar.stats["forward"] + liar.stats["backward"])

    state = asyncio.run(swarm.train(timeout=240, at_version={1: lie_from_now}))
    bans = {p for s in swarm.servers.values() for p in s.bans.banned}
    assert bans == {"peer-u11"}
    assert any(s.clipping.sum_rollbacks for s in swarm.servers.values())
    ref, _ = reference_run(steps, CLIPPED)
    assert rel_diff(state, ref) < 1e-5


@pytest.mark.parametrize("stages", [1, 3])
def test_the_held_out_loss_of_every_nth_version_equals_the_references(stages):
    """--eval-every 2 over 5 steps: versions 2, 4 and 5 (the last) evaluated through the servers' own
    pipeline (3 stages: the activations pass a middle stage), equal to `peer reference --eval-every 2`."""
    steps = 5
    cfg, layout, run = make_run(steps=steps, stages=stages, eval_every=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1)
    noted = []
    last = swarm.servers[layout.stages[-1].frontal[0]]

    async def scenario():
        last_done = asyncio.Event()  # (the last version's evaluation follows its step: the event it means)
        last.evaluation.on_eval.append(lambda v, loss: (noted.append(v), v == steps and last_done.set()))
        state = await swarm.train(timeout=180)
        await asyncio.wait_for(last_done.wait(), 60)
        return state

    asyncio.run(scenario())
    _, summary = reference_run(steps, eval_every=2)
    want = {int(v): x for v, x in summary["eval_losses"].items()}
    assert sorted(want) == [2, 4, 5] and sorted(last.evaluation.eval_losses) == [2, 4, 5] and sorted(noted) == [2, 4, 5]
    assert all(abs(last.evaluation.eval_losses[v] - want[v]) < 1e-5 * want[v] for v in want), (
        last.evaluation.eval_losses,
        want,
    )
    assert want[5] < want[2]  # (the model learned)


def test_held_out_activations_that_do_not_fit_are_refused():
    cfg, layout, run = make_run(steps=4, stages=2, eval_every=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0)
    server = swarm.servers["s1f0"]
    good = torch.zeros(8, cfg.seq_len, cfg.hidden)

    async def call(meta, tensors):
        answer, _ = await server.surface.handle("eval_forward", meta, tensors, "peer-s0f0")
        return answer.get("error", "")

    async def scenario():
        assert "is not one this run evaluates" in await call({"version": 3}, [good])
        assert "carries one tensor" in await call({"version": 2}, [good, good])
        assert "must be finite float32" in await call({"version": 2}, [torch.zeros(8, cfg.seq_len, 3)])
        assert "must be finite float32" in await call({"version": 2}, [good.double()])
        assert "must be finite float32" in await call({"version": 2}, [torch.full_like(good, float("nan"))])
        assert (
            "not a frontal server past stage 0"
            in (
                (await swarm.servers["s1b0"].surface.handle("eval_forward", {"version": 2}, [good], "peer-s0f0"))[0][
                    "error"
                ]
            )
        )
        assert server.evaluation.evals_seen == set()

    asyncio.run(scenario())


@pytest.mark.stress
def test_the_evaluations_of_versions_a_ban_rolls_back_are_made_again_on_the_new_lineage():
    """--eval-every 1 with a liar whose work is applied, and evaluated, before its checks end (each
    waits for the evaluation of the version its batch made): the versions its rollback re-makes are
    evaluated again (an evaluation of an undone version is not kept), and every held-out loss equals
    `peer reference --eval-every 1`."""
    from peer.volunteer.cheat import Cheat

    steps = 8
    cfg, layout, run = make_run(steps=steps, stages=2, eval_every=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    last = swarm.servers[layout.stages[-1].frontal[0]]
    noted, evaluated = [], News()
    last.evaluation.on_eval.append(lambda v, loss: (noted.append((last.epoch, v)), evaluated.fire()))
    for server in swarm.servers.values():
        server.arrivals.probation, server.arrivals.verify_rate = 0, 1.0
        checked_after_its_step(server, "peer-u11", until=lambda t: any(v > t for _, v in noted), news=evaluated)
    liar = next(w for w in swarm.workers if w.device_id == "u11")

    async def lie_from_now():
        liar.cheat = Cheat("scale", after=liar.stats["forward"] + liar.stats["backward"])

    _, summary = reference_run(steps, eval_every=1)
    want = {int(v): x for v, x in summary["eval_losses"].items()}

    async def scenario():
        await swarm.train(timeout=240, at_version={1: lie_from_now})
        epoch, back_to = last.epoch, last.epoch_record["rollback_to"]

        def done():  # every evaluated version, of the final lineage (or from before what it re-made)
            return all(any(v == w and (e == epoch or w <= back_to) for e, v in noted) for w in want)

        while True:
            woken = evaluated.event
            if done():
                break
            await asyncio.wait_for(woken.wait(), 120)
        return back_to

    back_to = asyncio.run(scenario())
    assert {p for s in swarm.servers.values() for p in s.bans.banned} == {"peer-u11"}
    assert any(v > back_to for _, v in noted if _ == 0), noted  # an undone version had been evaluated
    assert sorted(last.evaluation.eval_losses) == sorted(want)
    assert all(abs(last.evaluation.eval_losses[v] - want[v]) < 1e-5 * want[v] for v in want), (
        last.evaluation.eval_losses,
        want,
    )
