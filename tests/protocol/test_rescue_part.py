"""The re-queueing of done work whose results never came (parameter_server/rescue.py) as a part on
its own, on an injected clock: what a server lacks for its next batch and who leased it, when it asks
(after RESCUE_FACTOR x the median step, at least RESCUE_MIN s; not while a ban holds the steps), and
the leasing side: done tasks meeting the missing rows reopened, others left, bad asks refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from core.protocol.tasks import task_id
from core.protocol.wire import PayloadError
from parameter_server.datapath import DataPath
from parameter_server.place import ServerPlace
from parameter_server.rescue import RESCUE_MIN, RESCUE_PERIOD, Rescue, gaps
from taskpool import Task, TaskKind, TaskPool

STAGE = SimpleNamespace(frontal=("s0f0", "s0f1"), backward=("s0b0",))


def make(place, *, intervals=None, buffers=None, held=False, version=3):
    state = {"signals": 0, "calls": []}
    shard = SimpleNamespace(
        version=version,
        micro_batches=2,
        rows_per_micro=4,
        batches={version: SimpleNamespace(intervals=intervals or {})},
    )
    pool = TaskPool(clock=lambda: 0.0, default_timeout=60.0)
    dp = DataPath(seg=(0, 4), pool=pool, buffers=buffers or {})

    async def call(device, method, meta):
        state["calls"].append((device, method, meta))
        return {"reopened": ["F3.0.0.0-2"]}, []

    def server_sender(sender, stage, *roles):
        if not sender.startswith("peer-s0"):
            raise PayloadError(f"{sender} is not a server of stage {stage}")
        return sender

    rescue = Rescue(
        place=place,
        rows=4,
        micro_batches=2,
        steps=10,
        stage_servers=lambda: STAGE,
        shards=lambda: {0: shard},
        dp=lambda: dp,
        version=lambda: version,
        epoch=lambda: 1,
        replaying=lambda: False,
        steps_held=lambda: held,
        step_times={0: 0.0, 1: 1.0, 2: 2.0},
        outbox=None,
        call=call,
        server_sender=server_sender,
        signal_tasks=lambda: state.__setitem__("signals", state["signals"] + 1),
        counters={},
    )
    return rescue, state, pool, dp.issued


def test_gaps_are_the_rows_no_interval_covers():
    assert (
        gaps([(0, 2), (3, 4)], 0, 6) == [(2, 3), (4, 6)] and gaps([], 1, 3) == [(1, 3)] and gaps([(0, 9)], 2, 5) == []
    )


def test_the_last_stage_asks_its_frontal_servers_for_the_rows_it_lacks():
    place = ServerPlace("s0b0", 0, "backward", 0, True)
    rescue, _, _, _ = make(place, intervals={0: [(0, 4)], 1: [(0, 1)]})
    # micro-batch 1 lacks rows 1..4: rows 0-1 are s0f0's segment, 2-3 s0f1's (4 rows, 2 frontal servers)
    assert rescue.missing_work() == {"s0f0": ("forward", 3, [(1, 1, 2)]), "s0f1": ("forward", 3, [(1, 2, 4)])}


def test_an_earlier_stage_asks_for_gradients_and_for_the_outputs_it_lacks():
    place = ServerPlace("s0b0", 0, "backward", 0, False)
    full = SimpleNamespace(covered=[(0, 4)])
    rescue, _, _, _ = make(place, intervals={0: [(0, 4)], 1: [(0, 4)]}, buffers={(3, 0): full})
    assert rescue.missing_work() == {"s0f0": ("forward", 3, [(1, 0, 2)]), "s0f1": ("forward", 3, [(1, 2, 4)])}


def test_it_asks_after_the_batch_waited_long_enough_and_not_while_a_ban_holds_the_steps():
    place = ServerPlace("s0b0", 0, "backward", 0, True)
    rescue, _, _, _ = make(place)
    assert not rescue.rescue_due(100.0)  # the wait starts now
    assert not rescue.rescue_due(100.0 + RESCUE_MIN - 0.1)
    assert rescue.rescue_due(100.0 + RESCUE_MIN)
    rescue.rescued_at = 100.0 + RESCUE_MIN
    assert not rescue.rescue_due(100.0 + RESCUE_MIN + RESCUE_PERIOD - 0.1)
    held, _, _, _ = make(place, held=True)
    assert not held.rescue_due(0.0) and not held.rescue_due(1e6)


def test_the_asks_go_to_each_leasing_server_with_the_epoch():
    place = ServerPlace("s0b0", 0, "backward", 0, True)
    rescue, state, _, _ = make(place, intervals={0: [(0, 4)], 1: [(0, 2)]})
    assert asyncio.run(rescue._rescue()) == 1 and not rescue.rescuing
    assert state["calls"] == [
        ("s0f1", "requeue_missing", {"kind": "forward", "batch": 3, "pieces": [[1, 2, 4]], "epoch": 1})
    ]


def test_a_leasing_server_reopens_only_done_tasks_that_meet_the_missing_rows():
    place = ServerPlace("s0f0", 0, "frontal", 0, False)
    rescue, state, pool, issued = make(place)
    for m, rows in [(0, (0, 2)), (1, (0, 2)), (1, (2, 4))]:
        tid = task_id(TaskKind.FORWARD, 3, m, 0, rows)
        pool.add(Task(task_id=tid, kind=TaskKind.FORWARD, batch=3, micro_batch=m, stage=0, rows=rows))
        issued.add(tid)
    done = []
    for _ in range(2):  # two of the three done, one still queued
        lease = pool.take("v")
        pool.complete(lease.task.task_id, "v")
        done.append(lease.task.task_id)
    answer = asyncio.run(
        rescue.on_requeue_missing({"kind": "forward", "batch": 3, "pieces": [[1, 1, 4]]}, [], "peer-s0b0")
    )
    want = sorted(t for t in done if t.startswith("F3.1."))  # micro-batch 1's done tasks meet rows 1..4
    assert want and answer == {"reopened": want} and state["signals"] == 1
    assert all(pool.is_done(t) for t in done if t not in want) and not any(pool.is_done(t) for t in want)
    assert rescue.counters == {"tasks_reopened": len(want)}


@pytest.mark.parametrize(
    "meta, sender, words",
    [
        ({"kind": "backward", "batch": 3, "pieces": []}, "peer-s0b0", "leases forward tasks"),
        ({"kind": "forward", "batch": 3, "pieces": []}, "peer-stranger", "not a server"),
        ({"kind": "forward", "batch": 3, "pieces": [[1, 2]]}, "peer-s0b0", "triples"),
        ({"kind": "forward", "batch": 3, "pieces": [[1, 2, True]]}, "peer-s0b0", "triples"),
    ],
)
def test_bad_asks_are_refused_naming_what_is_wrong(meta, sender, words):
    rescue, state, _, _ = make(ServerPlace("s0f0", 0, "frontal", 0, False))
    with pytest.raises(PayloadError, match=words):
        asyncio.run(rescue.on_requeue_missing(meta, [], sender))
    assert state["signals"] == 0
