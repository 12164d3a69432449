"""A ban's reach on disk (parameter_server/old_versions.py) through the servers' real handlers in one
process (tests/swarm/inprocess.py): a liar whose lies are older than every version kept in memory is
still rolled back to its first work, and the run ends equal to the reference."""

from __future__ import annotations

import asyncio

from parameter_server.old_versions import STRIDE, OldVersions
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run


def test_a_liar_caught_after_memory_let_its_lies_go_is_rolled_back_from_disk(tmp_path):
    """A volunteer of stage 0 adds noise (0.1 of each result's RMS: norm and direction kept) to every
    result from the first task it takes once every server is at version 9, unseen: no probation,
    sample rate 0, no direction re-run. A check that hits it late (here the coordinator's ban at
    version 20, as a sampled re-run would order it) finds its first lie at batch 9 or 10 (its honest
    work before is forgotten, as if it had joined then), older than any version kept in memory (7).
    Each server keeps the versions memory let go on disk (64 deep, every 8th with the one before it):
    every shard, the other stage's too, reads version 8 back from its file, and version 7 that batch
    8's re-run computes on, and the run ends equal to the reference."""
    from peer.volunteer.cheat import Cheat

    steps, ban_at = 24, 20
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    liar = next(w for w in swarm.workers if w.device_id == "u01")
    olds, armed = [], []

    def arm(slot: int, batch: int) -> None:  # (at each push credited: every server at version 9 yet?)
        if not armed and min(swarm.versions()) >= 9:
            liar.cheat = Cheat("noise", after=liar.stats["forward"] + liar.stats["backward"])
            armed.append(min(swarm.versions()))  # every task it takes from now on is of a later batch

    for device, server in swarm.servers.items():
        server.arrivals.probation, server.arrivals.verify_rate = 0, 0.0
        # nor re-run for its direction (a push in its slot's lowest 5% of cosines is, liar's or not):
        # seen only by the test's ban
        server.arrivals.unusual_direction = lambda *args: False
        olds.append(OldVersions(str(tmp_path / device), depth=64))
        server.use_old_versions(olds[-1])
        server.updates.on_credit.append(arm)
    records, in_memory = [], []

    async def ban():
        (since,) = armed
        for server in swarm.servers.values():  # its honest work before the lies: as if it had joined then
            server.arrivals.contributed["peer-u01"] = {
                t for t in server.arrivals.contributed.get("peer-u01", ()) if t >= since
            }
            server.arrivals.first_contributed["peer-u01"] = since
        in_memory.append(min(min(sh.snapshots) for s in swarm.servers.values() for sh in s.hosted.values()))
        coordinator = swarm.servers[layout.stages[0].frontal[0]]
        records.append(await coordinator.bans.ban_and_roll_back("peer-u01", "a check that hit it late"))

    try:
        state = asyncio.run(swarm.train(timeout=240, at_version={ban_at: ban}))
    finally:
        for old in olds:
            old.close()
    (record,), (memory_from,), (since,) = records, in_memory, armed
    bans = {p for s in swarm.servers.values() for p in s.bans.banned}
    assert bans == {"peer-u01"}, bans  # (no check caught it before the test's ban)
    assert since < ban_at - 2 and liar.stats["forward"] + liar.stats["backward"] > liar.cheat.after  # it lied
    # read back from disk: the grid's version at or before its first lie
    assert record["rollback_to"] == since // STRIDE * STRIDE == 8 and since < memory_from, (record, memory_from)
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-6
