"""Calls to a server: over hivemind P2P (`P2PLink`, one session a server, dialled at the addresses
its record announces) or in-process for a server's own worker through the very same checks
(`LocalLink`), and the health of each server's link (`LinkHealth`: its backoff and its log lines)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto.runtime_pb2 import ExpertRequest

from core.protocol import methods
from core.protocol.links import LinkEmulator
from core.protocol.session import Sessions
from core.protocol.session import handle_name as session_handler
from core.protocol.wire import STALL_SECONDS, PayloadError, RemoteError, StreamCut, pack, payload_bytes, unpack

logger = logging.getLogger("hivepipe.node")


def describe(error: BaseException) -> str:
    """The last line of an exception's message (the daemon's are long), or its type."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]


class DialError(ConnectionError):
    """The server could not be connected to at its announced addresses (or is in its backoff)."""


class LinkHealth:
    """Whether calls to one server get through, and the logging of it: one line when it starts
    failing, one a minute (with a count) while it goes on, one when it answers again; never a
    traceback. While it fails, dialling it again backs off (0.5 s doubling to `max_backoff`), but
    for addresses other than those of the last failed dial: a server that restarted announces new
    ones (a fresh port) once it serves, and is dialled there at once."""

    def __init__(self, name: str, clock=time.monotonic, period: float = 60.0, max_backoff: float = 5.0):
        self.name, self.clock, self.period, self.max_backoff = name, clock, period, max_backoff
        self.failing_since: float | None = None
        self.failures = 0  # consecutive
        self._unlogged = 0
        self._logged_at = 0.0
        self.next_try = 0.0
        self.failed_addresses: frozenset[str] | None = None  # where the last failed dial went

    def failed(self, error: BaseException | str, dial: bool = True, addresses=None) -> None:
        """A failed attempt; `dial` says the server could not even be connected to (only that
        backs off: a call cut short on a live connection is tried again at once); `addresses`:
        where it was dialled."""
        now = self.clock()
        self.failures += 1
        if dial and addresses:
            self.failed_addresses = frozenset(addresses)
        if self.failing_since is None:
            self.failing_since = now
        # one call cut short is common on a busy link: backoff and a log line start at the second
        # failure in a row
        if self.failures < 2:
            return
        if dial:
            self.next_try = now + min(0.5 * 2 ** (self.failures - 2), self.max_backoff)
        why = error if isinstance(error, str) else describe(error)
        if self.failures == 2:
            self._logged_at, self._unlogged = now, 0
            logger.warning("cannot reach %s: %s; retrying with backoff", self.name, why)
        elif now - self._logged_at >= self.period:
            logger.warning(
                "still cannot reach %s after %.0f s (%d more failed attempts): %s",
                self.name,
                now - self.failing_since,
                self._unlogged + 1,
                why,
            )
            self._logged_at, self._unlogged = now, 0
        else:
            self._unlogged += 1

    def succeeded(self) -> None:
        if self.failures >= 2:
            logger.warning("reached %s again after %.0f s", self.name, self.clock() - self.failing_since)
        self.failing_since, self.failures, self.next_try, self.failed_addresses = None, 0, 0.0, None

    def backing_off(self, addresses=None) -> float:
        """Seconds until the next dial may be tried (0 when it may now, or when `addresses` are not
        those where the last dial failed)."""
        if addresses and self.failed_addresses is not None and frozenset(addresses) != self.failed_addresses:
            return 0.0
        return max(self.next_try - self.clock(), 0.0)


# peer id -> its health, shared by every link of this process to that peer
HEALTH: dict[str, LinkHealth] = {}


def health_of(peer_id: str, device: str) -> LinkHealth:
    if peer_id not in HEALTH:
        HEALTH[peer_id] = LinkHealth(f"{device} ({peer_id[-8:]})")
    return HEALTH[peer_id]


class P2PLink:
    """A server seen over hivemind P2P. Before its first call, and after any failed one, it
    connects to the server at the multiaddrs the server's record announces (`addresses()`): libp2p
    can reach a peer only at addresses it knows, and a volunteer knows only its initial peer's."""

    def __init__(
        self,
        p2p,
        peer_id: str,
        device: str,
        links: LinkEmulator | None = None,
        addresses: Callable[[], list[str]] | None = None,
        backoff: bool = True,
        compress: str = "none",
    ):
        self.p2p = p2p
        self.compress = compress  # the run's --compress (core/protocol/codecs.py)
        self.peer_id = peer_id
        self.device = device
        self._session_handler = session_handler()
        self.links = links or LinkEmulator()
        self.addresses = addresses
        self.health = health_of(peer_id, device)
        self.backoff = backoff  # False for a liveness probe: it must really try
        self._dialled = False

    async def dial(self) -> None:
        """Connect to the server at its announced addresses (a no-op for a peer already connected)."""
        maddrs = self.addresses() if self.addresses is not None else []
        wait = self.health.backing_off(maddrs) if self.backoff else 0.0
        if wait > 0:
            raise DialError(f"{self.device}: unreachable, next dial in {wait:.1f} s")
        if maddrs:
            from multiaddr import Multiaddr

            try:
                await asyncio.wait_for(
                    self.p2p._client.connect(
                        PeerID.from_base58(self.peer_id), [Multiaddr(m.split("/p2p/")[0]) for m in maddrs]
                    ),
                    15.0,
                )
            except Exception as e:
                self.health.failed(e, addresses=maddrs)
                raise DialError(f"{self.device}: cannot connect at {' '.join(maddrs)}: {e}") from None
        self._dialled = True

    def retry_in(self) -> float:
        """Seconds until this server may be dialled again (0 when now)."""
        return self.health.backing_off(self.addresses() if self.addresses is not None else None)

    async def call(self, method: str, meta: dict, tensors=(), timeout: float = 30.0):
        """One request; a connection that closes before answering is retried (but for `take`), then
        raised as ConnectionError. A refusal by the server (RemoteError) says nothing of the link."""
        attempts = 1 if method in methods.NOT_RETRIED else 3
        for attempt in range(attempts):
            try:
                if not self._dialled:
                    await self.dial()
                result = await self._call_once(method, meta, tensors, timeout)
            except RemoteError:
                self.health.succeeded()
                raise
            except P2PDaemonError as e:
                # the daemon could not open the stream: the peer is gone, or up but not serving yet
                # ("protocols not supported" while a restarted server loads its checkpoint). Counted as
                # a failed dial, so that callers back off instead of spinning on it.
                self.health.failed(e, dial=True, addresses=self.addresses() if self.addresses is not None else None)
                self._dialled = False
                raise DialError(f"{self.device}.{method}: {describe(e)}") from None
            except Exception as e:
                if not isinstance(e, DialError):  # (a failed dial is counted where it happens)
                    self.health.failed(e, dial=False)
                self._dialled = False
                if not isinstance(e, ConnectionError) or attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.1 * (attempt + 1))
            else:
                self.health.succeeded()
                return result

    async def _call_once(self, method: str, meta: dict, tensors, timeout: float):
        messages = pack(
            meta,
            list(tensors),
            ExpertRequest,
            compress=self.compress if method in methods.COMPRESSED_REQUESTS else "none",
        )
        size = payload_bytes(messages)
        await self.links.send(self.device, size)
        started = time.monotonic()

        async def roundtrip():
            sessions = Sessions.of(self.p2p)
            try:
                session = await sessions.get(self.peer_id, self._session_handler)
            except FileNotFoundError as e:  # (the local p2p daemon's control socket: this peer is closing)
                raise ConnectionError(f"{self.device}.{method}: this peer's p2p daemon is gone: {e}") from None
            try:
                # the answer's messages follow each other at once: one that stalls cuts the call
                return await unpack(session.call(method, messages), stall=STALL_SECONDS, accept=self.compress)
            except StreamCut as e:
                sessions.drop(self.peer_id, session)  # (a stalled answer stalls the session's others too)
                logger.debug("%s.%s: answer cut after %.1f s: %s", self.device, method, time.monotonic() - started, e)
                raise StreamCut(f"{self.device}.{method}: {e}", meta=e.meta) from None
            except PayloadError as e:
                if str(e) == "empty request":
                    sessions.drop(self.peer_id, session)
                    raise ConnectionError(f"{self.device}.{method}: the connection closed before an answer") from None
                raise

        try:  # the deadline covers the whole call: the request, the handler's work, every answer message
            meta_r, tensors_r = await asyncio.wait_for(roundtrip(), timeout)
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(f"{self.device}.{method}: no complete answer within {timeout:.0f} s") from None
        if "error" in meta_r:
            raise RemoteError.of(f"{self.device}.{method}", meta_r)
        return meta_r, tensors_r


class LocalLink:
    """The server in this very process: same handler, same checks, no network."""

    def __init__(self, server, sender: str):
        self.server = server
        self.peer_id = sender
        self.device = server.device_id
        self.sender = sender

    async def call(self, method: str, meta: dict, tensors=(), timeout: float = 30.0):
        meta_r, tensors_r = await self.server.surface.handle(
            method, dict(meta), [t.detach().clone() for t in tensors], self.sender
        )
        if "error" in meta_r:
            raise RemoteError.of(f"{self.device}.{method}", meta_r)
        return meta_r, tensors_r
