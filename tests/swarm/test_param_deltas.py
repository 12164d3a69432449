"""Parameter versions pulled as their exact difference from the version a worker holds
(core/protocol/param_delta.py, parameter_server/param_deltas.py): used by every worker that holds the
version before, declined where the base is not the server's, refused where the fields are wrong,
and the run stays equal to `peer reference`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.protocol import param_delta
from core.protocol.refusals import Refusal
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_workers_pull_differences_and_the_run_equals_the_reference(precision):
    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2, precision=precision)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    state = asyncio.run(swarm.train(timeout=180))
    assert rel_diff(state, reference_state("tiny", steps, precision=precision)) < 1e-6
    for w in swarm.workers:  # each pulled versions 1.. against the one before
        assert w.stats["delta_pulls"] >= steps - 2, (w.device_id, w.stats)
    sent = sum(s.deltas.sent for s in swarm.servers.values())
    assert sent == sum(w.stats["delta_pulls"] for w in swarm.workers)
    assert all(s.report.status()["param_deltas"]["sent"] == s.deltas.sent for s in swarm.servers.values())


def test_a_worker_with_deltas_off_pulls_every_version_whole():
    steps = 3
    cfg, layout, run = make_run(steps=steps, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    swarm.workers[0].versions.deltas = False
    state = asyncio.run(swarm.train(timeout=120))
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6
    assert swarm.workers[0].stats["delta_pulls"] == 0
    assert not any(s.deltas.sent or s.deltas.declined for s in swarm.servers.values())


def test_a_base_the_server_does_not_hold_as_the_worker_does_gets_the_version_whole_and_bad_fields_are_refused():
    steps = 3
    cfg, layout, run = make_run(steps=steps, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    asyncio.run(swarm.train(timeout=120))
    server = swarm.servers[layout.stages[0].frontal[0]]
    shard = server.shard
    base = [shard.params_at(steps - 1)[n] for n in shard.names]
    right = param_delta.digest(shard.names, base)

    async def ask(**fields):
        meta = {"version": steps, "slot": server.slot, "wait": 0.0} | fields
        return await server.surface.handle("get_params", meta, [], "peer-u00")

    async def scenario():
        meta, tensors = await ask(base=steps - 1, base_digest=right)
        assert meta["encoding"] == param_delta.ENCODING and meta["base"] == steps - 1 and len(tensors) == 1
        got = param_delta.decode(base, tensors[0].numpy().tobytes())
        assert all(torch.equal(g, shard.params_at(steps)[n]) for n, g in zip(shard.names, got))
        declined = server.deltas.declined
        meta, tensors = await ask(base=steps - 1, base_digest="0" * 64)  # other bits under that version
        assert "encoding" not in meta and len(tensors) == len(shard.names)
        # only the newest version, from one of the two before it: what a server makes is bounded
        older = [shard.params_at(steps - 2)[n] for n in shard.names]
        meta, _ = await ask(version=steps - 1, base=steps - 2, base_digest=param_delta.digest(shard.names, older))
        assert "encoding" not in meta
        first = [shard.params_at(0)[n] for n in shard.names]
        meta, _ = await ask(base=0, base_digest=param_delta.digest(shard.names, first))  # three before
        assert "encoding" not in meta
        assert server.deltas.declined == declined + 3
        for fields, said in (
            ({"base": steps, "base_digest": right}, "'base': 3 is not a version older than 3"),
            ({"base": -1, "base_digest": right}, "'base'"),
            ({"base": "2", "base_digest": right}, "'base'"),
            ({"base": steps - 1}, "'base_digest'"),
        ):
            meta, tensors = await ask(**fields)  # refused (a bad request), and nothing sent
            assert meta["refusal"] == Refusal.BAD_REQUEST.value and said in meta["error"] and not tensors, meta

    asyncio.run(scenario())
