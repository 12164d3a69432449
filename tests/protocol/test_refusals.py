"""Refusals carry a code (core/protocol/refusals.py): a server's refusal reaches the caller as
RemoteError.refusal, and a client's choice (retry after the layout, register, stop for good, give a
delivery up) follows the code whatever the words say."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from core.protocol.refusals import Refusal
from core.protocol.wire import PayloadError, RemoteError
from parameter_server.outbox import Outbox
from peer.server_links import LocalLink
from tests.swarm.inprocess import InProcessSwarm, make_run


def test_a_code_survives_the_answer_and_an_unknown_one_is_a_bad_request():
    answer = PayloadError("words that say nothing a program should read", Refusal.STALE_EPOCH).answer()
    assert answer == {"error": "words that say nothing a program should read", "refusal": "stale_epoch"}
    e = RemoteError.of("s0f0.take", answer)
    assert e.refusal is Refusal.STALE_EPOCH and str(e).startswith("s0f0.take: words")
    assert RemoteError.of("x", {"error": "no code"}).refusal is Refusal.BAD_REQUEST  # (an older peer's answer)
    assert RemoteError.of("x", {"error": "?", "refusal": "made_up"}).refusal is Refusal.BAD_REQUEST
    assert {r for r in Refusal if r.final} == {Refusal.BANNED, Refusal.NOT_ALLOWED}


def test_a_servers_refusals_carry_their_codes():
    cfg, layout, run = make_run(steps=2)
    swarm = InProcessSwarm(cfg, layout, run, volunteers_per_stage=0, servers_compute=False)
    server = swarm.servers["s0f0"]
    server.registry.volunteers_allow = frozenset({"peer-listed"})

    async def code(sender, method, meta):
        with pytest.raises(RemoteError) as caught:
            await LocalLink(server, sender).call(method, meta)
        return caught.value.refusal

    async def scenario():
        register = {"device": "x", "compute": 1.0, "stage": 0}
        assert await code("peer-other", "register", register) is Refusal.NOT_ALLOWED
        assert await code("peer-listed", "take", {}) is Refusal.NOT_REGISTERED
        assert await code("peer-listed", "take", {"epoch": 5}) is Refusal.FUTURE_EPOCH
        assert await code("peer-listed", "register", {"device": 3}) is Refusal.BAD_REQUEST
        server.bans.ban_here("peer-listed", "a test's ban")
        assert await code("peer-listed", "take", {}) is Refusal.BANNED

    asyncio.run(scenario())


class _Refusing:
    def __init__(self, refusal: Refusal, text: str):
        self.refusal, self.text, self.calls = refusal, text, 0

    async def call(self, method, meta, tensors, timeout):
        self.calls += 1
        raise RemoteError(self.text, self.refusal)


def _sender(link) -> Outbox:
    layout = SimpleNamespace(stages=[SimpleNamespace(servers=["s1f0"])])
    return Outbox("s0b0", layout=lambda: layout, epoch=lambda: 0, connector=lambda device: link)


@pytest.mark.parametrize(
    "refusal, calls",
    [(Refusal.ALREADY_APPLIED, 1), (Refusal.STALE_EPOCH, 1), (Refusal.BAD_REQUEST, 3)],
)
def test_a_delivery_gives_up_on_the_code_not_the_words(refusal, calls):
    """A delivery refused as already applied or of a stale epoch is not owed any more: given up at
    once, whatever the refusal's words (here words that name neither); any other is tried again."""
    link = _Refusing(refusal, "words that name no reason")
    taken = asyncio.run(_sender(link).deliver_loop("s1f0", "push_outputs", {}, [], attempts=3))
    assert taken is False and link.calls == calls
