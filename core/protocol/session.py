"""Calls to one server multiplexed over one long-lived P2P stream (a session) instead of a stream a
call. Opening a stream costs both p2p daemons more than the call itself (a connection to the local
daemon, a new libp2p stream, its protocol negotiation, a connection from the remote daemon to the
handler); over an open stream a call is its messages only. Measured on loopback (processor time of
both ends and both daemons): an empty call 1.8 ms against 5.5 ms as a stream of its own (and 1.8 ms
as one unary message over the daemon's control connection, which was tried for small calls); 1 MiB
8.7 ms against 12.9 (22.9 unary, which costs more per byte). docs/bench_swarm.md has the hop table.

Framing: every message of a call, both ways, carries in its `uid` field the call's number, its
method and, on its last message, "end": `"7 push_grads"`, ..., `"7 push_grads end"`. The caller
numbers its calls; the server runs each call as it would a stream call of its own (the same
handler, the same limits) as soon as its first message arrives, several at once, and answers each
as it finishes, in any order. A session that breaks ends every call still open on it: an answer
cut short reads as a stream that ended early (wire.unpack: StreamCut, or an empty answer), and the
next call opens a new session. Malformed framing ends the session with an error naming it."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import AsyncIterator, Callable

from core.protocol import methods
from core.protocol.wire import PayloadError, StreamCut

logger = logging.getLogger("hivepipe.session")

MAX_OPEN_CALLS = 64  # calls of one session whose request has not fully arrived
MAX_UID = 64
_END = "end"


STAGE_SERVICE = "StageServer"  # the class name the stage servers' handlers are registered under


def handle_name(service: str = STAGE_SERVICE) -> str:
    """The P2P handler name of service `service`'s `rpc_session`: hivemind's ServicerBase registers a
    servicer's `rpc_*` methods as `<class name>.<method>`, so a client needs only the name, not the
    server's class (tests/protocol/test_session.py checks it against the server class's own)."""
    return f"{service}.rpc_session"


def tag(message, call: int, method: str, last: bool):
    message.uid = f"{call} {method} {_END}" if last else f"{call} {method}"
    return message


def parse(uid: str) -> tuple[int, str, bool]:
    """(call, method, last) of a message's uid; PayloadError naming what is wrong."""
    parts = uid.split(" ") if len(uid) <= MAX_UID else []
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != _END) or not parts[0].isdigit():
        raise PayloadError(f"session message uid {uid[:MAX_UID]!r} is not '<call> <method>[ end]'")
    if parts[1] not in methods.METHODS:
        raise PayloadError(f"session call {parts[0]}: unknown method {parts[1]!r}")
    return int(parts[0]), parts[1], len(parts) == 3


class Session:
    """The caller's end of one session with one server: the stream read and written here (hivemind's
    stream calls wait for the requests to end before they report the answers' end, so a session
    whose server went away would not be seen to end until its next call)."""

    def __init__(self):
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.pending: dict[int, asyncio.Queue] = {}
        self.next_call = 0
        self.closed = False
        self.reader: asyncio.Task | None = None

    async def open(self, p2p, peer_id: str, handle_name: str) -> "Session":
        """Open the stream to `peer_id`'s handler `handle_name` (a servicer's `rpc_session`)."""
        from hivemind.p2p import PeerID

        try:
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handle_name)
        except BaseException:
            self.closed = True
            raise
        self.reader = asyncio.ensure_future(self._read(reader, writer))
        return self

    async def _write(self, writer) -> None:
        from hivemind.p2p import P2P

        try:
            while (message := await self.outbox.get()) is not None:
                await P2P.send_protobuf(message, writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)  # the server answers what it has, then ends
        except Exception as e:
            logger.debug("session: writing failed: %r", e)
            self.close()

    async def _read(self, reader, writer) -> None:
        from hivemind.p2p import P2P
        from hivemind.proto.runtime_pb2 import ExpertRequest

        writing = asyncio.ensure_future(self._write(writer))
        try:
            while True:
                try:
                    message, error = await P2P.receive_protobuf(ExpertRequest, reader)
                except asyncio.IncompleteReadError:  # the stream ended
                    break
                if error is not None:  # the server ended the session over an error of ours
                    logger.debug("session ended by the server: %s", error.message)
                    break
                call, _, last = parse(message.uid)
                inbox = self.pending.get(call)
                if inbox is None:  # a call given up on (its deadline passed): the answer goes nowhere
                    continue
                inbox.put_nowait(message)
                if last:
                    inbox.put_nowait(None)
                    del self.pending[call]
        except Exception as e:  # the stream broke, or its answers do not frame calls
            logger.debug("session ended: %r", e)
        finally:
            self.close()
            writing.cancel()
            writer.close()

    def call(self, method: str, messages: list) -> AsyncIterator:
        """Send one call's messages; its answer's messages, ending where the answer ends (or, cut
        short, where the session did)."""
        if self.closed:
            raise ConnectionError("the session is closed")
        call, self.next_call = self.next_call, self.next_call + 1
        inbox: asyncio.Queue = asyncio.Queue()
        self.pending[call] = inbox
        for i, message in enumerate(messages):
            self.outbox.put_nowait(tag(message, call, method, i == len(messages) - 1))

        async def answer():
            try:
                while (message := await inbox.get()) is not None:
                    yield message
            finally:
                self.pending.pop(call, None)

        return answer()

    def close(self) -> None:
        """End the session: the stream is closed once what was sent is written, and every call still
        open on it ends."""
        if not self.closed:
            self.closed = True
            self.outbox.put_nowait(None)
        for inbox in self.pending.values():
            inbox.put_nowait(None)
        self.pending.clear()


class Sessions:
    """One session per server for every link of a P2P instance (a link made for one call, as probes
    and the launcher make them, shares it rather than leaving a stream behind), opened on demand."""

    _of: "weakref.WeakKeyDictionary[object, Sessions]" = weakref.WeakKeyDictionary()

    def __init__(self, p2p):
        self.p2p = weakref.ref(p2p)  # (weakly: the registry holds this per P2P instance, which it must not keep)
        self.sessions: dict[str, Session] = {}
        self.locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def of(cls, p2p) -> "Sessions":
        if p2p not in cls._of:
            cls._of[p2p] = cls(p2p)
        return cls._of[p2p]

    async def get(self, peer_id: str, handle_name: str) -> Session:
        session = self.sessions.get(peer_id)
        if session is not None and not session.closed:
            return session
        async with self.locks.setdefault(peer_id, asyncio.Lock()):
            session = self.sessions.get(peer_id)
            if session is None or session.closed:
                session = self.sessions[peer_id] = await Session().open(self.p2p(), peer_id, handle_name)
            return session

    def drop(self, peer_id: str, session: Session) -> None:
        """Close `session` (a call on it failed in transport) unless a newer one replaced it."""
        session.close()
        if self.sessions.get(peer_id) is session:
            del self.sessions[peer_id]


async def serve(
    requests: AsyncIterator, run_call: Callable[[str, AsyncIterator], AsyncIterator], max_call_bytes: int
) -> AsyncIterator:
    """The server's end of a session: each call's request messages go to `run_call(method,
    messages)` (the stream call's handler) as they arrive, its answer's messages come back tagged, in
    the order calls finish. A call whose request passes `max_call_bytes` gets what arrived up to then
    and the rest is dropped (its handler refuses it); one whose last message never comes (the session
    ended first) is answered as a cut stream, not run; more than MAX_OPEN_CALLS unfinished requests,
    or a uid that is not a call's, ends the session with the error."""
    out: asyncio.Queue = asyncio.Queue()
    inboxes: dict[int, tuple[str, asyncio.Queue, list]] = {}  # open requests: method, messages, [bytes]
    running: set[asyncio.Task] = set()
    answered: set[int] = set()  # calls whose handler has answered while their request still arrives
    done, cut_short = object(), object()

    async def one(call: int, method: str, inbox: asyncio.Queue) -> None:
        async def messages():
            while (message := await inbox.get()) is not None:
                if message is cut_short:  # (the handler answers it as a cut stream: it does not run)
                    raise StreamCut(f"the session ended before call {call}'s last message")
                yield message

        try:
            answer = [message async for message in run_call(method, messages())]
        except Exception:  # (the handler answers every error of the call; this is a bug, the caller times out)
            logger.exception("session call %d (%s) failed", call, method)
            return
        finally:
            if call in inboxes:  # answered before its last message (refused): the rest is dropped
                answered.add(call)
                while not inbox.empty():
                    inbox.get_nowait()
        for i, message in enumerate(answer):
            out.put_nowait(tag(message, call, method, i == len(answer) - 1))

    async def feed() -> None:
        try:
            async for message in requests:
                call, method, last = parse(message.uid)
                if call not in inboxes:
                    if len(inboxes) >= MAX_OPEN_CALLS:
                        raise PayloadError(f"more than {MAX_OPEN_CALLS} calls of one session are open")
                    inboxes[call] = (method, asyncio.Queue(), [0])
                    task = asyncio.ensure_future(one(call, method, inboxes[call][1]))
                    running.add(task)
                    task.add_done_callback(running.discard)
                opened, inbox, size = inboxes[call]
                if method != opened:
                    raise PayloadError(f"session call {call} is a {opened} call, a message of it says {method}")
                # past max_call_bytes, or once answered (refused early), the rest of a call is dropped
                if size[0] <= max_call_bytes and call not in answered:
                    size[0] += message.ByteSize()
                    inbox.put_nowait(message)
                if last:
                    inbox.put_nowait(None)
                    del inboxes[call]
                    answered.discard(call)
        except Exception as e:
            out.put_nowait(e)
        else:
            cut()
            if running:
                await asyncio.wait(set(running))
            out.put_nowait(done)
        finally:
            cut()

    def cut() -> None:
        """The session ended (closed by its caller, broken, or refused): its open calls are cut, and a
        request without its last message is not run."""
        for _, inbox, _ in inboxes.values():
            inbox.put_nowait(cut_short)
        inboxes.clear()

    feeder = asyncio.ensure_future(feed())
    try:
        while (item := await out.get()) is not done:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        feeder.cancel()
