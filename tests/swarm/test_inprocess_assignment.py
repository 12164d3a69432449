"""Who is given which rows, in one event loop through the servers' real handlers: a micro-batch
whole to the clients owed the most rows, a batch whole to one client and the next to the next, a
free server worker first, the oldest batch first, and takes told whether more tasks wait."""

from __future__ import annotations

import asyncio

from tests.swarm.inprocess import InProcessSwarm, make_run, one_worker_on_a_clock


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
    assert fs.frontal.min_task_rows == 16  # 512 tokens of 32 (tiny): a whole micro-batch
    fs.frontal.min_client_rows = 1  # --client-batch-tokens 1: no batch is held to fewer clients
    for name in ("c1", "c2", "c3", "c4"):
        fs.clients[f"peer-{name}"] = ClientInfo(name, 1.0, fs.clock())
    made = []
    fs.leases.add_task = made.append

    def cut(micro_batches: int) -> collections.Counter:
        made.clear()
        for m in range(micro_batches):
            fs.frontal.make_forward_tasks(0, m % run.micro_batches)
        rows = collections.Counter()
        for task in made:
            rows[task.preferred_client] += task.rows[1] - task.rows[0]
        return rows

    rows = cut(4)
    assert len(made) == 4 and sorted(rows.values()) == [4, 4, 4, 4]  # one whole micro-batch each
    fs.clients["peer-c1"].compute = 2.0  # c1 is twice as fast as each other client
    fs.frontal.task_credit.clear()
    rows = cut(20)
    assert rows["peer-c1"] == 2 * rows["peer-c2"] == 2 * rows["peer-c3"] == 2 * rows["peer-c4"] == 32
    fs.frontal.min_task_rows = 1  # --task-tokens 1: every client gets a share of every micro-batch, as before
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
    assert fs.frontal.min_client_rows == 64
    for name in ("c1", "c2", "c3", "c4"):
        fs.clients[f"peer-{name}"] = ClientInfo(name, 1.0, fs.clock())
    made = []
    fs.leases.add_task = made.append
    for t in range(8):
        for m in range(run.micro_batches):
            fs.frontal.make_forward_tasks(t, m)
    by_batch = {t: {task.preferred_client for task in made if task.batch == t} for t in range(8)}
    assert all(len(clients) == 1 for clients in by_batch.values())
    assert [by_batch[t] | by_batch[t + 4] for t in range(4)] == [{f"peer-c{i}"} for i in range(1, 5)]
    assert sorted(fs.batch_members) == list(range(8))
    fs.updates.forget_before(6)  # what is kept of a batch goes with its rows
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
        fs.frontal.local_first = local_first
        for name in (*st.servers, "v1", "v2"):
            fs.clients[f"peer-{name}"] = ClientInfo(name, 1.0, fs.clock())
        made = []
        fs.leases.add_task = made.append
        for t in range(8):
            fs.shard.version = max(t - 1, 0)  # batch t is cut once version t - 1 is made; t - 1 is in flight
            for m in range(run.micro_batches):
                fs.frontal.make_forward_tasks(t, m)
        by_batch = [{task.preferred_client for task in made if task.batch == t} for t in range(8)]
        assert all(len(clients) == 1 for clients in by_batch)
        return [clients.pop().removeprefix("peer-") for clients in by_batch]

    local = members_by_batch(True)
    assert set(local) == set(st.servers) and all(a != b for a, b in zip(local, local[1:]))
    spread = members_by_batch(False)
    assert sorted(spread) == sorted([*st.servers, "v1", "v2"] * 2)


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
    handle = fs.surface.handle
    waiting_take = asyncio.Event()  # a take that waits for a task reached the server

    async def counted(method, meta, *args, **kwargs):
        if method == "take":
            takes.append(meta.get("wait", 0.0))
            if takes[-1] > 0:
                waiting_take.set()
        return await handle(method, meta, *args, **kwargs)

    fs.surface.handle = counted

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
        await asyncio.wait_for(waiting_take.wait(), 2.0)
        await link.call("fail", {"task": held[0]})  # a task queued there again
        got = await asyncio.wait_for(waiting, 2.0)
        assert got[1]["task"] == held[0] and got[1]["more"] is False
        assert takes[n:] == [3.0]  # one waiting take, no take answered at once
        stop.set()
        await a.intake.stop_waiting()

    asyncio.run(scenario())
