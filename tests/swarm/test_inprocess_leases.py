"""Leases in one event loop through the servers' real handlers: what happens to a task when its lease
runs out, its answer is lost or cut, its client's connection closes, its server forgets its clients,
restarts or goes away for a moment, and what a client may claim of tasks it never held."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from core.protocol.tasks import TaskId
from parameter_server.clients import DISCONNECT_GRACE, TokenBucket
from parameter_server.updates import RETAIN
from peer.server_links import LocalLink
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import InProcessSwarm, make_run, one_worker_on_a_clock


def test_a_lease_that_runs_out_its_deadline_is_requeued_counted_and_logged(caplog):
    """A client that holds a lease past its deadline without a word (no heartbeat naming it, no
    hand-back): the server's maintenance re-queues it, counts it and says so at INFO, so that a
    stall it causes shows in the logs."""
    fs, a, link, now = one_worker_on_a_clock()

    async def scenario():
        await a.member.register()
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


def test_a_lease_whose_answer_was_lost_goes_back_to_the_pool_at_the_next_heartbeat():
    """The server leased a task but its answer never reached the worker (a `take` cut on the way
    back). The worker's heartbeat lists the tasks it holds, so the server re-queues the lease once it
    is old enough to have arrived, instead of after --task-timeout; a malformed list is refused."""
    from core.protocol.wire import RemoteError

    fs, a, link, now = one_worker_on_a_clock()

    async def scenario():
        await a.member.register()
        fs.maybe_start_batches()
        lost = fs.pool.take(link.sender)  # leased; the answer is lost
        now[0] += 1.0
        await a.member.register()  # a young lease may still be on its way: kept
        assert fs.pool.lease_of(lost.task.task_id) is not None
        now[0] += 5.0
        await a.member.register()
        assert fs.pool.lease_of(lost.task.task_id) is None and fs.counters["leases_reclaimed"] == 1
        _, meta, _ = await a.intake.take_one()
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

    from core.protocol.wire import RemoteError
    from parameter_server.leases import MAX_TAKE_WAIT

    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    (a,) = swarm.workers
    link = a.links[fs.device_id]

    async def scenario():
        await a.member.register()
        t0 = time.monotonic()
        meta, _ = await link.call("take", {"wait": 0.3})
        assert meta["task"] is None and time.monotonic() - t0 >= 0.25  # waited, found nothing
        for bad in (-1.0, MAX_TAKE_WAIT + 1, "1"):
            with pytest.raises(RemoteError, match="'wait'"):
                await link.call("take", {"wait": bad})
        stop = asyncio.Event()
        # a wait far longer than the test's own bound: only the cut task can end it in time
        waiting = asyncio.ensure_future(a.intake.wait_for_task(stop, wait=MAX_TAKE_WAIT))
        deadline = time.monotonic() + 30.0
        while set(a.intake.waiting) != set(layout.stages[0].servers):  # its takes are open at every server
            assert not waiting.done() and time.monotonic() < deadline, a.intake.waiting
            await asyncio.sleep(0.01)
        fs.maybe_start_batches()  # batch 0's forward tasks are cut now
        got = await asyncio.wait_for(waiting, MAX_TAKE_WAIT / 2)
        assert got is not None and got[1]["kind"] == "forward"
        assert set(a.intake.waiting) == set(layout.stages[0].backward)  # the backward server's wait goes on
        stop.set()
        await a.intake.stop_waiting()  # what it was still waiting for is cancelled; nothing stays leased to it unseen
        assert not a.intake.waiting and not a.intake.ready

    asyncio.run(scenario())


def test_a_take_answer_cut_after_its_metadata_hands_the_task_back_at_once():
    """The server leased a task, and its answer was cut after the metadata (the stream ended before
    the tensors: seen 4 times in a soak). The worker knows the task id from what arrived
    and hands it back at once, instead of leaving the lease for a heartbeat to reclaim after 5 s."""
    from core.protocol.wire import StreamCut

    async def then(fs, worker, real):
        worker.links[fs.device_id] = real
        got = await worker.intake.take(fs.device_id)  # and the same task is there to take again
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
        await a.member.register()
        await b.member.register()
        got = await a.intake.take_one()
        return got[1]["task"]

    task = asyncio.run(scenario())
    now = [fs.clock()]
    fs.clock = lambda: now[0]
    assert [lease.task.task_id for lease in fs.pool.leases_of(pa)] == [task]
    assert fs.registry.drop_disconnected_clients({pb}) == []  # first read without a: not yet
    now[0] += 0.6 * DISCONNECT_GRACE
    assert fs.registry.drop_disconnected_clients({pb}) == []  # within the grace
    now[0] += 0.5 * DISCONNECT_GRACE
    fs.clients[pb].last_seen = now[0] - 5.0  # b is silent, but connected: stays
    assert fs.registry.drop_disconnected_clients({pb}) == [pa]
    assert pa not in fs.clients and pb in fs.clients
    assert fs.pool.leases_of(pa) == [] and fs.pool.lease_of(task) is None and not fs.pool.is_done(task)
    assert fs.pool.take(pb).task.task_id == task  # back in the pool, for another client
    # a client that reappears among the connections starts over; one that called meanwhile stays
    assert fs.registry.drop_disconnected_clients(set()) == []
    fs.clients[pb].last_seen = now[0] + 1.5 * DISCONNECT_GRACE
    now[0] += 1.5 * DISCONNECT_GRACE
    assert fs.registry.drop_disconnected_clients(set()) == []


def test_a_server_that_forgot_its_clients_is_registered_with_again_not_refused():
    """A restarted server does not know the clients that registered before (seen in a
    soak: workers' pushes to a restarted server refused 'not registered', their tasks dropped and
    run again). The worker registers there and repeats the refused call, which changed nothing."""
    fs, (worker,) = one_stage(volunteers=1)
    link = worker.links[fs.device_id]

    async def scenario():
        fs.maybe_start_batches()
        await worker.member.register()
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
        await worker.member.register()
        cut = worker.links[fs.device_id] = TakeCutWhileWaiting(real)
        assert await worker.intake.take(fs.device_id, wait=3.0) is None
        (handler,) = cut.handlers
        assert cut.waiting_when_cut == [True]
        fs.maybe_start_batches()  # the task it waited for is cut now
        answer, _ = await asyncio.wait_for(handler, 2.0)
        assert answer["task"] is None and fs.pool.leases_of(real.sender) == []
        assert fs.counters["takes_dropped"] == 1
        worker.links[fs.device_id] = real
        got = await worker.intake.take(fs.device_id)
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
        await worker.member.register()
        worker.links[fs.device_id] = TakeAnswerLost(real, error)
        assert await worker.intake.take(fs.device_id) is None
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
        await worker.member.register()
        got = await worker.intake.take_one()
        assert got is not None and fs.pool.leases_of(worker.links[fs.device_id].sender)
        await worker.member.register()  # an ordinary heartbeat: the young lease may still be on its way
        assert fs.pool.leases_of(worker.links[fs.device_id].sender)
        worker.current = None  # its successor holds nothing
        await worker.member.register(first=True)
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
        await a.member.register()
        await b.member.register()
        link, meta, _ = await a.intake.take_one()
        a.current = (link.device, meta["task"])  # what run_loop records for the task it works on
        fs.pool.client_left(pa)  # the restart: the lease is gone and the task queued again,
        del fs.clients[pa]  # and the client unknown
        await a.member.register()
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
    from core.protocol.tasks import task_id
    from core.protocol.wire import RemoteError

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
        await a.member.register()
        link, meta, _ = await a.intake.take_one()
        a.current = (link.device, meta["task"])
        fs.pool.client_left(pa)  # the restart: the lease is gone, the task queued again, the client unknown
        del fs.clients[pa]
        await a.member.register()  # its ticket proves the lease
        return meta["task"]

    task = asyncio.run(scenario())
    assert fs.pool.lease_of(task).client == pa and fs.counters.get("leases_adopted") == 1


def test_outputs_are_pushed_for_all_of_a_tasks_rows_or_refused():
    """A forward task's outputs reach a backward server for all of the task's rows that server holds,
    or not at all: a holder that pushed its first row alone and handed the task back made every
    whole re-run overlap that row, refused for ever (the run hung). The whole push is accepted."""
    from core.protocol.wire import RemoteError

    cfg, layout, run = make_run(steps=1, stages=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs, bs = (swarm.servers[d] for d in (layout.stages[0].frontal[0], layout.stages[0].backward[0]))
    worker = next(w for w in swarm.workers if w.stage == 0)

    async def scenario():
        await worker.member.register()
        fs.maybe_start_batches()
        link, meta, _ = await worker.intake.take_one()
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
    asyncio.run(a.member.register())
    now = [fs.clock()]
    fs.clock = lambda: now[0]
    fs.registry.client_timeout = 3.0
    fs.registry.drop_stale_clients()
    now[0] += 5.0  # the server's own stall: 5 s without a check
    assert fs.registry.drop_stale_clients() == [] and pa in fs.clients
    for _ in range(14):  # then it checks every 0.2 s, and the client stays silent
        now[0] += 0.2
        assert fs.registry.drop_stale_clients() == []
    assert now[0] - fs.clients[pa].last_seen <= 3.0 + 1e-9
    now[0] += 0.2
    assert fs.registry.drop_stale_clients() == [pa]  # 3 s of silence the server saw: gone
    assert OWN_STALL < 3.0


def test_heartbeats_to_a_slow_server_do_not_hold_back_the_others():
    """Each server of the stage gets its own heartbeat: one whose register answers take seconds
    (its loop busy, or restarting) must not delay the heartbeats to the others, which would count
    that as the worker's silence."""
    fs, (a,) = one_stage(volunteers=1)
    a.member.heartbeat = 0.1
    devices = sorted(d for d in a.st.servers if d in a.links)
    assert len(devices) >= 2, devices
    slow = devices[0]
    registers = {d: 0 for d in devices}

    async def scenario():
        stop, release, others_beat = asyncio.Event(), asyncio.Event(), asyncio.Event()

        def wrap(device, plain):
            async def call(method, meta, tensors=(), timeout=30.0):
                if method == "register":
                    registers[device] += 1
                    if device == slow:
                        await release.wait()  # its answer comes only once the test has seen the others
                    elif all(registers[d] >= 4 for d in devices[1:]):
                        others_beat.set()
                return await plain(method, meta, tensors, timeout)

            return call

        for d in devices:
            a.links[d].call = wrap(d, a.links[d].call)
        beat = asyncio.ensure_future(a.member.heartbeat_loop(stop))
        await asyncio.wait_for(others_beat.wait(), 60)  # four beats each while the slow one hangs
        assert registers[slow] == 1
        stop.set()
        release.set()
        await beat

    asyncio.run(scenario())
    assert registers[slow] == 1
    assert all(registers[d] >= 4 for d in devices[1:]), registers


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
        worker.intake.ready = [(link, {"task": f"t{i}", "epoch": 0}, ()) for i in range(3)]
        stopping = asyncio.ensure_future(worker.intake.stop_waiting())
        await asyncio.sleep(0)  # it reached the gather of hand-backs, whose tasks have not started
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        return worker.intake.ready

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
    fs.clock = lambda: now[0]
    peers = [f"peer-v{i}" for i in range(30)]

    fs.registry.admissions = TokenBucket(1.0, 10_000)  # (thirty joins at one frozen instant: not the limit tested here)

    async def register(peer):
        await LocalLink(fs, peer).call("register", {"device": peer[5:], "compute": 1.0, "stage": 0})

    def stats():
        return fs.report.announcement("online", [], 1.0, servers).stats

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
        fs.maybe_step()
        await asyncio.sleep(0)

    async def scenario():
        for p in peers:
            await register(p)
            fs.arrivals.note_contribution(p, fs.version)
            fs.passed_check(p, [])
        assert stats()["clients_joined"] == 30 and stats()["clients_left"] == 0
        fs.registry.drop_disconnected_clients({peers[0]})
        now[0] += DISCONNECT_GRACE
        assert len(fs.registry.drop_disconnected_clients({peers[0]})) == 29
        assert stats()["clients_joined"] == 30 and stats()["clients_left"] == 29
        await step()
        assert set(fs.arrivals.contributed) == set(peers)  # a rollback may still reach their batch 0
        for _ in range(fs.shard.keep_versions + RETAIN):
            await step()
        assert set(fs.arrivals.contributed) == {peers[0]} and set(fs.arrivals.checks_passed) == {peers[0]}
        await register(peers[1])  # back: counted once, on probation again
        assert stats()["clients_joined"] == 30 and stats()["clients_left"] == 28
        assert fs.arrivals.checks_passed.get(peers[1], 0) == 0

    asyncio.run(scenario())


def test_a_client_that_never_held_a_task_cannot_complete_it():
    """A registered client completing a task it never held (with `complete`, a take's or a
    heartbeat's carried list) changes nothing: the task stays leased to its holder, who completes it
    (a stranger that closed it could leave it undone for good if the holder then died). A holder
    whose lease ran out may still complete it."""
    from parameter_server.leases import NOT_HELD

    cfg, layout, run = make_run(steps=1, stages=1)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=1, servers_compute=False)
    fs = swarm.servers[layout.stages[0].frontal[0]]
    fs.frontal.min_client_rows = 1  # --client-batch-tokens 1: both clients get tasks of the batch
    (a,) = swarm.workers
    holder = a.links[fs.device_id]
    stranger = LocalLink(fs, "peer-stranger")
    hello = {"device": "x", "compute": 1.0, "stage": 0}

    async def scenario():
        await a.member.register()
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
