"""The whole data path (segmentation between several FS/BS, ledger, relays, credits, delayed
update) in one event loop through the servers' real handlers and checks, for layouts the
multi-process tests do not cover: it must equal `peer reference --delay 1`."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
import torch

from core.protocol.tasks import TaskId
from parameter_server.updates import RETAIN
from peer.server_links import LocalLink
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import TICKETS, InProcessSwarm, make_run, one_worker_on_a_clock


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
    a.intake.ready = [(link, meta, []) for meta in arrived]

    async def scenario():
        return [(await a.intake.take_one())[1]["task"] for _ in arrived]

    assert asyncio.run(scenario()) == ["B0.1.0.0-2", "B0.3.0.0-2", "F0.3.0.0-2", "F1.0.0.0-2"]


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
    fs.add_task = made.append

    def cut(micro_batches: int) -> collections.Counter:
        made.clear()
        for m in range(micro_batches):
            fs.make_forward_tasks(0, m % run.micro_batches)
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
    fs.add_task = made.append
    for t in range(8):
        for m in range(run.micro_batches):
            fs.make_forward_tasks(t, m)
    by_batch = {t: {task.preferred_client for task in made if task.batch == t} for t in range(8)}
    assert all(len(clients) == 1 for clients in by_batch.values())
    assert [by_batch[t] | by_batch[t + 4] for t in range(4)] == [{f"peer-c{i}"} for i in range(1, 5)]
    assert sorted(fs.batch_members) == list(range(8))
    fs.forget_before(6)  # what is kept of a batch goes with its rows
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
        fs.add_task = made.append
        for t in range(8):
            fs.shard.version = max(t - 1, 0)  # batch t is cut once version t - 1 is made; t - 1 is in flight
            for m in range(run.micro_batches):
                fs.make_forward_tasks(t, m)
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
    from core.protocol.leases import MAX_COMPLETE
    from core.protocol.wire import RemoteError

    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    fs.min_task_rows = 1
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
    handle = fs.handle

    async def counted(method, *args, **kwargs):
        calls.append(method)
        return await handle(method, *args, **kwargs)

    fs.handle = counted

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
        await a.member.register()
        fs.pool.standing.trust(
            link.sender
        )  # (one client takes every task: not a newcomer's allowance, tested elsewhere)
        fs.maybe_start_batches()
        n = fs.pool.queued()
        assert n >= 2
        held, more = [], []
        for _ in range(n):
            _, meta, _ = await a.intake.take(dev)
            held.append(meta["task"])
            more.append(meta["more"])
        assert more == [True] * (n - 1) + [False] and a.intake.more[dev] is False
        assert await a.intake.take_one() is None and len(takes) == n  # not asked again at once
        stop = asyncio.Event()
        waiting = asyncio.ensure_future(a.intake.wait_for_task(stop, wait=3.0))
        await asyncio.sleep(0.05)
        await link.call("fail", {"task": held[0]})  # a task queued there again
        got = await asyncio.wait_for(waiting, 2.0)
        assert got[1]["task"] == held[0] and got[1]["more"] is False
        assert takes[n:] == [3.0]  # one waiting take, no take answered at once
        stop.set()
        await a.intake.stop_waiting()

    asyncio.run(scenario())


def test_a_worker_fetches_the_next_version_ahead_and_a_server_waits_for_a_version_it_has_not_made(monkeypatch):
    """A worker that works every step fetches the next parameter version while it computes on this
    one (scheduler/prefetch.py), its shards from every server at once; training still equals the
    reference. A `get_params` for a version the server has not made waits for it on the server (one
    call, not a poll): answered once the server steps to it, with that version's parameters; a wait
    that runs out answers `retry`; a wait out of bounds is refused with its name.

    The server's bound on a wait is lifted past the run's length here: the two calls that wait are
    answered by the steps, not by the clock (with the 5 s bound, a loaded machine made version 4
    later than that, and the call was answered `retry`)."""
    import math
    import time

    import parameter_server.updates
    from core.protocol.wire import RemoteError

    MAX_PARAMS_WAIT = 600.0
    monkeypatch.setattr(parameter_server.updates, "MAX_PARAMS_WAIT", MAX_PARAMS_WAIT)

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


def test_a_worker_holds_its_stages_current_parameters_before_its_first_take():
    """A worker fetches the version its stage's servers told it at registration before it takes a
    task (StageWorker.warm_up): its first lease is spent computing, not downloading. The first
    workers hold version 0 when their first task (on version 0) arrives; one that joins at version 3
    holds a version of at least 3 before its first take. Training still equals the reference."""
    from peer.volunteer.worker import StageWorker

    steps = 6
    cfg, layout, run = make_run(steps=steps, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    late_stop, late = asyncio.Event(), {}

    async def join_late():
        st = layout.stages[1]
        links = {d: LocalLink(swarm.servers[d], "peer-late") for d in st.servers}
        worker = StageWorker(
            run=run, layout=layout, cfg=cfg, stage=1, device_id="late", links=links, compute=1.0, poll=0.005
        )
        worker.compute = 7.25  # measured once built, as `peer join` does: the servers hear this
        late["worker"], late["task"] = worker, asyncio.ensure_future(worker.run_loop(late_stop))

    async def scenario():
        try:
            state = await swarm.train(timeout=120, at_version={3: join_late})
            late["registered"] = {d: swarm.servers[d].clients["peer-late"].compute for d in layout.stages[1].servers}
            return state
        finally:
            late_stop.set()
            if "task" in late:
                await asyncio.gather(late["task"], return_exceptions=True)

    state = asyncio.run(scenario())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    for w in swarm.workers:
        assert w.stats["warmed_up"] == 0 and w.stats["first_task_fetched"] is False, (w.device_id, w.stats)
    assert late["worker"].stats["warmed_up"] >= 3, late["worker"].stats
    assert late["registered"] == dict.fromkeys(layout.stages[1].servers, 7.25)


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
        f0.pool.standing.trust("peer-other")  # (it holds a batch's tasks at once: not a newcomer's allowance)
        f0.maybe_start_batches()  # cut for `other` alone
        while (await other.call("take", {}))[0].get("task"):
            pass
        await a.member.register()
        f1.pool.standing.trust(a.links[f1.device_id].sender)  # (it takes all of f1's tasks at once, as above)
        f1.maybe_start_batches()
        held = []
        while (got := await a.intake.take(f1.device_id)) is not None:
            held.append(got[1]["task"])
        assert held and a.intake.more[f1.device_id] is False
        for tid in held:
            await a.links[f1.device_id].call("fail", {"task": tid})
        f1.handle = counted
        batch0 = sorted(t for s in (f0, f1) for t in s.issued if TaskId.parse(t).batch == 0)
        zeros = [torch.zeros_like(f0.shard.params[n]) for n in f0.shard.names]
        tickets = [TICKETS.issue(t, f0.peer_id, 1, 0) for t in batch0]  # (minted as a server of the run may)
        await LocalLink(f0, f0.peer_id).call(
            "push_grads", {"tasks": batch0, "leases": tickets, "batch": 0, "slot": f0.slot, "loss_sum": 0.0}, zeros
        )
        # (the step waits for f0's replica at f1 to hold version 0: Replicas.replica_behind)
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
        await a.member.register()
        await b.member.register()
        fs.run_over = True
        await b.intake.take_one()
        assert not b.over and b.links[fs.device_id].sender not in fs.told_over
        await a.member.register()
        assert a.over and fs.told_over == {a.links[fs.device_id].sender}

    asyncio.run(scenario())
