"""The whole data path (segmentation between several FS/BS, ledger, relays, credits, delayed
update) in one event loop through the servers' real handlers and checks, for layouts the
multi-process tests do not cover: it must equal `peer reference --delay 1`."""
from __future__ import annotations

import asyncio

import pytest

from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run


@pytest.mark.parametrize("stages,frontal,backward,volunteers,servers_compute", [
    (1, 1, 1, 1, True),   # one stage: forward, loss and backward in one task
    (2, 2, 2, 2, True),   # two servers of each role: rows split and re-segmented at the boundary
    (3, 2, 1, 1, False),  # three stages, p=1 -> q=2 segmentation, only volunteers compute
    (4, 1, 3, 2, True),   # as many stages as layers, three backward servers
])
def test_in_process_swarm_equals_reference(stages, frontal, backward, volunteers, servers_compute):
    steps = 4
    cfg, layout, run = make_run(steps=steps, stages=stages, frontal=frontal, backward=backward)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=volunteers, servers_compute=servers_compute)
    state = asyncio.run(swarm.train(timeout=120))
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    applied = {s.stage: s.shard.microbatches_applied for s in swarm.servers.values()}
    assert applied == {k: steps * run.micro_batches for k in range(stages)}
