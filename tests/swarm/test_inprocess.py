"""The whole data path (segmentation between several FS/BS, ledger, relays, credits, delayed
update) in one event loop through the servers' real handlers and checks, for layouts the
multi-process tests do not cover: it must equal `peer reference --delay 1`."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time

import pytest
import torch

from parameter_server.clients import DISCONNECT_GRACE, TokenBucket
from parameter_server.updates import RETAIN
from peer.protocol.refusals import Refusal
from peer.protocol.tasks import TaskId
from peer.server_links import LocalLink
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import TICKETS, InProcessSwarm, make_run


@pytest.mark.parametrize(
    "stages,frontal,backward,volunteers,servers_compute",
    [
        (1, 1, 1, 1, True),  # one stage: forward, loss and backward in one task
        (2, 2, 2, 2, True),  # two servers of each role: rows split and re-segmented at the boundary
        (3, 2, 1, 1, False),  # three stages, p=1 -> q=2 segmentation, only volunteers compute
        (4, 1, 3, 2, True),  # as many stages as layers, three backward servers
    ],
)
def test_in_process_swarm_equals_reference(stages, frontal, backward, volunteers, servers_compute):
    steps = 4
    cfg, layout, run = make_run(steps=steps, stages=stages, frontal=frontal, backward=backward)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=volunteers, servers_compute=servers_compute)
    state = asyncio.run(swarm.train(timeout=120))
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    applied = {s.stage: s.shard.microbatches_applied for s in swarm.servers.values()}
    assert applied == {k: steps * run.micro_batches for k in range(stages)}
    # the ids of closed tasks are kept for the batches still in the window only (a run of days)
    for s in swarm.servers.values():
        assert s.forgotten_before == steps - (RETAIN - 1)
        assert all(TaskId.parse(tid).batch >= s.forgotten_before for tid in s.issued), (s.device_id, s.issued)
        assert s.pool.forget_closed(s.forgotten_before) == []


def test_a_sum_that_overlaps_another_clients_push_in_part_is_rerun_not_lost():
    """Client A sums the gradients of tasks T1 and T2; T2's lease is lost meanwhile (as when a
    deadline passes) and client B re-runs it and pushes it alone. A's sum then overlaps B's push in
    part: every server refuses it whole (a conflict), A completes T2 and hands T1 back, and T1 is
    re-run and pushed alone. Training ends equal to the reference, each micro-batch applied once."""
    steps = 2
    cfg, layout, run = make_run(steps=steps, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    a, b = swarm.workers

    async def scenario():
        fs.maybe_start_batches()  # before any client registers: one task per micro-batch, open to all
        await a.register()
        await b.register()
        held = []
        for _ in range(2):
            link, meta, tensors = await a.take_one()
            await a.process(link, meta, tensors)
            held.append(meta["task"])
        assert [tid for _, tid, _, _ in a.sums.pending[0].tasks] == held and a.stats["pushes"] == 0
        fs.pool.fail(held[1], a.links[fs.device_id].sender)  # A's lease of T2 is lost
        link, meta, tensors = await b.take_one()
        assert (meta["task"], meta["attempt"]) == (held[1], 2)
        await b.process(link, meta, tensors)  # a second attempt is pushed alone, at once
        assert b.stats["pushes"] == 1 and not b.sums.pending
        await a.sums.flush([0])
        assert a.stats["conflicts"] == len(swarm.servers) and a.stats["dropped"] == 1
        await a.register()  # what the workers finished goes with their next heartbeat (or take)
        await b.register()
        assert fs.pool.is_done(held[1]) and fs.pool.lease_of(held[0]) is None  # T1 queued again
        # A's conflicts, one a server, and no other (the training below may make more, handled the
        # same way, when timing has B back up a task A holds past the typical time: A is unproven
        # here, and under load its tasks take longer than B's)
        assert sum(w.stats["conflicts"] for w in swarm.workers) == len(swarm.servers)
        return await swarm.train(timeout=120)

    state = asyncio.run(scenario())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert {s.shard.microbatches_applied for s in swarm.servers.values()} == {steps * run.micro_batches}


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
        from peer.protocol.wire import RemoteError
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
    assert again.adopt(record) and set(again.hosted) == set(host.hosted)
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
    handle = buddy.handle

    async def late(method, meta, tensors, sender):
        if method == "push_replica" and meta.get("slot") == slot:
            await asyncio.sleep(0.8)
        return await handle(method, meta, tensors, sender)

    buddy.handle = late
    behind = []  # at each step of s0b1: its new version less what its replica holds
    host.on_step.append(lambda v: behind.append(v - (buddy.replicas[slot].version if slot in buddy.replicas else -1)))
    records, where = [], []

    async def lose():
        where.append(host.version)
        records.append(await swarm.lose(lost))

    state = asyncio.run(swarm.train(timeout=240, at_version={3: lose}))
    assert behind and max(behind) <= 2, behind  # (the step to v waits for the copy of v - 2)
    (record,) = records
    assert record["from_batch"] >= where[0] - 2, (record["from_batch"], where)
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5


def one_worker_on_a_clock():
    """One stage's frontal server on an injected clock (`now[0]`), one volunteer and its link."""
    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    now = [100.0]
    fs.clock = lambda: now[0]
    fs._reset_datapath()  # its pool on the injected clock
    (a,) = swarm.workers
    return fs, a, a.links[fs.device_id], now


def test_a_lease_that_runs_out_its_deadline_is_requeued_counted_and_logged(caplog):
    """A client that holds a lease past its deadline without a word (no heartbeat naming it, no
    hand-back): the server's maintenance re-queues it, counts it and says so at INFO, so that a
    stall it causes shows in the logs."""
    fs, a, link, now = one_worker_on_a_clock()

    async def scenario():
        await a.register()
        fs.maybe_start_batches()
        held = fs.pool.take(link.sender)
        fs.maintenance()
        assert fs.pool.lease_of(held.task.task_id) is not None and "leases_expired" not in fs.counters
        now[0] += fs.task_timeout * 4 + 1  # past any deadline factor (at most 4)
        with caplog.at_level(logging.INFO, logger="hivepipe.server"):
            fs.maintenance()
        assert fs.pool.lease_of(held.task.task_id) is None and fs.counters["leases_expired"] == 1
        assert (
            f"1 lease(s) ran out unanswered (their tasks queued again unless done or backed up): {held.task.task_id}"
            in caplog.text
        )

    asyncio.run(scenario())


def test_a_step_that_waits_far_longer_than_usual_says_once_at_info_what_it_waits_for(caplog):
    """A long run's rare stall must be explainable from its -v logs: once the next batch has not
    been applied for twice the median step (at least 3 s), the server logs one line naming the
    micro-batches whose gradients it lacks and its tasks of that batch not done yet, with their
    holders; once per version, not once per maintenance tick."""
    fs, a, link, now = one_worker_on_a_clock()

    async def scenario():
        await a.register()
        fs.maybe_start_batches()
        held = fs.pool.take(link.sender)
        fs.step_times = {-3: 1000.0, -2: 1001.0, -1: 1002.0}  # a median step of 1 s, last one at 1002
        assert fs.report_stall(1004.5) is None  # 2.5 s: under the 3 s floor
        with caplog.at_level(logging.INFO, logger="hivepipe.server"):
            line = fs.report_stall(1009.0)
            assert fs.report_stall(1010.0) is None
        assert line is not None and "no step for 7.0 s (median 1.00 s)" in line
        assert f"batch 0 lacks rows of micro-batches 0:{fs.shard.rows_per_micro}" in line
        assert f"{held.task.task_id} held by {link.sender[-8:]}" in line
        assert caplog.text.count("no step for") == 1

    asyncio.run(scenario())


def test_tasks_that_arrived_while_the_worker_was_busy_are_taken_oldest_batch_first():
    """Several servers can lease into a busy worker's waiting takes; it then works them in the
    pools' order (lower batch, lower micro-batch, backward first), not in their order of arrival:
    the step that waits for the oldest batch is not held behind a newer batch's task."""
    fs, a, link, now = one_worker_on_a_clock()
    arrived = [
        {"task": "F1.0.0.0-2", "batch": 1, "micro": 0, "kind": "forward"},
        {"task": "F0.3.0.0-2", "batch": 0, "micro": 3, "kind": "forward"},
        {"task": "B0.3.0.0-2", "batch": 0, "micro": 3, "kind": "backward"},
        {"task": "B0.1.0.0-2", "batch": 0, "micro": 1, "kind": "backward"},
    ]
    a.ready = [(link, meta, []) for meta in arrived]

    async def scenario():
        return [(await a.take_one())[1]["task"] for _ in arrived]

    assert asyncio.run(scenario()) == ["B0.1.0.0-2", "B0.3.0.0-2", "F0.3.0.0-2", "F1.0.0.0-2"]


def test_a_lease_whose_answer_was_lost_goes_back_to_the_pool_at_the_next_heartbeat():
    """The server leased a task but its answer never reached the worker (a `take` cut on the way
    back). The worker's heartbeat lists the tasks it holds, so the server re-queues the lease once it
    is old enough to have arrived, instead of after --task-timeout; a malformed list is refused."""
    from peer.protocol.wire import RemoteError

    fs, a, link, now = one_worker_on_a_clock()

    async def scenario():
        await a.register()
        fs.maybe_start_batches()
        lost = fs.pool.take(link.sender)  # leased; the answer is lost
        now[0] += 1.0
        await a.register()  # a young lease may still be on its way: kept
        assert fs.pool.lease_of(lost.task.task_id) is not None
        now[0] += 5.0
        await a.register()
        assert fs.pool.lease_of(lost.task.task_id) is None and fs.counters["leases_reclaimed"] == 1
        _, meta, _ = await a.take_one()
        assert (meta["task"], meta["attempt"]) == (lost.task.task_id, 2)
        for bad in ("T1", [1, 2], ["x" * 100]):
            with pytest.raises(RemoteError, match="holding"):
                await link.call("register", {"device": "u00", "compute": 1.0, "stage": 0, "holding": bad})
        assert fs.pool.lease_of(meta["task"]) is not None  # the refused heartbeats changed nothing

    asyncio.run(scenario())


def test_a_waiting_take_gets_the_task_cut_while_it_waits_and_a_bad_wait_is_refused():
    """An idle worker long-polls `take` at every server of its stage at once: the task cut while it
    waits comes back at once, without a poll; a wait that ends empty answers no task; a wait out of
    bounds is refused with its name and leases nothing."""
    import time

    from parameter_server.leases import MAX_TAKE_WAIT
    from peer.protocol.wire import RemoteError

    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    (a,) = swarm.workers
    link = a.links[fs.device_id]

    async def scenario():
        await a.register()
        t0 = time.monotonic()
        meta, _ = await link.call("take", {"wait": 0.3})
        assert meta["task"] is None and time.monotonic() - t0 >= 0.25  # waited, found nothing
        for bad in (-1.0, MAX_TAKE_WAIT + 1, "1"):
            with pytest.raises(RemoteError, match="'wait'"):
                await link.call("take", {"wait": bad})
        stop = asyncio.Event()
        waiting = asyncio.ensure_future(a.wait_for_task(stop, wait=3.0))
        await asyncio.sleep(0.2)
        assert not waiting.done() and set(a.waiting) == set(layout.stages[0].servers)
        t0 = time.monotonic()
        fs.maybe_start_batches()  # batch 0's forward tasks are cut now
        got = await asyncio.wait_for(waiting, 2.0)
        assert got is not None and got[1]["kind"] == "forward" and time.monotonic() - t0 < 0.5
        assert set(a.waiting) == set(layout.stages[0].backward)  # the backward server's wait goes on
        stop.set()
        await a._stop_waiting()  # what it was still waiting for is cancelled; nothing stays leased to it unseen
        assert not a.waiting and not a.ready

    asyncio.run(scenario())


def test_a_micro_batch_goes_whole_to_the_clients_owed_the_most_rows():
    """With more clients than tasks of --task-tokens, each micro-batch goes to the clients whose
    share of the compute is owed the most rows: equal clients get one whole micro-batch each per
    batch, and a client twice as fast gets twice the rows over a few batches."""
    import collections

    from parameter_server.clients import ClientInfo

    cfg, layout, run = make_run(steps=1, stages=1, batch_size=16, micro_batches=4)  # 4 rows per micro-batch
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    assert fs.min_task_rows == 16  # 512 tokens of 32 (tiny): a whole micro-batch
    fs.min_client_rows = 1  # --client-batch-tokens 1: no batch is held to fewer clients
    for name in ("c1", "c2", "c3", "c4"):
        fs.clients[f"peer-{name}"] = ClientInfo(name, 1.0, fs.clock())
    made = []
    fs._add_task = made.append

    def cut(micro_batches: int) -> collections.Counter:
        made.clear()
        for m in range(micro_batches):
            fs._make_forward_tasks(0, m % run.micro_batches)
        rows = collections.Counter()
        for task in made:
            rows[task.preferred_client] += task.rows[1] - task.rows[0]
        return rows

    rows = cut(4)
    assert len(made) == 4 and sorted(rows.values()) == [4, 4, 4, 4]  # one whole micro-batch each
    fs.clients["peer-c1"].compute = 2.0  # c1 is twice as fast as each other client
    fs.task_credit.clear()
    rows = cut(20)
    assert rows["peer-c1"] == 2 * rows["peer-c2"] == 2 * rows["peer-c3"] == 2 * rows["peer-c4"] == 32
    fs.min_task_rows = 1  # --task-tokens 1: every client gets a share of every micro-batch, as before
    rows = cut(1)
    assert len(made) == 4 and sum(rows.values()) == 4


def test_a_batch_goes_whole_to_one_client_and_the_next_batch_to_the_next_by_default():
    """--client-batch-tokens (2,048 by default: 64 rows of tiny, more than a 16-row batch) holds a
    batch's micro-batches to one client of the four, the next batch to the next: each client pulls
    and pushes the stage's parameters for one batch in four instead of every batch."""
    from parameter_server.clients import ClientInfo

    cfg, layout, run = make_run(steps=8, stages=1, batch_size=16, micro_batches=4)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    assert fs.min_client_rows == 64
    for name in ("c1", "c2", "c3", "c4"):
        fs.clients[f"peer-{name}"] = ClientInfo(name, 1.0, fs.clock())
    made = []
    fs._add_task = made.append
    for t in range(8):
        for m in range(run.micro_batches):
            fs._make_forward_tasks(t, m)
    by_batch = {t: {task.preferred_client for task in made if task.batch == t} for t in range(8)}
    assert all(len(clients) == 1 for clients in by_batch.values())
    assert [by_batch[t] | by_batch[t + 4] for t in range(4)] == [{f"peer-c{i}"} for i in range(1, 5)]
    assert sorted(fs.batch_members) == list(range(8))
    fs._forget_before(6)  # what is kept of a batch goes with its rows
    assert sorted(fs.batch_members) == [6, 7]


def test_a_batch_goes_first_to_a_free_worker_of_a_stage_server():
    """A stage server's own worker reads its parameters from its server (its own shard, and the
    other's replica) and pushes half the gradient: each new batch goes to one of the two servers'
    workers not busy with the batch in flight, and the volunteers get none while one is free. With
    `--no-local-first` (local_first False) the batches rotate over all four by the rows each is owed."""
    from parameter_server.clients import ClientInfo

    cfg, layout, run = make_run(steps=8, stages=1, batch_size=16, micro_batches=4)
    st = layout.stages[0]

    def members_by_batch(local_first: bool) -> list[str]:
        swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0, servers_compute=False)
        fs = swarm.servers[st.frontal[0]]
        fs.local_first = local_first
        for name in (*st.servers, "v1", "v2"):
            fs.clients[f"peer-{name}"] = ClientInfo(name, 1.0, fs.clock())
        made = []
        fs._add_task = made.append
        for t in range(8):
            fs.shard.version = max(t - 1, 0)  # batch t is cut once version t - 1 is made; t - 1 is in flight
            for m in range(run.micro_batches):
                fs._make_forward_tasks(t, m)
        by_batch = [{task.preferred_client for task in made if task.batch == t} for t in range(8)]
        assert all(len(clients) == 1 for clients in by_batch)
        return [clients.pop().removeprefix("peer-") for clients in by_batch]

    local = members_by_batch(True)
    assert set(local) == set(st.servers) and all(a != b for a, b in zip(local, local[1:]))
    spread = members_by_batch(False)
    assert sorted(spread) == sorted([*st.servers, "v1", "v2"] * 2)


def test_an_idle_worker_pushes_each_batch_once_when_the_rest_of_it_is_owed_to_it():
    """A worker holds a batch's sum while idle for the tasks of it owed to it: stage 0's backward
    tasks of the forward passes it kept, the last stage's micro-batches its frontal server said it
    cuts for it. One push a batch each (every push carries the whole stage's gradient), and the
    result stays the reference's. A new client may hold two leases at a server until it has delivered
    (parameter_server/service.py START_LEASES), so its first batch is pushed in two parts."""
    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    state = asyncio.run(swarm.train(timeout=120))
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert sorted((w.stage, w.stats["pushes"]) for w in swarm.workers) == [(0, steps + 1), (1, steps + 1)]


def test_one_complete_carries_every_task_of_a_push_and_a_bad_list_changes_nothing():
    from parameter_server.leases import MAX_COMPLETE
    from peer.protocol.wire import RemoteError

    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    fs.min_task_rows = 1
    (a,) = swarm.workers
    link = a.links[fs.device_id]

    async def scenario():
        await a.register()
        fs.maybe_start_batches()
        ids = []
        while True:
            meta, _ = await link.call("take", {})
            if meta["task"] is None:
                break
            ids.append(meta["task"])
        assert len(ids) >= 2
        for bad, why in (
            ([], "1 to"),
            (["x"] * (MAX_COMPLETE + 1), "1 to"),
            ([ids[0], "F99.0.0.0-1"], "unknown task id"),
            ("T1", "must be list"),
        ):
            with pytest.raises(RemoteError, match=why):
                await link.call("complete", {"tasks": bad})
        assert all(fs.pool.lease_of(t) is not None for t in ids)  # the refused calls completed nothing
        meta, _ = await link.call("complete", {"tasks": ids[:2]})
        assert meta["results"] == {ids[0]: "accepted", ids[1]: "accepted"}
        meta, _ = await link.call("complete", {"task": ids[0]})
        assert meta["result"] == "duplicate"

    asyncio.run(scenario())


def test_a_take_answer_cut_after_its_metadata_hands_the_task_back_at_once():
    """The server leased a task, and its answer was cut after the metadata (the stream ended before
    the tensors: seen 4 times in a soak). The worker knows the task id from what arrived
    and hands it back at once, instead of leaving the lease for a heartbeat to reclaim after 5 s."""
    from peer.protocol.wire import StreamCut

    async def then(fs, worker, real):
        worker.links[fs.device_id] = real
        got = await worker._take(fs.device_id)  # and the same task is there to take again
        assert got is not None
        return got[1]["task"]

    task = take_with_its_answer_lost(
        lambda device, answer: StreamCut(
            f"{device}.take: the stream ended after 0 of the 2 tensors its metadata declares", meta=answer
        ),
        then,
    )
    assert task.startswith("F0.")


def test_a_client_whose_connection_closed_is_dropped_and_its_leases_requeued():
    """drop_disconnected_clients, time injected: a client missing from the node's connections for
    DISCONNECT_GRACE (several reads) and silent meanwhile has left, and its lease goes back to the pool
    at once; a client that is connected, or that called meanwhile, stays."""
    fs, (a, b) = one_stage(volunteers=2)
    pa, pb = (w.links[fs.device_id].sender for w in (a, b))

    async def scenario():
        fs.maybe_start_batches()
        await a.register()
        await b.register()
        got = await a.take_one()
        return got[1]["task"]

    task = asyncio.run(scenario())
    now = [fs.clock()]
    fs.clock = fs.pool._clock = lambda: now[0]
    assert [lease.task.task_id for lease in fs.pool.leases_of(pa)] == [task]
    assert fs.drop_disconnected_clients({pb}) == []  # first read without a: not yet
    now[0] += 0.6 * DISCONNECT_GRACE
    assert fs.drop_disconnected_clients({pb}) == []  # within the grace
    now[0] += 0.5 * DISCONNECT_GRACE
    fs.clients[pb].last_seen = now[0] - 5.0  # b is silent, but connected: stays
    assert fs.drop_disconnected_clients({pb}) == [pa]
    assert pa not in fs.clients and pb in fs.clients
    assert fs.pool.leases_of(pa) == [] and fs.pool.lease_of(task) is None and not fs.pool.is_done(task)
    assert fs.pool.take(pb).task.task_id == task  # back in the pool, for another client
    # a client that reappears among the connections starts over; one that called meanwhile stays
    assert fs.drop_disconnected_clients(set()) == []
    fs.clients[pb].last_seen = now[0] + 1.5 * DISCONNECT_GRACE
    now[0] += 1.5 * DISCONNECT_GRACE
    assert fs.drop_disconnected_clients(set()) == []


def test_a_server_that_forgot_its_clients_is_registered_with_again_not_refused():
    """A restarted server does not know the clients that registered before (seen in a
    soak: workers' pushes to a restarted server refused 'not registered', their tasks dropped and
    run again). The worker registers there and repeats the refused call, which changed nothing."""
    fs, (worker,) = one_stage(volunteers=1)
    link = worker.links[fs.device_id]

    async def scenario():
        fs.maybe_start_batches()
        await worker.register()
        fs.clients.clear()  # as after a restart
        meta, _ = await worker.call(link, "take", {})
        return meta

    meta = asyncio.run(scenario())
    assert meta["task"].startswith("F0.") and link.sender in fs.clients


def test_a_take_answer_lost_whole_is_reclaimed_at_once():
    """The server leased a task and its whole answer was lost (the connection closed before an
    answer: seen in a soak). The worker, which has no other take in flight there, registers
    with what it holds and 'take_lost': the lease goes back at once, not when it is 5 s old."""
    take_with_its_answer_lost(
        lambda device, answer: ConnectionError(f"{device}.take: the connection closed before an answer")
    )


class TakeCutWhileWaiting:
    """A link whose `take` reaches the server and waits there for a task, while the caller's side of
    the stream closes at once (seen in a soak: "the connection closed before an answer",
    then a 5 s stall as the server leased a task into the closed stream): the server's handler goes
    on in `handlers`."""

    def __init__(self, link):
        self.link, self.device, self.sender, self.handlers = link, link.device, link.sender, []
        self.waiting_when_cut = []

    async def call(self, method, meta, tensors=(), timeout=30.0):
        if method == "take":
            self.handlers.append(asyncio.ensure_future(self.link.call(method, meta, tensors, timeout)))
            await asyncio.sleep(0.1)
            self.waiting_when_cut.append(not self.handlers[-1].done())
            raise ConnectionError(f"{self.device}.take: the connection closed before an answer")
        return await self.link.call(method, meta, tensors, timeout)


def test_a_take_given_up_while_it_still_waits_at_the_server_leases_nothing():
    """The worker's take failed without an answer while the server still waits for a task to give
    it. The worker registers with 'take_lost'; the task cut after that is not leased into the dead
    call (which answers no task) but stays in the pool for the next take, which gets it at once."""
    fs, (worker,) = one_stage(volunteers=1)
    real = worker.links[fs.device_id]

    async def scenario():
        await worker.register()
        cut = worker.links[fs.device_id] = TakeCutWhileWaiting(real)
        assert await worker._take(fs.device_id, wait=3.0) is None
        (handler,) = cut.handlers
        assert cut.waiting_when_cut == [True]
        fs.maybe_start_batches()  # the task it waited for is cut now
        answer, _ = await asyncio.wait_for(handler, 2.0)
        assert answer["task"] is None and fs.pool.leases_of(real.sender) == []
        assert fs.counters["takes_dropped"] == 1
        worker.links[fs.device_id] = real
        got = await worker._take(fs.device_id)
        assert got is not None and got[1]["task"].startswith("F0.")

    asyncio.run(scenario())


def take_with_its_answer_lost(error, then=None):
    """One worker's take from a one-stage server whose answer is lost as `error(device, answer)`
    says: the take gives nothing and the worker holds no lease there (handed back, or reclaimed at
    once); `then(fs, worker, real_link)` goes on from there, its result returned."""
    fs, (worker,) = one_stage(volunteers=1)
    real = worker.links[fs.device_id]

    async def scenario():
        fs.maybe_start_batches()
        await worker.register()
        worker.links[fs.device_id] = TakeAnswerLost(real, error)
        assert await worker._take(fs.device_id) is None
        assert fs.pool.leases_of(real.sender) == []
        return await then(fs, worker, real) if then is not None else None

    return asyncio.run(scenario())


def test_a_worker_that_just_started_gets_its_predecessors_leases_requeued_at_once():
    """A supervised server's process is forked again under the same peer id, and its node keeps the
    connection open, so the servers of its stage see neither a closed connection nor silence: the
    leases its dead worker held would wait until 5 s old (seen in a soak: a restart's stall
    4 s longer). A worker's first register says it just started: they go back at once."""
    fs, (worker,) = one_stage(volunteers=1)

    async def scenario():
        fs.maybe_start_batches()
        await worker.register()
        got = await worker.take_one()
        assert got is not None and fs.pool.leases_of(worker.links[fs.device_id].sender)
        await worker.register()  # an ordinary heartbeat: the young lease may still be on its way
        assert fs.pool.leases_of(worker.links[fs.device_id].sender)
        worker.current = None  # its successor holds nothing
        await worker.register(first=True)
        return fs.pool.leases_of(worker.links[fs.device_id].sender), got[1]["task"]

    leases, task = asyncio.run(scenario())
    assert leases == [] and not fs.pool.is_done(task)


def test_a_restarted_server_leases_back_what_its_clients_still_hold():
    """A restarted server lost its leases (they are not in its request log) and queued their tasks
    again; a worker that still works on one registers there (new to it) listing it, and it is
    leased back to that worker instead of being taken and done twice by another (seen in the
    a soak: 8 pushes refused 'names a task twice')."""
    fs, (a, b) = one_stage(volunteers=2)
    pa = a.links[fs.device_id].sender

    async def scenario():
        fs.maybe_start_batches()
        await a.register()
        await b.register()
        link, meta, _ = await a.take_one()
        a.current = (link.device, meta["task"])  # what run_loop records for the task it works on
        fs.pool.client_left(pa)  # the restart: the lease is gone and the task queued again,
        del fs.clients[pa]  # and the client unknown
        await a.register()
        return meta["task"]

    task = asyncio.run(scenario())
    assert fs.pool.lease_of(task).client == pa
    assert fs.counters.get("leases_adopted") == 1
    while (lease := fs.pool.take(b.links[fs.device_id].sender)) is not None:
        assert lease.task.task_id != task


def test_a_client_that_names_queued_tasks_as_held_gets_none_of_them():
    """A `register` from a client new to the server may list tasks it holds (after the server's
    restart, leases it still works on): only leases it proves with their tickets are leased back. A
    stranger naming queued task ids, with no ticket, another's ticket or one of its own for another
    task, gets none of them, and the `complete` it carries completes nothing; the worker that holds a
    ticket of one gets it back."""
    from peer.protocol.tasks import task_id
    from peer.protocol.wire import RemoteError

    fs, (a,) = one_stage(volunteers=1)
    pa = a.links[fs.device_id].sender
    stranger = LocalLink(fs, "peer-stranger")

    async def scenario():
        fs.maybe_start_batches()
        queued = [t for t in fs.issued if fs.pool.lease_of(t) is None and not fs.pool.is_done(t)]
        assert len(queued) >= 3, queued
        hello = {"device": "x", "compute": 1.0, "stage": 0}
        own = fs.lease_tickets.issue(task_id("forward", 99, 0, 0, (0, 1)), "peer-stranger", 1, fs.epoch)
        others = fs.lease_tickets.issue(queued[1], pa, 1, fs.epoch)
        claims = {"holding": queued[:3], "leases": [None, others, own], "complete": queued[:3]}
        await stranger.call("register", hello | claims)
        assert all(fs.pool.lease_of(t) is None and not fs.pool.is_done(t) for t in queued[:3])
        assert fs.counters["holding_unproven"] == 3
        with pytest.raises(RemoteError, match="one lease ticket"):  # malformed: refused whole
            await LocalLink(fs, "peer-other").call("register", hello | {"holding": queued[:2], "leases": [None]})
        await a.register()
        link, meta, _ = await a.take_one()
        a.current = (link.device, meta["task"])
        fs.pool.client_left(pa)  # the restart: the lease is gone, the task queued again, the client unknown
        del fs.clients[pa]
        await a.register()  # its ticket proves the lease
        return meta["task"]

    task = asyncio.run(scenario())
    assert fs.pool.lease_of(task).client == pa and fs.counters.get("leases_adopted") == 1


def test_outputs_are_pushed_for_all_of_a_tasks_rows_or_refused():
    """A forward task's outputs reach a backward server for all of the task's rows that server holds,
    or not at all: a holder that pushed its first row alone and handed the task back made every
    whole re-run overlap that row, refused for ever (the run hung). The whole push is accepted."""
    from peer.protocol.wire import RemoteError

    cfg, layout, run = make_run(steps=1, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs, bs = (swarm.servers[d] for d in (layout.stages[0].frontal[0], layout.stages[0].backward[0]))
    worker = next(w for w in swarm.workers if w.stage == 0)

    async def scenario():
        await worker.register()
        fs.maybe_start_batches()
        link, meta, _ = await worker.take_one()
        a, b = TaskId.parse(meta["task"]).rows
        push = {k: meta[k] for k in ("task", "batch", "micro", "frontal", "lease")}
        with pytest.raises(RemoteError, match=rf"rows \[{a}, {a + 1}\) are not the rows \[{a}, {b}\)"):
            await worker.links[bs.device_id].call(
                "push_outputs", push | {"rows": [a, a + 1]}, [torch.zeros(1, cfg.seq_len, cfg.hidden)]
            )
        assert (meta["batch"], meta["micro"]) not in bs.buffers or not bs.buffers[
            (meta["batch"], meta["micro"])
        ].covered
        answer, _ = await worker.links[bs.device_id].call(
            "push_outputs", push | {"rows": [a, b]}, [torch.zeros(b - a, cfg.seq_len, cfg.hidden)]
        )
        return answer

    assert asyncio.run(scenario())["result"] == "accepted"


@pytest.mark.parametrize("away_s,handed_back", [(1.0, False), (8.0, True)])
def test_a_server_away_for_a_moment_gets_the_work_when_back_not_a_rerun(away_s, handed_back, monkeypatch):
    """A supervised server restarted after a crash answers again within about a second. A worker
    whose requests handing work in (outputs, input gradients, gradient pushes) cannot get
    through tries them again for up to AWAY_GRACE_S instead of handing its tasks back to be run
    again (seen in a soak: restart stalls of 5.7-9.3 s against a median step of 1.9 s);
    a server away for longer gets them back as before. Training equals the reference either way."""
    import peer.volunteer.worker as worker_mod

    monkeypatch.setattr(worker_mod, "AWAY_GRACE_S", 4.0)
    steps = 2
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    backward = layout.stages[1].backward[0]  # where stage 0's outputs go, and a shard of stage 1's pushes
    aways = []
    for w in swarm.workers:
        if backward in w.links:
            aways.append(Away(w.links[backward], away_s))
            w.links[backward] = aways[-1]

    state = asyncio.run(swarm.train(timeout=120))
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert {s.shard.microbatches_applied for s in swarm.servers.values()} == {steps * run.micro_batches}
    assert sum(a.refused for a in aways) > 0, "the server was never away"
    dropped = sum(w.stats["dropped"] for w in swarm.workers)
    assert (dropped > 0) == handed_back, dropped


class Away:
    """A server's link while the server is away (a crash, its restart): every request in the first
    `seconds` of use fails as a closed connection would, changing nothing there."""

    def __init__(self, link, seconds: float):
        self.link, self.device, self.sender, self.seconds = link, link.device, link.sender, seconds
        self.since: float | None = None
        self.refused = 0

    async def call(self, method, meta, tensors=(), timeout=30.0):
        import time

        if self.since is None:
            self.since = time.monotonic()
        if time.monotonic() - self.since < self.seconds:
            self.refused += 1
            raise ConnectionError(f"{self.device}.{method}: the connection closed before an answer")
        return await self.link.call(method, meta, tensors, timeout)


class TakeAnswerLost:
    """A link whose `take` reaches the server (which leases a task) but whose answer is lost on the
    way back: `error(device, answer)` is what the caller gets instead."""

    def __init__(self, link, error):
        self.link, self.device, self.sender, self.error = link, link.device, link.sender, error

    async def call(self, method, meta, tensors=(), timeout=30.0):
        answer, tensors_r = await self.link.call(method, meta, tensors, timeout)
        if method == "take" and answer.get("task"):
            raise self.error(self.device, answer)
        return answer, tensors_r


def one_stage(volunteers: int):
    """(frontal server, volunteer workers) of a one-stage, one-step in-process swarm where only
    volunteers compute."""
    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=volunteers, servers_compute=False)
    return swarm.servers[layout.stages[0].frontal[0]], swarm.workers


def test_a_server_that_stalled_itself_does_not_drop_its_clients_as_silent():
    """drop_stale_clients, time injected: silence is counted only while the server itself runs its
    checks; a gap between two checks over OWN_STALL (its loop busy, its process starved) is not
    the clients' (seen at the start of a soak: three clients dropped at once)."""
    from parameter_server.clients import OWN_STALL

    fs, (a,) = one_stage(volunteers=1)
    pa = a.links[fs.device_id].sender
    asyncio.run(a.register())
    now = [fs.clock()]
    fs.clock = fs.pool._clock = lambda: now[0]
    fs.client_timeout = 3.0
    fs.drop_stale_clients()
    now[0] += 5.0  # the server's own stall: 5 s without a check
    assert fs.drop_stale_clients() == [] and pa in fs.clients
    for _ in range(14):  # then it checks every 0.2 s, and the client stays silent
        now[0] += 0.2
        assert fs.drop_stale_clients() == []
    assert now[0] - fs.clients[pa].last_seen <= 3.0 + 1e-9
    now[0] += 0.2
    assert fs.drop_stale_clients() == [pa]  # 3 s of silence the server saw: gone
    assert OWN_STALL < 3.0


def test_heartbeats_to_a_slow_server_do_not_hold_back_the_others():
    """Each server of the stage gets its own heartbeat: one whose register answers take seconds
    (its loop busy, or restarting) must not delay the heartbeats to the others, which would count
    that as the worker's silence."""
    fs, (a,) = one_stage(volunteers=1)
    a.heartbeat = 0.1
    devices = sorted(d for d in a.st.servers if d in a.links)
    assert len(devices) >= 2, devices
    slow = devices[0]
    registers = {d: 0 for d in devices}

    def wrap(device, plain):
        async def call(method, meta, tensors=(), timeout=30.0):
            if method == "register":
                registers[device] += 1
                if device == slow:
                    await asyncio.sleep(5.0)
            return await plain(method, meta, tensors, timeout)

        return call

    for d in devices:
        a.links[d].call = wrap(d, a.links[d].call)

    async def scenario():
        stop = asyncio.Event()
        beat = asyncio.ensure_future(a.heartbeat_loop(stop))
        await asyncio.sleep(1.5)
        stop.set()
        await beat

    asyncio.run(scenario())
    assert registers[slow] == 1
    assert all(registers[d] >= 4 for d in devices[1:]), registers


def test_each_task_says_at_debug_where_its_time_went(caplog):
    """`-vv`: every task a worker hands in logs its wall time with its compute and its parameter
    pulls (the rest is its calls), which is how the soak's stalls were read."""
    cfg, layout, run = make_run(steps=2, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    with caplog.at_level(logging.DEBUG, logger="hivepipe.worker"):
        asyncio.run(swarm.train(timeout=120))
    lines = [r.getMessage() for r in caplog.records if " done in " in r.getMessage()]
    done = [
        re.search(r": ([FB]\S+) done in ([\d.]+) s \(compute ([\d.]+) s, parameters ([\d.]+) s\)", x) for x in lines
    ]
    assert all(done) and len(done) == sum(w.stats["forward"] + w.stats["backward"] for w in swarm.workers)
    for m in done:
        assert float(m.group(2)) >= float(m.group(3)) + float(m.group(4)) - 1e-3
    assert all(w.stats["param_seconds"] > 0 for w in swarm.workers)


def test_hand_backs_cancelled_before_they_start_leave_no_call_unawaited():
    """A worker stopped while it hands back the tasks that arrived but never started: the gather of
    hand-backs is cancelled before its tasks run. No call coroutine is left made and never awaited
    (the "coroutine 'StageWorker.call' was never awaited" warning once seen in a failover test)."""
    import gc
    import warnings

    cfg, layout, run = make_run()
    swarm = InProcessSwarm(cfg, layout, run)
    worker = swarm.workers[0]
    link = next(iter(worker.links.values()))

    async def scenario():
        worker.ready = [(link, {"task": f"t{i}", "epoch": 0}, ()) for i in range(3)]
        stopping = asyncio.ensure_future(worker._stop_waiting())
        await asyncio.sleep(0)  # it reached the gather of hand-backs, whose tasks have not started
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        return worker.ready

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert asyncio.run(scenario()) == []
        gc.collect()
    assert [str(w.message) for w in seen if "never awaited" in str(w.message)] == []


def test_a_server_forgets_volunteers_gone_for_good_and_counts_each_join_once():
    """A run of days sees tens of thousands of volunteers come and go (the soak: 600 an hour); what a
    server keeps per volunteer (its batches for a ban's rollback, its passed checks, whether it was
    seen) must not grow with them. A volunteer that left is remembered while a rollback can still
    reach its work, then forgotten; one still registered is kept; each volunteer counts once in the
    announcement's joins, also when it registers again."""
    cfg, layout, run = make_run(steps=20, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    servers = {f"peer-{d}" for d in swarm.servers}
    now = [fs.clock()]
    fs.clock = fs.pool._clock = lambda: now[0]
    peers = [f"peer-v{i}" for i in range(30)]

    fs.admissions = TokenBucket(1.0, 10_000)  # (thirty joins at one frozen instant: not the limit tested here)

    async def register(peer):
        await LocalLink(fs, peer).call("register", {"device": peer[5:], "compute": 1.0, "stage": 0})

    def stats():
        return fs.announcement("online", [], 1.0, servers).stats

    async def step():  # every row of the next batch credited at every hosted slot: the real step path
        for shard in fs.hosted.values():
            t = shard.version
            pieces = [(f"B{t}.{m}", m, (0, shard.rows_per_micro)) for m in range(shard.micro_batches)]
            assert (
                shard.credit(
                    batch=t, pieces=pieces, loss_sum=1.0, grads=[torch.zeros_like(shard.params[n]) for n in shard.names]
                )[0]
                == "credited"
            )
        fs._maybe_step()
        await asyncio.sleep(0)

    async def scenario():
        for p in peers:
            await register(p)
            fs._note_contribution(p, fs.version)
            fs._passed(p, [])
        assert stats()["clients_joined"] == 30 and stats()["clients_left"] == 0
        fs.drop_disconnected_clients({peers[0]})
        now[0] += DISCONNECT_GRACE
        assert len(fs.drop_disconnected_clients({peers[0]})) == 29
        assert stats()["clients_joined"] == 30 and stats()["clients_left"] == 29
        await step()
        assert set(fs.contributed) == set(peers)  # a rollback may still reach their batch 0
        for _ in range(fs.shard.keep_versions + RETAIN):
            await step()
        assert set(fs.contributed) == {peers[0]} and set(fs.checks_passed) == {peers[0]}
        await register(peers[1])  # back: counted once, on probation again
        assert stats()["clients_joined"] == 30 and stats()["clients_left"] == 28
        assert fs.checks_passed.get(peers[1], 0) == 0

    asyncio.run(scenario())


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
        for _ in range(3000):  # the copies the adoption sent, delivered in this loop
            if all(any(slot in s.replicas for s in others) for slot in host.hosted):
                break
            await asyncio.sleep(0.01)
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


def test_finished_tasks_go_with_the_next_take_or_heartbeat_not_a_complete_each(tmp_path):
    """A worker hands the tasks it finished in with its next `take` or heartbeat to the server that
    leased them, not with a `complete` call of its own (completes were 0.69 of the 4.6
    calls a task cost). Until the server has them they are listed as held, so a heartbeat does not
    re-queue them. The server writes the carried ids to its request log as a `complete`, which a
    restart replays; a malformed list is refused and changes nothing, an id it does not know
    changes nothing, and ids carried with another layout epoch complete nothing (a task id names
    the same rows in every epoch)."""
    from parameter_server.leases import MAX_COMPLETE
    from parameter_server.requestlog import RequestLog, read_log
    from peer.protocol.wire import RemoteError

    cfg, layout, run = make_run(steps=2, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    dev = layout.stages[0].frontal[0]
    fs = swarm.servers[dev]
    fs.log = RequestLog(str(tmp_path / "fs.log"))
    (a,) = swarm.workers
    link = a.links[dev]
    calls = []
    handle = fs.handle

    async def counted(method, *args, **kwargs):
        calls.append(method)
        return await handle(method, *args, **kwargs)

    fs.handle = counted

    async def one_task():
        got = await a.take_one()
        await a.process(*got)
        await a.sums.flush_all()  # the sum is credited by every server
        return got[1]["task"]

    async def scenario():
        await a.register()
        fs.maybe_start_batches()
        first = await one_task()
        assert fs.pool.lease_of(first) is not None and a.hand_ins.finished == {dev: [first]}
        await link.call("register", a._registration(dev))  # a heartbeat without it lists it as held
        assert fs.pool.lease_of(first) is not None and first in a.holding(dev)
        second = await one_task()  # its take carried the first one in
        assert fs.pool.is_done(first) and a.hand_ins.finished == {dev: [second]}
        stop = asyncio.Event()
        beat = asyncio.ensure_future(a._beat(dev, stop))
        for _ in range(500):
            if fs.pool.is_done(second):
                break
            await asyncio.sleep(0.01)
        stop.set()
        await beat
        assert fs.pool.is_done(second) and a.hand_ins.finished == {}
        # what a bad or foreign list does
        _, meta, _ = await a.take_one()
        third = meta["task"]
        held = sorted(lease.task.task_id for lease in fs.pool.leases_of(link.sender))
        for bad in ("T1", [], [1], ["x" * 100], [third] * (MAX_COMPLETE + 1)):
            with pytest.raises(RemoteError, match="field 'complete'"):
                await link.call("take", {"complete": bad})
            with pytest.raises(RemoteError, match="field 'complete'"):
                await link.call("register", {"device": "u00", "compute": 1.0, "stage": 0, "complete": bad})
        await link.call("register", {"device": "u00", "compute": 1.0, "stage": 0, "complete": [third], "epoch": 1})
        assert sorted(lease.task.task_id for lease in fs.pool.leases_of(link.sender)) == held  # nothing changed
        meta, _ = await link.call("take", {"complete": ["F99.0.0.0-1", third]})  # unknown: ignored; known: done
        assert fs.pool.is_done(third) and meta["task"] is not None
        return first, second, third

    done = asyncio.run(scenario())
    assert "complete" not in calls
    logged = [t for r, _ in read_log(fs.log.path) if r.get("method") == "complete" for t in r["meta"]["tasks"]]
    assert logged == list(done)
    restarted = swarm.new_server(dev)
    asyncio.run(restarted.recover(read_log(fs.log.path)))
    assert all(restarted.pool.is_done(t) for t in done)


def test_a_take_says_whether_more_tasks_wait_and_a_server_without_is_asked_only_by_a_waiting_take():
    """A take answer says whether tasks are still queued at the server ("more"). A worker done with
    its task asks a server whose last answer said none only with a waiting take, once it is idle,
    not with a take that answers "nothing" at once (those were 0.73 of the 3.9 calls a
    task cost); the task that server gets meanwhile reaches the waiting take at once."""
    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    dev = layout.stages[0].frontal[0]
    fs = swarm.servers[dev]
    (a,) = swarm.workers
    link = a.links[dev]
    takes = []
    handle = fs.handle

    async def counted(method, meta, *args, **kwargs):
        if method == "take":
            takes.append(meta.get("wait", 0.0))
        return await handle(method, meta, *args, **kwargs)

    fs.handle = counted

    async def scenario():
        await a.register()
        fs.pool.trust(link.sender)  # (one client takes every task: not a newcomer's allowance, tested elsewhere)
        fs.maybe_start_batches()
        n = fs.pool.queued()
        assert n >= 2
        held, more = [], []
        for _ in range(n):
            _, meta, _ = await a._take(dev)
            held.append(meta["task"])
            more.append(meta["more"])
        assert more == [True] * (n - 1) + [False] and a.more[dev] is False
        assert await a.take_one() is None and len(takes) == n  # not asked again at once
        stop = asyncio.Event()
        waiting = asyncio.ensure_future(a.wait_for_task(stop, wait=3.0))
        await asyncio.sleep(0.05)
        await link.call("fail", {"task": held[0]})  # a task queued there again
        got = await asyncio.wait_for(waiting, 2.0)
        assert got[1]["task"] == held[0] and got[1]["more"] is False
        assert takes[n:] == [3.0]  # one waiting take, no take answered at once
        stop.set()
        await a._stop_waiting()

    asyncio.run(scenario())


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
    from peer.protocol.wire import RemoteError

    steps = 5
    cfg, layout, run = make_run(steps=steps, stages=1, frontal=1, backward=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs, bs = (swarm.servers[d] for d in layout.stages[0].servers)
    forms, told = [], []
    handle = bs.handle

    async def recorded(method, meta, *args, **kwargs):
        answer = await handle(method, meta, *args, **kwargs)
        if method == "push_replica" and meta.get("slot") == fs.slot:
            forms.append((meta.get("form", "state"), meta["version"], "error" not in answer[0]))
            if meta["version"] == 3 and not told:  # step 3 taken: the replica is told another lineage
                told.append(True)
                replica = bs.replicas[fs.slot]
                replica.mirror = (replica.version, "another lineage")
        return answer

    bs.handle = recorded

    async def scenario():
        fs.replicate_hosted()  # what a server does when the run comes online
        await swarm.train(timeout=120)
        # (the last step's copy may still be on its way: waited for, as a worker reading a replica does)
        assert await bs.replica_at(fs.slot, steps, timeout=120) is not None
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
    from parameter_server.shard import tensors_digest
    from peer.protocol.wire import RemoteError
    from peer.server_links import LocalLink

    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=1, frontal=1, backward=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0, servers_compute=True)
    fs, bs = (swarm.servers[d] for d in layout.stages[0].servers)
    # bs's worker alone computes: every step of fs's slot is then one push of bs's own worker, which
    # its replica at bs holds (with both workers, which one took a batch followed the machine's load)
    swarm.workers = [w for w in swarm.workers if w.device_id == bs.device_id]

    async def scenario():
        fs.replicate_hosted(), bs.replicate_hosted()
        state = await swarm.train(timeout=120)
        # (the last step's copies may still be on their way)
        assert await bs.replica_at(fs.slot, steps, timeout=120) is not None
        assert await fs.replica_at(bs.slot, steps, timeout=120) is not None
        meta, tensors = fs.hosted[fs.slot].export_step(steps)
        link = LocalLink(bs, fs.peer_id)
        wrong, _ = await link.call("push_replica", dict(meta, slot=fs.slot, grad_digest="0" * 64), [])
        bs.own_pushes.pop((fs.slot, steps - 1), None)
        digest = tensors_digest(meta["names"], dict(zip(meta["names"], tensors)))
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


def test_a_worker_fetches_the_next_version_ahead_and_a_server_waits_for_a_version_it_has_not_made():
    """A worker that works every step fetches the next parameter version while it computes on this
    one (scheduler/prefetch.py), its shards from every server at once; training still equals the
    reference. A `get_params` for a version the server has not made waits for it on the server (one
    call, not a poll): answered once the server steps to it, with that version's parameters; a wait
    that runs out answers `retry`; a wait out of bounds is refused with its name."""
    import math
    import time

    from peer.protocol.params import MAX_PARAMS_WAIT
    from peer.protocol.wire import RemoteError

    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    link = LocalLink(fs, "peer-reader")
    answered = {}

    async def ask(version):
        meta, tensors = await link.call("get_params", {"version": version, "wait": MAX_PARAMS_WAIT})
        answered[version] = (fs.version, meta, tensors)

    async def scenario():
        t0 = time.monotonic()
        meta, _ = await link.call("get_params", {"version": 1, "wait": 0.2})
        assert meta == {"retry": True, "version": 0} and time.monotonic() - t0 >= 0.15
        for bad in (-1.0, MAX_PARAMS_WAIT + 1, "1", math.nan):
            with pytest.raises(RemoteError, match="'wait'"):
                await link.call("get_params", {"version": 1, "wait": bad})
        asks = [asyncio.ensure_future(ask(v)) for v in (2, 4)]
        state = await swarm.train(timeout=120)
        await asyncio.gather(*asks)
        return state

    state = asyncio.run(scenario())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    for v, (at, meta, tensors) in answered.items():
        # one call, answered once the server made the version (a step may apply two batches at once)
        assert meta["version"] == v and "retry" not in meta and at >= v
        snap = fs.shard.params_at(v)
        assert all(torch.equal(t, snap[n]) for n, t in zip(meta["names"], tensors))
    fetched = {w.device_id: w.stats["prefetched"] for w in swarm.workers}
    assert all(n >= steps - 3 for n in fetched.values()), fetched


def test_a_servers_worker_reads_another_servers_slot_from_its_replica_only_when_the_digests_agree():
    """A server's own worker, which pulled the stage's other slot whole at every version, reads it
    from the replica its server keeps once the slot's host answers that version's digest (a
    `get_params` with `digest_only`, no tensors) and the replica's agrees. Where they disagree (here:
    one server's replica made to report other bits, as a replica on another kind of device may
    hold) it pulls the version from the host and keeps pulling for a while; training equals the
    reference either way. A digest answer carries no tensors, and a bad `digest_only` is refused."""
    from peer.protocol.wire import RemoteError

    steps = 8
    cfg, layout, run = make_run(steps=steps, stages=2, frontal=1, backward=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=True)
    for server in swarm.servers.values():  # --client-batch-tokens 1: every worker computes on every version
        server.min_client_rows = 1
    f1 = swarm.servers[layout.stages[1].frontal[0]]
    at = f1.replica_at

    async def other_bits(slot, version, timeout):
        kept = await at(slot, version, timeout)
        return None if kept is None else ("0" * 64, kept[1])

    f1.replica_at = other_bits
    state = asyncio.run(swarm.train(timeout=120))
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    stats = {w.device_id: (w.stats["params_from_replica"], w.stats["replica_misses"]) for w in swarm.workers}
    servers = set(swarm.servers)
    assert all(stats[d] == (0, 0) for d in stats if d not in servers), stats  # volunteers keep no replica
    hits = {d: stats[d][0] for d in servers if d != f1.device_id}
    assert all(n >= steps - 2 for n in hits.values()), stats
    # the replica that reports other bits: a miss, then REPLICA_BACKOFF versions pulled, then a miss again
    assert stats[f1.device_id][0] == 0 and 1 <= stats[f1.device_id][1] <= 2, stats

    b0 = swarm.servers[layout.stages[0].backward[0]]
    link = LocalLink(b0, "peer-reader")

    async def ask():
        meta, tensors = await link.call("get_params", {"version": steps, "digest_only": True})
        with pytest.raises(RemoteError, match="'digest_only'"):
            await link.call("get_params", {"version": steps, "digest_only": "yes"})
        return meta, tensors

    meta, tensors = asyncio.run(ask())
    assert tensors == [] and meta["digest"] == b0.shard.digest(steps) and len(meta["digest"]) == 64


def test_an_emulated_device_registers_the_compute_it_will_deliver_however_loaded_the_machine():
    """A device emulated `slowdown` times slower than this CPU stretches each pass to `slowdown` x
    the processor time it used (not x its wall time, which counts the waits for a core), and it
    measures the compute it registers the same way: what it registers is what it delivers, and a
    start on a loaded machine does not make it look slower than it will be (nor, on a CPU, slower
    than its processor time says: a swarm's processes measure while the others start)."""
    cfg, layout, run = make_run(steps=1, stages=1)
    (w,) = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False).workers
    assert w.device.pass_seconds(elapsed=0.5, busy=0.1) == 0.5  # slowdown 1: as long as it took
    w.device.slowdown = 10.0
    assert w.device.pass_seconds(elapsed=0.5, busy=0.1) == pytest.approx(1.0)  # waited 0.4 s for a core: still 1.0
    assert w.device.pass_seconds(elapsed=3.0, busy=0.1) == 3.0  # waited longer than the device would take
    passes = []  # what the measurement asks of each timed pass: (wall seconds, processor seconds)
    w.device.pass_seconds = lambda elapsed, busy: passes.append((elapsed, busy)) or (0.5 if len(passes) == 2 else 1.0)
    assert w.measure_compute(rows=2, repeats=3) == pytest.approx(4.0)  # 2 rows / its shortest pass, 0.5 s
    assert len(passes) == 3 and all(e > 0 and b > 0 for e, b in passes)  # the warm-up is not timed
    # on a CPU a pass counts at most its processor time: the device's speed, not the machine's load then
    assert all(e <= b for e, b in passes), passes


def test_a_garbage_collection_inside_a_pass_is_not_stretched_as_the_devices_compute():
    """An emulated device stretches a pass by the processor time of its arithmetic: a collection of
    the interpreter's garbage that falls inside it (0.1-0.2 s in a server holding torch's and
    hivemind's objects, which x10 stalled a step by 2 s) is not the device's, so it is not counted."""
    import gc

    cfg, layout, run = make_run(steps=1, stages=1)
    (w,) = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False).workers
    w.device.slowdown = 10.0
    seen = []
    w.device.pass_seconds = lambda elapsed, busy: seen.append(busy) or elapsed
    heap = [{"i": i} for i in range(400_000)]  # objects a full collection has to walk
    collecting = []

    def collect():
        c0 = time.thread_time()
        gc.collect()
        collecting.append(time.thread_time() - c0)

    asyncio.run(w.device.run(collect))
    del heap
    (busy,) = seen
    assert collecting[0] > 0.005  # the collection did take processor time
    assert busy < 0.1 * collecting[0]  # and none of it counts as the device's


def test_a_client_that_never_held_a_task_cannot_complete_it():
    """A registered client completing a task it never held (with `complete`, a take's or a
    heartbeat's carried list) changes nothing: the task stays leased to its holder, who completes it
    (a stranger that closed it could leave it undone for good if the holder then died). A holder
    whose lease ran out may still complete it."""
    from parameter_server.leases import NOT_HELD

    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    fs.min_client_rows = 1  # --client-batch-tokens 1: both clients get tasks of the batch
    (a,) = swarm.workers
    holder = a.links[fs.device_id]
    stranger = LocalLink(fs, "peer-stranger")
    hello = {"device": "x", "compute": 1.0, "stage": 0}

    async def scenario():
        await a.register()
        await stranger.call("register", hello)
        fs.maybe_start_batches()
        meta, _ = await holder.call("take", {})
        first = meta["task"]
        meta, _ = await stranger.call("complete", {"tasks": [first]})
        assert meta["results"] == {first: NOT_HELD}
        await stranger.call("take", {"complete": [first]})
        await stranger.call("register", dict(hello, complete=[first]))
        assert fs.pool.lease_of(first).client == holder.sender and not fs.pool.is_done(first)
        assert fs.counters["completes_not_held"] == 3
        meta, _ = await holder.call("complete", {"task": first})
        assert meta["result"] == "accepted" and fs.pool.is_done(first)
        meta, _ = await holder.call("take", {})  # a holder whose lease ran out still completes it
        second = meta["task"]
        fs.pool.expire(fs.clock() + 3600)
        assert fs.pool.lease_of(second) is None
        await holder.call("take", {"complete": [second]})
        assert fs.pool.is_done(second)

    asyncio.run(scenario())


def test_a_worker_handed_a_task_it_cannot_work_on_asks_every_server_again():
    """Found in CI: after a failover a slot taken over at an older version waits for the backward
    tasks of the batch it lacks, queued at a server whose last take answer said it had none, while
    the frontal servers hand out tasks of later batches, which need a version that slot has not made.
    Every worker took such a task, found the version missing, handed it back and took the next; none
    went idle, so none asked the server with the tasks again (a server that said "no more" is asked
    only by a waiting take): the run stood still for the test's 300 s. Here frontal server f0 is ahead
    of the stage (its own worker's push of batch 0 reached it alone) and hands out tasks of batch 2,
    which need version 1 of every slot; f1's tasks were handed back after its last answer said none
    were left. The worker hands f0's task back and takes f1's next, which the stage waits for."""
    cfg, layout, run = make_run(steps=4, stages=1, frontal=2, backward=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    f0, f1 = (swarm.servers[d] for d in layout.stages[0].frontal)
    f0.min_client_rows = f1.min_client_rows = 1  # --client-batch-tokens 1: both clients get tasks of every batch
    (a,) = swarm.workers
    other = LocalLink(f0, "peer-other")  # another volunteer, which holds f0's tasks of batches 0 and 1
    took_at_f1 = []
    handle = f1.handle

    async def counted(method, meta, tensors, sender):
        answer = await handle(method, meta, tensors, sender)
        if method == "take" and answer[0].get("task"):
            took_at_f1.append(answer[0]["task"])
        return answer

    async def scenario():
        await other.call("register", {"device": "other", "compute": 1.0, "stage": 0})
        f0.pool.trust("peer-other")  # (it holds a batch's tasks at once: not a newcomer's allowance)
        f0.maybe_start_batches()  # cut for `other` alone
        while (await other.call("take", {}))[0].get("task"):
            pass
        await a.register()
        f1.pool.trust(a.links[f1.device_id].sender)  # (it takes all of f1's tasks at once, as above)
        f1.maybe_start_batches()
        held = []
        while (got := await a._take(f1.device_id)) is not None:
            held.append(got[1]["task"])
        assert held and a.more[f1.device_id] is False
        for tid in held:
            await a.links[f1.device_id].call("fail", {"task": tid})
        f1.handle = counted
        batch0 = sorted(t for s in (f0, f1) for t in s.issued if TaskId.parse(t).batch == 0)
        zeros = [torch.zeros_like(f0.shard.params[n]) for n in f0.shard.names]
        tickets = [TICKETS.issue(t, f0.peer_id, 1, 0) for t in batch0]  # (minted as a server of the run may)
        await LocalLink(f0, f0.peer_id).call(
            "push_grads", {"tasks": batch0, "leases": tickets, "batch": 0, "slot": f0.slot, "loss_sum": 0.0}, zeros
        )
        # (the step waits for f0's replica at f1 to hold version 0: Failover.replica_behind)
        if f0.version < 1:
            await asyncio.wait_for(f0.step_event.wait(), 30.0)
        assert (f0.version, f1.version) == (1, 0) and f0.pool.open_tasks(2)  # f0 cut batch 2
        assert {h for b in (0, 1) for _, h, _ in f0.pool.open_tasks(b)} == {"peer-other"}  # all held
        stop = asyncio.Event()
        loop = asyncio.ensure_future(a.run_loop(stop))
        deadline = time.monotonic() + 15.0
        while not took_at_f1 and time.monotonic() < deadline and not loop.done():
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(loop, 30.0)
        return f0.pool.stats()["requeued"]

    requeued = asyncio.run(scenario())
    assert requeued >= 1  # f0's task of batch 2 went back undone
    assert took_at_f1 and TaskId.parse(took_at_f1[0]).batch == 0, took_at_f1


def test_only_a_heartbeats_answer_tells_a_worker_that_the_run_is_over():
    """Once the run is over a server's answer to `register` says so, and the server counts the worker
    told (a finished server stays, peer.host.ServerHost.farewell, until every worker is): any other
    call, a `take` here, neither tells the worker nor counts it told."""
    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=2, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    a, b = swarm.workers

    async def scenario():
        fs.maybe_start_batches()
        await a.register()
        await b.register()
        fs.run_over = True
        await b.take_one()
        assert not b.over and b.links[fs.device_id].sender not in fs.told_over
        await a.register()
        assert a.over and fs.told_over == {a.links[fs.device_id].sender}

    asyncio.run(scenario())
