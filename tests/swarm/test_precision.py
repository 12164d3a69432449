"""Mixed precision (`--precision bf16`): volunteers compute under autocast on parameters sent in
bfloat16 (half the bytes), the servers keep fp32 masters and AdamW, the checks re-run in the same
precision (honest volunteers pass, a liar is caught), and the run follows `peer reference --precision
bf16` up to where rows are cut into tasks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.model.precision import PRECISIONS, rounded
from core.protocol.records import PRECISIONS as RECORD_PRECISIONS
from core.protocol.wire import pack, payload_bytes, stream_of, unpack
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run


def test_the_precisions_the_record_accepts_are_the_ones_the_model_knows():
    assert PRECISIONS == RECORD_PRECISIONS == ("fp32", "bf16")


def test_parameters_are_sent_in_bfloat16_at_half_the_bytes_and_computed_on_as_rounded():
    cfg, layout, run = make_run(steps=2, stages=2, precision="bf16")
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0)
    server = swarm.servers["s0f0"]

    async def ask(s):
        return await s.surface.handle("get_params", {"version": 0, "slot": s.slot, "wait": 0.0}, [], "peer-u00")

    (meta, tensors) = asyncio.run(ask(server))
    assert all(t.dtype == torch.bfloat16 for t in tensors)
    snap = server.shard.params_at(0)
    assert all(torch.equal(t.float(), snap[n].bfloat16().float()) for n, t in zip(meta["names"], tensors))
    from hivemind.proto.runtime_pb2 import ExpertResponse

    bf16_bytes = payload_bytes(pack(meta, tensors, ExpertResponse))
    fp32_bytes = payload_bytes(pack(meta, [snap[n] for n in meta["names"]], ExpertResponse))
    assert 0.49 < bf16_bytes / fp32_bytes < 0.52, (bf16_bytes, fp32_bytes)
    got_meta, got = asyncio.run(unpack(stream_of(pack(meta, tensors, ExpertResponse))))
    assert all(torch.equal(a, b) for a, b in zip(got, tensors)) and all(a.dtype == torch.bfloat16 for a in got)
    # what a task computes on: the rounded values, whichever form they arrived in
    again = rounded({n: t for n, t in zip(meta["names"], got)}, "bf16")
    assert all(torch.equal(again[n], rounded(snap, "bf16")[n]) for n in meta["names"])


@pytest.mark.parametrize("servers_per_role", [1, 2])
def test_a_bf16_swarm_makes_the_references_casts_and_passes_its_checks(servers_per_role):
    """One server of each role a stage: a task is a whole micro-batch, as the reference computes it,
    and the bf16 swarm equals `peer reference --precision bf16` (fp32 rounding of the sums only). Two:
    a micro-batch's rows are cut in two, which rounds otherwise at bf16 (measured: 7.9e-4 from the bf16
    reference after 6 steps, against 2.3e-3 between the bf16 and the fp32 references)."""
    steps = 6
    cfg, layout, run = make_run(
        steps=steps, stages=2, frontal=servers_per_role, backward=servers_per_role, precision="bf16"
    )
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    for server in swarm.servers.values():  # every push re-run: honest bf16 work must pass them all
        server.arrivals.verify_rate = 1.0
    state = asyncio.run(swarm.train(timeout=180))
    bf16_ref = reference_state("tiny", steps, precision="bf16")
    far = rel_diff(bf16_ref, reference_state("tiny", steps))
    assert far > 1e-3  # (bf16 moved the run)
    if servers_per_role == 1:
        assert rel_diff(state, bf16_ref) < 1e-6
    else:
        assert rel_diff(state, bf16_ref) < 0.5 * far
    checks = [s.verify_counts for s in swarm.servers.values()]
    assert sum(c.get("checked", 0) for c in checks) > 0 and not any(s.bans.banned for s in swarm.servers.values()), (
        checks
    )


def test_a_liar_in_a_bf16_run_is_caught():
    from peer.volunteer.cheat import Cheat

    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2, precision="bf16")
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    next(w for w in swarm.workers if w.device_id == "u11").cheat = Cheat("scale")
    asyncio.run(swarm.train(timeout=240))
    assert {p for s in swarm.servers.values() for p in s.bans.banned} == {"peer-u11"}
