"""A stage worker's own behaviour, in one event loop through the servers' real handlers: its
parameter versions (fetched ahead, held before its first take), its emulated device, what it says
of each task, a task it cannot work on, and the heartbeat that tells it the run is over."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
import torch

from core.protocol.tasks import TaskId
from peer.server_links import LocalLink
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.inprocess import TICKETS, InProcessSwarm, make_run


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
    f0.frontal.min_client_rows = 1
    f1.frontal.min_client_rows = 1  # --client-batch-tokens 1: both clients get tasks of every batch
    (a,) = swarm.workers
    other = LocalLink(f0, "peer-other")  # another volunteer, which holds f0's tasks of batches 0 and 1
    took_at_f1 = []
    took = asyncio.Event()  # the worker took a task of f1's
    handle = f1.surface.handle

    async def counted(method, meta, tensors, sender):
        answer = await handle(method, meta, tensors, sender)
        if method == "take" and answer[0].get("task"):
            took_at_f1.append(answer[0]["task"])
            took.set()
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
        f1.surface.handle = counted
        batch0 = sorted(t for s in (f0, f1) for t in s.issued if TaskId.parse(t).batch == 0)
        zeros = [torch.zeros_like(f0.shard.params[n]) for n in f0.shard.names]
        tickets = [TICKETS.issue(t, f0.peer_id, 1, 0) for t in batch0]  # (minted as a server of the run may)
        await LocalLink(f0, f0.peer_id).call(
            "push_grads", {"tasks": batch0, "leases": tickets, "batch": 0, "slot": f0.slot, "loss_sum": 0.0}, zeros
        )
        # (the step waits for f0's replica at f1 to hold version 0: Replicas.behind)
        if f0.version < 1:
            await asyncio.wait_for(f0.updates.step_event.wait(), 30.0)
        assert (f0.version, f1.version) == (1, 0) and f0.pool.open_tasks(2)  # f0 cut batch 2
        assert {h for b in (0, 1) for _, h, _ in f0.pool.open_tasks(b)} == {"peer-other"}  # all held
        stop = asyncio.Event()
        loop = asyncio.ensure_future(a.run_loop(stop))
        took_one = asyncio.ensure_future(took.wait())
        await asyncio.wait([took_one, loop], timeout=15.0, return_when=asyncio.FIRST_COMPLETED)
        took_one.cancel()
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
        assert not b.over and b.links[fs.device_id].sender not in fs.registry.told_over
        await a.member.register()
        assert a.over and fs.registry.told_over == {a.links[fs.device_id].sender}

    asyncio.run(scenario())
