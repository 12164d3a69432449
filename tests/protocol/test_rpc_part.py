"""A server's calls in (parameter_server/rpc.py) as a part on its own, with fake handlers: a call is
dispatched to its handler after the caller's right (server-only methods, a banned peer) and the
layout epoch are checked; a refusal or a bug is answered with its code and changes nothing; what
changes state is written to the request log, a duplicate or a replay not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from core.protocol.refusals import Refusal
from core.protocol.wire import PayloadError
from parameter_server.rpc import RpcSurface


class Log:
    def __init__(self):
        self.records = []

    def append(self, record, tensors):
        self.records.append(record)


def make(replaying=False):
    calls, log, counters = [], Log(), {"payload_errors": 0}

    async def push_grads(meta, tensors, sender):
        calls.append(("push_grads", meta, sender))
        return {"result": meta.get("result", "credited")}

    async def crash(meta, tensors, sender):
        raise RuntimeError("a bug")

    def only_servers(sender):
        if not sender.startswith("peer-s"):
            raise PayloadError("only its servers may call this")

    def check_epoch(meta):
        if meta.get("epoch", 0) != 1:
            raise PayloadError("stale epoch", Refusal.STALE_EPOCH)

    def refuse_banned(sender):
        if sender == "peer-liar":
            raise PayloadError("banned", Refusal.BANNED)

    surface = RpcSurface(
        device_id="s0f0",
        compress="none",
        links=None,
        request_budget=None,
        max_request_bytes=1 << 20,
        max_client_request_bytes=1 << 16,
        counters=counters,
        directory=SimpleNamespace(is_server=lambda p: p.startswith("peer-s")),
        checks=SimpleNamespace(only_servers=only_servers, check_epoch=check_epoch),
        arrivals=SimpleNamespace(refuse_banned=refuse_banned),
        handler_of=lambda method: {"push_grads": push_grads, "take": crash, "ban": push_grads}[method],
        device_of=lambda peer: None,
        log=lambda: log,
        replaying=lambda: replaying,
    )
    return surface, calls, log, counters


def test_a_call_is_dispatched_and_logged_once_its_right_and_epoch_are_checked():
    surface, calls, log, _ = make()
    answer, tensors = asyncio.run(surface.handle("push_grads", {"batch": 3, "epoch": 1}, [], "peer-v1"))
    assert answer == {"result": "credited"} and tensors == [] and calls[0][2] == "peer-v1"
    assert log.records == [{"method": "push_grads", "meta": {"batch": 3, "epoch": 1}, "sender": "peer-v1", "batch": 3}]
    asyncio.run(surface.handle("push_grads", {"batch": 3, "epoch": 1, "result": "duplicate"}, [], "peer-v1"))
    assert len(log.records) == 1  # a duplicate changes nothing: not logged


def test_refusals_and_bugs_are_answered_with_their_code_and_change_nothing():
    surface, calls, log, counters = make()
    for method, meta, sender, code in [
        ("push_grads", {"epoch": 0}, "peer-v1", Refusal.STALE_EPOCH),
        ("push_grads", {"epoch": 1}, "peer-liar", Refusal.BANNED),
        ("ban", {}, "peer-v1", Refusal.BAD_REQUEST),  # a server-only method
        ("take", {"epoch": 1}, "peer-v1", Refusal.INTERNAL),
    ]:
        answer, _ = asyncio.run(surface.handle(method, meta, [], sender))
        assert answer["refusal"] == code.value, (method, answer)
    assert calls == [] and log.records == [] and counters["payload_errors"] == 3


def test_the_largest_request_is_a_servers_for_a_server_a_volunteers_for_anyone_else():
    surface, _, _, _ = make()
    assert surface.request_limit("peer-s0b0") == 1 << 20 and surface.request_limit("peer-v1") == 1 << 16


def test_a_replay_is_not_logged_again():
    surface, calls, log, _ = make(replaying=True)
    asyncio.run(surface.handle("push_grads", {"batch": 3, "epoch": 1}, [], "peer-v1"))
    assert calls and log.records == []
