"""A run's training recipe (schedule, AdamW's settings) through the swarm: every shard steps update t
at the schedule's rate for t, as `peer reference` with the same flags does, including a replica that
replays a step and the re-run after a server is lost for good."""

from __future__ import annotations

import asyncio
import os

from peer.protocol.recipe import Recipe
from tests.swarm.harness import reference_state, rel_diff, swarm_cli
from tests.swarm.inprocess import InProcessSwarm, make_run

COSINE = Recipe(
    lr=4e-3, schedule="cosine", warmup_steps=2, min_lr=4e-4, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.05
)


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


def test_peer_swarm_with_a_wsd_schedule_and_adamw_flags_equals_peer_reference_with_the_same_flags(tmp_path):
    steps = 6
    recipe = Recipe(lr=3e-3, schedule="wsd", warmup_steps=1, decay_steps=3, min_lr=0.0, betas=(0.9, 0.99))
    summary, state, _ = swarm_cli(
        tmp_path,
        f"recipe-{os.getpid()}",
        "--model",
        "tiny",
        "--steps",
        str(steps),
        "--volunteers",
        "2",
        "--lr",
        str(recipe.lr),
        *recipe.flags(),
    )
    assert summary["steps"] == steps
    assert rel_diff(state, reference_state("tiny", steps, recipe=recipe)) < 1e-5
    assert rel_diff(state, reference_state("tiny", steps, lr=recipe.lr)) > 1e-3
