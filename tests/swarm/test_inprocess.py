"""The whole data path (segmentation between several FS/BS, ledger, relays, credits, delayed
update) in one event loop through the servers' real handlers and checks, for layouts the
multi-process tests do not cover: it must equal `peer reference --delay 1`."""

from __future__ import annotations

import asyncio
import logging

import pytest

from core.protocol.tasks import TaskId
from parameter_server.updates import RETAIN
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run, one_worker_on_a_clock


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
        await a.member.register()
        await b.member.register()
        held = []
        for _ in range(2):
            link, meta, tensors = await a.intake.take_one()
            await a.passes.process(link, meta, tensors)
            held.append(meta["task"])
        assert [tid for _, tid, _, _ in a.sums.pending[0].tasks] == held and a.stats["pushes"] == 0
        fs.pool.fail(held[1], a.links[fs.device_id].sender)  # A's lease of T2 is lost
        link, meta, tensors = await b.intake.take_one()
        assert (meta["task"], meta["attempt"]) == (held[1], 2)
        await b.passes.process(link, meta, tensors)  # a second attempt is pushed alone, at once
        assert b.stats["pushes"] == 1 and not b.sums.pending
        await a.sums.flush([0])
        assert a.stats["conflicts"] == len(swarm.servers) and a.stats["dropped"] == 1
        await a.member.register()  # what the workers finished goes with their next heartbeat (or take)
        await b.member.register()
        assert fs.pool.is_done(held[1]) and fs.pool.lease_of(held[0]) is None  # T1 queued again
        # A's conflicts, one a server, and no other (the training below may make more, handled the
        # same way, when timing has B back up a task A holds past the typical time: A is unproven
        # here, and under load its tasks take longer than B's)
        assert sum(w.stats["conflicts"] for w in swarm.workers) == len(swarm.servers)
        return await swarm.train(timeout=120)

    state = asyncio.run(scenario())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert {s.shard.microbatches_applied for s in swarm.servers.values()} == {steps * run.micro_batches}


def test_a_step_that_waits_far_longer_than_usual_says_once_at_info_what_it_waits_for(caplog):
    """A long run's rare stall must be explainable from its -v logs: once the next batch has not
    been applied for twice the median step (at least 3 s), the server logs one line naming the
    micro-batches whose gradients it lacks and its tasks of that batch not done yet, with their
    holders; once per version, not once per maintenance tick."""
    fs, a, link, now = one_worker_on_a_clock()

    async def scenario():
        await a.member.register()
        fs.maybe_start_batches()
        held = fs.pool.take(link.sender)
        fs.report.step_times.update({-3: 1000.0, -2: 1001.0, -1: 1002.0})  # a median step of 1 s, last one at 1002
        assert fs.report_stall(1004.5) is None  # 2.5 s: under the 3 s floor
        with caplog.at_level(logging.INFO, logger="hivepipe.server"):
            line = fs.report_stall(1009.0)
            assert fs.report_stall(1010.0) is None
        assert line is not None and "no step for 7.0 s (median 1.00 s)" in line
        assert f"batch 0 lacks rows of micro-batches 0:{fs.shard.rows_per_micro}" in line
        assert f"{held.task.task_id} held by {link.sender[-8:]}" in line
        assert caplog.text.count("no step for") == 1

    asyncio.run(scenario())


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
    from core.protocol.leases import MAX_COMPLETE
    from core.protocol.wire import RemoteError

    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    fs.frontal.min_task_rows = 1
    (a,) = swarm.workers
    link = a.links[fs.device_id]

    async def scenario():
        await a.member.register()
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


def test_finished_tasks_go_with_the_next_take_or_heartbeat_not_a_complete_each(tmp_path):
    """A worker hands the tasks it finished in with its next `take` or heartbeat to the server that
    leased them, not with a `complete` call of its own (completes were 0.69 of the 4.6
    calls a task cost). Until the server has them they are listed as held, so a heartbeat does not
    re-queue them. The server writes the carried ids to its request log as a `complete`, which a
    restart replays; a malformed list is refused and changes nothing, an id it does not know
    changes nothing, and ids carried with another layout epoch complete nothing (a task id names
    the same rows in every epoch)."""
    from core.protocol.leases import MAX_COMPLETE
    from core.protocol.wire import RemoteError
    from parameter_server.requestlog import RequestLog, read_log

    cfg, layout, run = make_run(steps=2, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    dev = layout.stages[0].frontal[0]
    fs = swarm.servers[dev]
    fs.log = RequestLog(str(tmp_path / "fs.log"))
    (a,) = swarm.workers
    link = a.links[dev]
    calls = []
    handle = fs.surface.handle

    async def counted(method, *args, **kwargs):
        calls.append(method)
        return await handle(method, *args, **kwargs)

    fs.surface.handle = counted

    async def one_task():
        got = await a.intake.take_one()
        await a.passes.process(*got)
        await a.sums.flush_all()  # the sum is credited by every server
        return got[1]["task"]

    async def scenario():
        await a.member.register()
        fs.maybe_start_batches()
        first = await one_task()
        assert fs.pool.lease_of(first) is not None and a.member.hand_ins.finished == {dev: [first]}
        await link.call("register", a.member.registration(dev))  # a heartbeat without it lists it as held
        assert fs.pool.lease_of(first) is not None and first in a.holding(dev)
        second = await one_task()  # its take carried the first one in
        assert fs.pool.is_done(first) and a.member.hand_ins.finished == {dev: [second]}
        stop = asyncio.Event()
        beat = asyncio.ensure_future(a.member.beats_to(dev, stop))
        for _ in range(500):
            if fs.pool.is_done(second):
                break
            await asyncio.sleep(0.01)
        stop.set()
        await beat
        assert fs.pool.is_done(second) and a.member.hand_ins.finished == {}
        # what a bad or foreign list does
        _, meta, _ = await a.intake.take_one()
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
    asyncio.run(restarted.recovery.recover(read_log(fs.log.path)))
    assert all(restarted.pool.is_done(t) for t in done)
