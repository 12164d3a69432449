"""A ban's reach on disk (parameter_server/old_versions.py) through the servers' real handlers in one
process (tests/swarm/inprocess.py): a liar whose lies are older than every version kept in memory is
still rolled back to its first work, and the run ends equal to the reference."""

from __future__ import annotations

import asyncio

from parameter_server.old_versions import OldVersions
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run


def test_a_liar_caught_after_memory_let_its_lies_go_is_rolled_back_from_disk(tmp_path):
    """A volunteer of stage 0 adds noise (0.1 of each result's RMS: norm and direction kept) to every
    result from its first task, unseen: no probation, sample rate 0. A check that hits it late (here
    the coordinator's ban at version 16, as a sampled re-run would order it) finds its first work at
    batch 0 or 1, nine versions older than any server keeps in memory (7). Each server keeps the
    versions memory let go on disk (64 deep): every shard, the other stage's too, reads its rollback's
    version back from its file, and the run ends equal to the reference."""
    from peer.volunteer.cheat import Cheat

    steps, ban_at = 20, 16
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    olds = []
    for device, server in swarm.servers.items():
        server.probation, server.verify_rate = 0, 0.0
        olds.append(OldVersions(str(tmp_path / device), depth=64))
        server.use_old_versions(olds[-1])
    next(w for w in swarm.workers if w.device_id == "u01").cheat = Cheat("noise")
    records, in_memory = [], []

    async def ban():
        coordinator = swarm.servers[layout.stages[0].frontal[0]]
        in_memory.append(min(min(sh.snapshots) for s in swarm.servers.values() for sh in s.hosted.values()))
        records.append(await coordinator.ban_and_roll_back("peer-u01", "a check that hit it late"))

    try:
        state = asyncio.run(swarm.train(timeout=240, at_version={ban_at: ban}))
    finally:
        for old in olds:
            old.close()
    (record,), (memory_from,) = records, in_memory
    bans = {p for s in swarm.servers.values() for p in s.banned}
    assert bans == {"peer-u01"}, bans  # (no check caught it before the test's ban)
    assert record["rollback_to"] <= 1 < memory_from, (record, memory_from)  # read back from disk
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6
