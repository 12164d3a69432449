"""What every process of a run shares: its DHT node and P2P replica, links to servers (over P2P,
or in-process for a server's own worker through the very same checks), and the server directory
read from the DHT."""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import time

from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.proto.runtime_pb2 import ExpertRequest

from peer.protocol import records
from peer.protocol.links import LinkEmulator
from peer.protocol.wire import PayloadError, RemoteError, pack, unpack

logger = logging.getLogger("hivepipe.node")

# bytes a server received ("<method>.request") and answered ("<method>.response"): every message of a
# run goes to a server or comes back from one, so the servers' counters add up to the run's traffic
TRAFFIC: collections.Counter = collections.Counter()


def start_dht(initial_peers=(), *, identity_path: str | None = None, client_mode: bool = False,
              host: str = "127.0.0.1", port: int = 0) -> DHT:
    kwargs = dict(initial_peers=list(initial_peers) or None, start=True, client_mode=client_mode,
                  await_ready=True)
    if not client_mode:
        kwargs["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
    if identity_path:
        kwargs["identity_path"] = identity_path
    return DHT(**kwargs)


def visible_maddrs(dht: DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


class P2PLink:
    """A server seen over hivemind P2P."""

    def __init__(self, p2p, peer_id: str, device: str, servicer_cls, links: LinkEmulator | None = None):
        self.peer_id = peer_id
        self.device = device
        self._stub = servicer_cls.get_stub(p2p, PeerID.from_base58(peer_id))
        self.links = links or LinkEmulator()

    # every server method is safe to repeat (gradient credits, relays and ledger entries are
    # de-duplicated by task and rows) except `take`, whose lost answer is a lease that will expire
    NOT_RETRIED = frozenset({"take"})

    async def call(self, method: str, meta: dict, tensors=(), timeout: float = 30.0):
        """One request; a connection that closes before answering is retried (but for `take`), then
        raised as ConnectionError."""
        attempts = 1 if method in self.NOT_RETRIED else 3
        for attempt in range(attempts):
            try:
                return await self._call_once(method, meta, tensors, timeout)
            except ConnectionError:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.1 * (attempt + 1))

    async def _call_once(self, method: str, meta: dict, tensors, timeout: float):
        messages = pack(meta, list(tensors), ExpertRequest)
        await self.links.send(self.device, sum(m.ByteSize() for m in messages))

        async def stream():
            for m in messages:
                yield m

        async def roundtrip():
            responses = await getattr(self._stub, f"rpc_{method}")(stream())
            try:
                return await unpack(responses)
            except PayloadError as e:
                if str(e) == "empty request":
                    raise ConnectionError(f"{self.device}.{method}: the connection closed before an answer") from None
                raise

        meta_r, tensors_r = await asyncio.wait_for(roundtrip(), timeout)
        if "error" in meta_r:
            raise RemoteError(f"{self.device}.{method}: {meta_r['error']}")
        return meta_r, tensors_r


class LocalLink:
    """The server in this very process: same handler, same checks, no network."""

    def __init__(self, server, sender: str):
        self.server = server
        self.peer_id = sender
        self.device = server.device_id
        self.sender = sender

    async def call(self, method: str, meta: dict, tensors=(), timeout: float = 30.0):
        meta_r, tensors_r = await self.server.handle(method, dict(meta), [t.detach().clone() for t in tensors], self.sender)
        if "error" in meta_r:
            raise RemoteError(f"{self.device}.{method}: {meta_r['error']}")
        return meta_r, tensors_r


class Directory:
    """device id -> peer id of the run's servers, refreshed from the stage records."""

    def __init__(self, dht: DHT, run_id: str, num_stages: int):
        self.dht = dht
        self.run_id = run_id
        self.num_stages = num_stages
        self.servers: dict[str, str] = {}
        # every server ever seen (device -> peer id): one read of a key may miss a record that another
        # DHT node holds, so membership checks and calls use this, and losses are confirmed by a call
        self.known: dict[str, str] = {}
        self.versions: dict[str, int] = {}  # server device -> announced parameter version
        self.epochs: dict[str, int] = {}  # server device -> the layout epoch of that announcement
        self.records: dict[str, dict] = {}  # peer id -> record (servers and clients)

    async def refresh(self) -> dict[str, str]:
        servers, recs, versions, epochs = {}, {}, {}, {}
        for k in range(self.num_stages):
            for peer, rec, problem in await records.read_stage(self.dht, self.run_id, k):
                if rec is None:
                    logger.debug("ignoring a malformed record under stage %d: %s", k, problem)
                    continue
                recs[peer] = rec
                if rec["kind"] == "server" and rec["state"] != "offline":
                    servers[rec["device"]] = peer
                    versions[rec["device"]] = rec["version"]
                    epochs[rec["device"]] = rec.get("epoch", 0)
        self.servers, self.records, self.versions, self.epochs = servers, recs, versions, epochs
        self.known.update(servers)
        return servers

    async def wait_for(self, devices, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            await self.refresh()
            missing = [d for d in devices if d not in self.servers]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers not found in the DHT: {missing}")
            await asyncio.sleep(0.3)


def watch_parent(parent_pid: int | None) -> None:
    """Exit when the process that started us is gone (so a killed launcher leaves no orphans)."""
    if not parent_pid:
        return
    import threading

    def loop():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=loop, daemon=True).start()
