"""Sessions (core/protocol/session.py) between two real hivemind P2P daemons on 127.0.0.1: calls on one
session run at once and are answered as each finishes; a session that breaks ends its open calls as
streams that ended early, and the next call opens a new one."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import msgpack
import pytest
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto.runtime_pb2 import ExpertRequest

from core.protocol import session
from core.protocol.session import Sessions, handle_name
from core.protocol.wire import PayloadError, StreamCut, decode_meta, encode_meta, unpack


class Sleeper(ServicerBase):
    """Answers each call after the seconds its metadata asks for, with its own metadata back."""

    async def rpc_session(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertRequest]:
        async def run_call(method, messages):
            meta = {}
            async for message in messages:
                meta = meta or decode_meta(message.metadata)
            await asyncio.sleep(meta.get("sleep", 0.0))
            yield ExpertRequest(metadata=encode_meta(dict(meta, method=method, n_tensors=0)))

        async for message in session.serve(requests, run_call, 1 << 20):
            yield message


NAME = handle_name(Sleeper.__name__)


async def _peer(of=None, serving: bool = False):
    """A P2P peer on 127.0.0.1, connected to `of` (a peer) if given, serving Sleeper if `serving`."""
    initial = [] if of is None else [str(m) for m in await of.get_visible_maddrs()]
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial)
    if serving:
        await Sleeper().add_p2p_handlers(p2p)
    return p2p


async def _pair():
    server = await _peer(serving=True)
    return server, await _peer(of=server)


def _request(**meta) -> list:
    return [ExpertRequest(metadata=msgpack.packb(dict(meta, n_tensors=0)))]


def test_calls_on_one_session_run_at_once_and_are_answered_as_each_finishes():
    async def main():
        server, client = await _pair()
        try:
            sessions = Sessions.of(client)
            s = await sessions.get(str(server.peer_id), NAME)
            assert await sessions.get(str(server.peer_id), NAME) is s  # one session a server
            finished = []

            async def call(name, sleep):
                meta, _ = await unpack(s.call("ping", _request(name=name, sleep=sleep)))
                finished.append(meta["name"])
                return meta

            answers = await asyncio.gather(call("slow", 1.0), call("fast", 0.0), call("middle", 0.5))
            # answered as each finished, the first sent last: the slow call did not hold the others back
            assert finished == ["fast", "middle", "slow"], finished
            assert [a["method"] for a in answers] == ["ping"] * 3
            s.close()
            await asyncio.wait_for(s.reader, 10)
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())


def test_a_broken_session_ends_its_open_calls_and_the_next_call_opens_a_new_one():
    async def main():
        server, client = await _pair()
        try:
            sessions = Sessions.of(client)
            s = await sessions.get(str(server.peer_id), NAME)
            pending = asyncio.ensure_future(unpack(s.call("ping", _request(sleep=30.0))))
            await asyncio.sleep(0.3)
            await server.shutdown()  # the server's daemon goes: the stream breaks under the open call
            with pytest.raises((StreamCut, PayloadError)):  # (an empty answer: the caller's ConnectionError)
                await asyncio.wait_for(pending, 20)
            await asyncio.wait_for(s.reader, 10)
            assert s.closed
            with pytest.raises(ConnectionError):
                s.call("ping", _request())
            # a server back (a new daemon, a new peer id here): a new session to it
            server = await _peer(of=client, serving=True)
            fresh = await sessions.get(str(server.peer_id), NAME)
            assert fresh is not s and not fresh.closed
            meta, _ = await unpack(fresh.call("status", _request(name="again")))
            assert meta["name"] == "again" and meta["method"] == "status"
            sessions.drop(str(server.peer_id), fresh)
            assert fresh.closed and await sessions.get(str(server.peer_id), NAME) is not fresh
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())


def test_the_clients_handler_name_is_the_one_the_stage_servers_register():
    """Clients name the servers' session handler without importing the server class: the name they
    use is the one hivemind registers StageServer's `rpc_session` under."""
    from parameter_server.service import StageServer

    assert handle_name() == StageServer._get_handle_name(None, "rpc_session")
    assert handle_name() == f"{session.STAGE_SERVICE}.rpc_session"
    assert handle_name(Sleeper.__name__) == Sleeper._get_handle_name(None, "rpc_session")
