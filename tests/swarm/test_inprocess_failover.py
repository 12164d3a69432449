"""Failover in one event loop through the servers' real handlers: a server lost for good, two of one
role one after the other, replicas kept by steps (bit for bit, a gap sent whole, a step taken by
reference to a push the replica's own worker made) and a slot read from its replica; each run equal
to `peer reference`."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from core.protocol.refusals import Refusal
from peer.server_links import LocalLink
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run


@pytest.mark.parametrize(
    "lost",
    [
        ("s0f0", 2),  # the frontal server that builds the batches, and the run's failover coordinator
        ("s1b1", 3),  # a backward server of the last stage
    ],
)
@pytest.mark.stress
def test_the_permanent_loss_of_a_server_is_failed_over_and_training_equals_the_reference(lost, tmp_path):
    """Two frontal and two backward servers per stage; one is gone for good mid-run. The first remaining
    server makes a new layout epoch: the lost shard slot is hosted by the server holding its replica,
    the rows re-segmented among the rest of its role, every unapplied batch run again from the lowest
    version of any shard. The result equals `peer reference --delay 1`, each micro-batch applied once
    per shard."""
    device, at = lost
    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2, frontal=2, backward=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1)
    records, reached = [], []

    async def lose():  # called once the slowest server is at `at` or past it (the harness polls every 20 ms)
        reached.append((min(swarm.versions()), swarm.servers[device].version))
        records.append(await swarm.lose(device))

    state = asyncio.run(swarm.train(timeout=180, at_version={at: lose}))
    (record,), ((version, lost_at),) = records, reached
    assert at <= version < steps
    # the others step on while the loss is detected; the re-run starts no later than the lost server was
    assert record["epoch"] == 1 and record["lost"] == [device] and record["from_batch"] <= lost_at
    stage = int(device[1])
    new = swarm.servers[next(iter(swarm.servers))].layout.stages[stage]
    assert device not in new.servers and len(new.hosts) == 4 and device not in new.hosts
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    for s in swarm.servers.values():
        assert s.epoch == 1
        assert {sh.microbatches_applied for sh in s.hosted.values()} == {steps * run.micro_batches}

    async def refused():
        from core.protocol.wire import RemoteError
        from peer.server_links import LocalLink

        server = next(iter(swarm.servers.values()))
        answers = []
        for sender, method, meta in [
            ("peer-u00", "take", {"epoch": 0}),  # a request of the epoch before the failover
            ("peer-u00", "take", {"epoch": 2}),  # of an epoch not adopted here
            ("peer-stranger", "adopt_epoch", record | {"epoch": 2}),
            ("peer-stranger", "push_replica", {"slot": 0}),
        ]:
            try:
                await LocalLink(server, sender).call(method, meta)
                answers.append(None)
            except RemoteError as e:
                answers.append((e.refusal, str(e)))
        return answers, server.epoch

    answers, epoch = asyncio.run(refused())
    assert epoch == 1
    assert [code for code, _ in answers] == [
        Refusal.STALE_EPOCH,
        Refusal.FUTURE_EPOCH,
        Refusal.BAD_REQUEST,
        Refusal.BAD_REQUEST,
    ], answers
    answers = [text for _, text in answers]
    assert "stale epoch 0" in answers[0] and "epoch 2 is not adopted" in answers[1], answers
    # both refused by the servicer's own check of the method table's caller column, before the handler
    assert "not a server of this run" in answers[2] and "not a server of this run" in answers[3], answers

    # the server that took the lost slot over checkpoints both slots; the same server started afresh
    # loads its own slot and gets the other back as a replica, which adopting the epoch takes over again
    from parameter_server.checkpoint import load_checkpoint, save_checkpoint

    (host,) = [s for s in swarm.servers.values() if len(s.hosted) == 2]
    save_checkpoint(host, str(tmp_path))
    again = swarm.new_server(host.device_id)
    assert load_checkpoint(again, str(tmp_path)) and again.epoch == 0 and set(again.hosted) == {host.slot}
    (other,) = set(host.hosted) - {host.slot}
    assert again.replicas[other].version == host.hosted[other].version == steps
    assert again.epochs.adopt(record) and set(again.hosted) == set(host.hosted)
    for slot, shard in host.hosted.items():
        assert all(torch.equal(shard.params[n], again.hosted[slot].params[n]) for n in shard.names)
    # another server's checkpoint is refused, naming why, and changes nothing
    neighbour = next(d for d in layout.stages[host.stage].servers if d not in (host.device_id, device))
    stranger = swarm.new_server(neighbour)
    before = {n: p.clone() for n, p in stranger.shard.params.items()}
    shutil.copy(tmp_path / f"{host.device_id}.shard.pt", tmp_path / f"{neighbour}.shard.pt")
    with pytest.raises(ValueError, match="not this server's checkpoint"):
        load_checkpoint(stranger, str(tmp_path))
    assert all(torch.equal(before[n], p) for n, p in stranger.shard.params.items()) and not stranger.replicas


@pytest.mark.stress
def test_a_slot_steps_at_most_two_versions_ahead_of_its_slow_replica_and_its_loss_reruns_little():
    """The stage's next server takes every copy of s0b1's slot 0.8 s late (a loaded machine, a slow
    link): s0b1 steps from version v only once its replica holds v - 1, so the replica is never more
    than two versions behind it; unbounded, the copies fell versions behind and a takeover had to
    re-run from far back (once from version 0, with the other shards at 2-3, and the run never
    finished). s0b1 is then lost: the failover re-runs from no earlier than two batches before where
    s0b1 was, and the run equals the reference."""
    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=1, frontal=2, backward=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1)
    st = layout.stages[0]
    lost = st.backward[1]
    host = swarm.servers[lost]
    slot = host.slot
    buddy = swarm.servers[st.servers[(list(st.servers).index(lost) + 1) % len(st.servers)]]
    handle = buddy.surface.handle

    async def late(method, meta, tensors, sender):
        if method == "push_replica" and meta.get("slot") == slot:
            await asyncio.sleep(0.8)
        return await handle(method, meta, tensors, sender)

    buddy.surface.handle = late
    behind = []  # at each step of s0b1: its new version less what its replica holds
    host.updates.on_step.append(
        lambda v: behind.append(v - (buddy.replicas[slot].version if slot in buddy.replicas else -1))
    )
    records, where = [], []

    async def lose():
        where.append(host.version)
        records.append(await swarm.lose(lost))

    state = asyncio.run(swarm.train(timeout=240, at_version={3: lose}))
    assert behind and max(behind) <= 2, behind  # (the step to v waits for the copy of v - 2)
    (record,) = records
    assert record["from_batch"] >= where[0] - 2, (record["from_batch"], where)
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5


@pytest.mark.stress
def test_two_servers_of_one_role_lost_one_after_the_other_are_failed_over():
    """Three backward servers in stage 1; one is lost for good and, right after its failover and
    before any step of the new epoch, the server that took its slot over. That host re-replicated
    the adopted slot at once on adopting the epoch (not at its next step), so the second failover
    finds a copy of every slot; the result equals the reference, each micro-batch applied once."""
    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2, frontal=1, backward=3)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1)
    records, seen = [], {}

    async def lose_two():
        records.append(await swarm.lose("s1b1"))
        host = swarm.servers["s1b2"]
        seen["hosted"], seen["version"] = sorted(host.hosted), host.version
        others = [s for d, s in swarm.servers.items() if d != "s1b2" and d.startswith("s1")]
        copied = asyncio.Event()  # the copies the adoption sent, delivered in this loop

        def look(_slot: int) -> None:
            if all(any(slot in s.replicas for s in others) for slot in host.hosted):
                copied.set()

        for s in others:
            s.copies.on_replica.append(look)
        look(-1)
        await asyncio.wait_for(copied.wait(), 30)
        seen["version_at_loss"] = host.version
        records.append(await swarm.lose("s1b2"))

    state = asyncio.run(swarm.train(timeout=240, at_version={2: lose_two}))
    assert [(r["epoch"], r["lost"]) for r in records] == [(1, ["s1b1"]), (2, ["s1b2"])]
    assert len(seen["hosted"]) == 2  # its own slot and the one it took over from s1b1
    assert seen["version_at_loss"] == seen["version"]  # no step of epoch 1 in between
    new = next(iter(swarm.servers.values())).layout.stages[1]
    assert list(new.backward) == ["s1b0"] and len(new.hosts) == 4 and set(new.hosts) <= {"s1f0", "s1b0"}
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    for s in swarm.servers.values():
        assert s.epoch == 2
        assert {sh.microbatches_applied for sh in s.hosted.values()} == {steps * run.micro_batches}


def same(replica, shard) -> bool:
    """A replica's parameters, AdamW moments and step count equal its shard's, bit for bit."""
    if replica.version != shard.version:
        return False
    for n in shard.names:
        mine, theirs = replica.optimizer.state[replica.params[n]], shard.optimizer.state[shard.params[n]]
        if not (
            torch.equal(replica.params[n], shard.params[n])
            and torch.equal(mine["exp_avg"], theirs["exp_avg"])
            and torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])
            and float(mine["step"]) == float(theirs["step"])
        ):
            return False
    return True


@pytest.mark.stress
def test_a_replica_kept_by_steps_equals_its_shard_bit_for_bit_and_a_gap_gets_the_whole_state():
    """After each step a server sends the stage's next server the step that made the new version
    (the summed gradient: a third of the bytes of the state) and the replica takes the
    same AdamW step: its parameters and AdamW moments equal the shard's bit for bit at every
    version. A replica that does not mirror the sender's version before (here: told another
    lineage, as after a rollback or a restart) refuses the step, changing nothing, and the sender
    sends the whole state instead; the same step again (a call repeated after a lost answer) is a
    duplicate, taken once; a step that does not fit is refused with its reason."""
    from core.protocol.wire import RemoteError

    steps = 5
    cfg, layout, run = make_run(steps=steps, stages=1, frontal=1, backward=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs, bs = (swarm.servers[d] for d in layout.stages[0].servers)
    forms, told = [], []
    handle = bs.surface.handle

    async def recorded(method, meta, *args, **kwargs):
        answer = await handle(method, meta, *args, **kwargs)
        if method == "push_replica" and meta.get("slot") == fs.slot:
            forms.append((meta.get("form", "state"), meta["version"], "error" not in answer[0]))
            if meta["version"] == 3 and not told:  # step 3 taken: the replica is told another lineage
                told.append(True)
                replica = bs.replicas[fs.slot]
                replica.mirror = (replica.version, "another lineage")
        return answer

    bs.surface.handle = recorded

    async def scenario():
        fs.copies.replicate_hosted()  # what a server does when the run comes online
        await swarm.train(timeout=120)
        # (the last step's copy may still be on its way: waited for, as a worker reading a replica does)
        assert await bs.copies.replica_at(fs.slot, steps, timeout=120) is not None
        trained = list(forms)
        link = LocalLink(bs, fs.peer_id)
        meta, tensors = fs.hosted[fs.slot].export_step(steps)
        again, _ = await link.call("push_replica", dict(meta, slot=fs.slot), tensors)  # a repeat: taken once
        assert again["result"] == "duplicate"
        bad = [
            (dict(meta, slot=fs.slot, token="t", base_token="t"), tensors, "mirror"),  # another lineage's step
            (dict(meta, slot=fs.slot), tensors[:-1], "tensors"),
            (dict(meta, slot=fs.slot, version=steps + 1), tensors, "must be an int"),
            (dict(meta, slot=bs.slot), tensors, "not another server's slot"),
        ]
        errors = []
        for m, t, _ in bad:
            with pytest.raises(RemoteError) as e:
                await link.call("push_replica", m, t)
            errors.append(str(e.value))
        return trained, errors, [why for _, _, why in bad]

    trained, errors, why = asyncio.run(scenario())
    assert all(w in e for e, w in zip(errors, why)), errors
    assert same(bs.replicas[fs.slot], fs.hosted[fs.slot])  # the refused steps changed nothing
    sent = [(form, v) for form, v, ok in trained if ok]
    refused = [(form, v) for form, v, ok in trained if not ok]
    assert sent[0] == ("state", 0) and ("step", 1) in sent and ("step", steps) in sent
    assert len(refused) == 1 and refused[0][0] == "step"  # the step after the lineage changed
    assert ("state", refused[0][1]) in sent  # ... went as the whole state
    assert [v for _, v in sent] == sorted(v for _, v in sent)


@pytest.mark.stress
def test_a_replica_takes_the_step_its_own_worker_pushed_by_reference_bit_for_bit():
    """When a step's summed gradient is the one push of the replica's own server's worker, the host
    sends its digest only and the replica steps with the sum that worker pushed (0.92 MB a step and
    server in the default swarm): replicas still equal their shards bit for bit and training the
    reference. A step by reference whose digest is not what the worker pushed (or of a batch it
    pushed nothing of) is answered `need_tensors`, changing nothing; the host then sends the tensors."""
    from core.protocol import param_delta
    from core.protocol.wire import RemoteError
    from peer.server_links import LocalLink

    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=1, frontal=1, backward=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0, servers_compute=True)
    fs, bs = (swarm.servers[d] for d in layout.stages[0].servers)
    # bs's worker alone computes: every step of fs's slot is then one push of bs's own worker, which
    # its replica at bs holds (with both workers, which one took a batch followed the machine's load)
    swarm.workers = [w for w in swarm.workers if w.device_id == bs.device_id]

    async def scenario():
        fs.copies.replicate_hosted(), bs.copies.replicate_hosted()
        state = await swarm.train(timeout=120)
        # (the last step's copies may still be on their way)
        assert await bs.copies.replica_at(fs.slot, steps, timeout=120) is not None
        assert await fs.copies.replica_at(bs.slot, steps, timeout=120) is not None
        meta, tensors = fs.hosted[fs.slot].export_step(steps)
        link = LocalLink(bs, fs.peer_id)
        wrong, _ = await link.call("push_replica", dict(meta, slot=fs.slot, grad_digest="0" * 64), [])
        bs.copies.own_pushes.pop((fs.slot, steps - 1), None)
        digest = param_delta.digest(meta["names"], tensors)
        none, _ = await link.call("push_replica", dict(meta, slot=fs.slot, grad_digest=digest), [])
        with pytest.raises(RemoteError, match="grad_digest"):
            await link.call("push_replica", dict(meta, slot=fs.slot, grad_digest=5), [])
        return state, [wrong, none]

    state, answers = asyncio.run(scenario())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert same(bs.replicas[fs.slot], fs.hosted[fs.slot]) and same(fs.replicas[bs.slot], bs.hosted[bs.slot])
    # every step of fs's slot went by reference (version 0 went whole, when the run came online); bs's
    # slot was pushed by bs's own worker, which fs does not hold
    assert fs.counters["replica_steps_by_reference"] == steps, fs.counters
    assert bs.counters["replica_steps_by_reference"] == 0, bs.counters
    assert [a["result"] for a in answers] == ["need_tensors"] * 2
    assert same(bs.replicas[fs.slot], fs.hosted[fs.slot])  # changing nothing


def test_a_servers_worker_reads_another_servers_slot_from_its_replica_only_when_the_digests_agree():
    """A server's own worker, which pulled the stage's other slot whole at every version, reads it
    from the replica its server keeps once the slot's host answers that version's digest (a
    `get_params` with `digest_only`, no tensors) and the replica's agrees. Where they disagree (here:
    one server's replica made to report other bits, as a replica on another kind of device may
    hold) it pulls the version from the host and keeps pulling for a while; training equals the
    reference either way. A digest answer carries no tensors, and a bad `digest_only` is refused."""
    from core.protocol.wire import RemoteError
    from peer.volunteer.versions import REPLICA_BACKOFF

    steps = 8
    cfg, layout, run = make_run(steps=steps, stages=2, frontal=1, backward=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=True)
    for server in swarm.servers.values():  # --client-batch-tokens 1: every worker may compute on every version
        server.frontal.min_client_rows = 1
    f1 = swarm.servers[layout.stages[1].frontal[0]]
    at = f1.copies.replica_at

    async def other_bits(slot, version, timeout):
        kept = await at(slot, version, timeout)
        return None if kept is None else ("0" * 64, kept[1])

    f1.copies.replica_at = other_bits

    async def train():
        for server in swarm.servers.values():  # what a server does when the run comes online
            server.copies.replicate_hosted()
        for server in swarm.servers.values():  # each first copy's arrival (bounded: a missing one fails the test)
            while not server.replicas:
                await asyncio.wait_for(server.copies.event.wait(), 30)
        return await swarm.train(timeout=120)

    state = asyncio.run(train())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    counts = ("params_from_replica", "replica_late", "replica_other_bits", "other_slots_pulled")
    stats = {w.device_id: tuple(w.stats[c] for c in counts) for w in swarm.workers}
    servers = set(swarm.servers)
    assert all(stats[d] == (0, 0, 0, 0) for d in stats if d not in servers), stats  # volunteers keep no replica
    # every version of the other slot that it computed on read from the replica, never other bits; a
    # pull of it from its host only after a copy came later than the worker's wait for it (a loaded
    # machine's), for the REPLICA_BACKOFF versions that follow
    for d in servers - {f1.device_id}:
        hits, late, other, pulled = stats[d]
        assert other == 0 and hits >= 1 and pulled <= late * REPLICA_BACKOFF, stats
    # the replica that reports other bits: a miss, then the slot pulled for REPLICA_BACKOFF versions
    hits, late, other, pulled = stats[f1.device_id]
    assert hits == 0 and other == 1 and late == 0 and pulled >= 1, stats

    b0 = swarm.servers[layout.stages[0].backward[0]]
    link = LocalLink(b0, "peer-reader")

    async def ask():
        meta, tensors = await link.call("get_params", {"version": steps, "digest_only": True})
        with pytest.raises(RemoteError, match="'digest_only'"):
            await link.call("get_params", {"version": steps, "digest_only": "yes"})
        return meta, tensors

    meta, tensors = asyncio.run(ask())
    assert tensors == [] and meta["digest"] == b0.shard.digest(steps) and len(meta["digest"]) == 64


@pytest.mark.stress
def test_a_copy_to_a_lost_buddy_still_on_its_way_when_the_epoch_begins_holds_no_step_for_ever():
    """s0b0's first copy of its slot goes to s0b1 (the stage's next server), which never answers it: its
    step of batch 0 waits for that copy. s0b1 is lost for good and failed over while the copy is still
    on its way; the new epoch's copy to s0b0's new next server waits behind it. The old copy fails only
    once s0b0 holds every gradient of batches 0 and 1 (no push is left to make it look again: seen in a
    `peer swarm --lose-server` run that waited for ever). The new copy still goes whole to the new next
    server, the step it held is taken, and the run equals the reference."""
    steps = 4
    cfg, layout, run = make_run(steps=steps, stages=1, frontal=2, backward=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    s0b0, s0b1 = (swarm.servers[d] for d in layout.stages[0].backward)
    slot = s0b0.slot
    on_its_way, let_fail = asyncio.Event(), asyncio.Event()
    handle = s0b1.surface.handle

    async def deaf(method, meta, tensors, sender):
        if method == "push_replica" and sender == s0b0.peer_id:
            on_its_way.set()
            await let_fail.wait()
            raise ConnectionError("s0b1 is gone")
        return await handle(method, meta, tensors, sender)

    s0b1.surface.handle = deaf

    def holds_both(credited_slot: int, batch: int) -> None:
        batches = s0b0.hosted[slot].batches
        if s0b0.epoch == 1 and all(t in batches and batches[t].complete() for t in (0, 1)):
            let_fail.set()

    async def lose():
        await asyncio.wait_for(on_its_way.wait(), 60)
        await swarm.lose(s0b1.device_id)
        s0b0.updates.on_credit.append(holds_both)  # looked at as each push of the new epoch is credited
        holds_both(slot, -1)  # (and now, should they all be in already)

    state = asyncio.run(swarm.train(timeout=120, at_version={0: lose}))
    assert let_fail.is_set() and s0b0.epoch == 1
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
