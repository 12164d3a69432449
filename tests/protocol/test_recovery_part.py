"""A server's request-log replay (parameter_server/recovery.py) as a part on its own, with fake roles
and handlers: the logged forward tasks come back with their very cut, the micro-batches never cut are
cut now, every logged request goes through the handlers while `replaying` (and only then), and what
a backward server owes the next stage is sent again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from parameter_server.datapath import DataPath
from parameter_server.place import ServerPlace
from parameter_server.recovery import Recovery
from taskpool import TaskPool


def make(place):
    dp = DataPath(seg=(0, 4), pool=TaskPool(clock=lambda: 0.0, default_timeout=60.0))
    seen = {"handled": [], "cut": [], "built": [], "sent": [], "stepped": 0}
    recovery = None

    async def handle(method, meta, tensors, sender):
        seen["handled"].append((method, recovery.replaying))
        return {"result": "accepted"}, []

    frontal = SimpleNamespace(
        build_inputs=seen["built"].append,
        make_forward_tasks=lambda t, m: seen["cut"].append((t, m)),
        release_waiting=lambda: None,
        relay_input_grads=lambda *args: None,
    )
    backward = SimpleNamespace(send_outputs=lambda t, m: seen["sent"].append((t, m)))
    recovery = Recovery(
        place=place,
        micro_batches=2,
        surface=SimpleNamespace(handle=handle),
        frontal=frontal,
        backward=backward,
        dp=lambda: dp,
        version=lambda: 3,
        maybe_step=lambda: seen.__setitem__("stepped", seen["stepped"] + 1),
    )
    return recovery, dp, seen


def test_the_logged_cut_comes_back_and_the_micro_batches_never_cut_are_cut_now():
    recovery, dp, seen = make(ServerPlace("s0f0", 0, "frontal", 0, False))
    log = [
        ({"task": ["F3.0.0.0-4", 3, 0, 0, 4, "peer-v"]}, []),
        ({"task": ["F4.0.0.0-4", 4, 0, 0, 4, None]}, []),
        ({"method": "complete", "meta": {"task": "F3.0.0.0-4"}, "sender": "peer-v"}, []),
    ]
    assert asyncio.run(recovery.recover(log)) == 3
    assert dp.issued == {"F3.0.0.0-4", "F4.0.0.0-4"} and seen["built"] == [3, 4]
    assert seen["handled"] == [("complete", True)] and not recovery.replaying
    assert dp.next_batch == 5 and sorted(seen["cut"]) == [(3, 1), (4, 1)] and seen["stepped"] == 1


def test_a_backward_server_sends_again_what_it_owes_the_next_stage():
    recovery, dp, seen = make(ServerPlace("s0b0", 0, "backward", 0, False))
    dp.buffers[(3, 0)] = SimpleNamespace(complete=True)
    dp.buffers[(3, 1)] = SimpleNamespace(complete=False)
    asyncio.run(recovery.recover([]))
    assert seen["sent"] == [(3, 0)]


def test_what_is_owed_is_read_from_the_data_path_a_replayed_epoch_made():
    recovery, dp, seen = make(ServerPlace("s0b0", 0, "backward", 0, False))
    dp.buffers[(3, 0)] = SimpleNamespace(complete=True)  # of the epoch before the logged one
    fresh = DataPath(seg=(0, 4), pool=TaskPool(clock=lambda: 0.0, default_timeout=60.0))
    fresh.buffers[(4, 1)] = SimpleNamespace(complete=True)

    async def adopt(method, meta, tensors, sender):  # a logged layout epoch resets the data path
        recovery.dp = lambda: fresh
        return {"ok": True}, []

    recovery.surface.handle = adopt
    asyncio.run(recovery.recover([({"method": "adopt_epoch", "meta": {}, "sender": "peer-s0b0"}, [])]))
    assert seen["sent"] == [(4, 1)]
