"""Can the world dial this server? The question Petals' and hivemind's users ask most.

A server that joins a run asks a peer that already serves it to dial it back at the multiaddrs it
announces. The checker dials from a fresh p2p daemon that knows no other address of the server and
uses no relay, so only a direct TCP connection to an announced address counts. What this module
owns: the `DialBackService` every server (and `peer swarm`'s bootstrap node) offers, the dial
itself, and `check_reachable`, which a starting server runs before it announces anything. It does
not decide what a failed check means for the process: `peer serve` does.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse
from multiaddr import Multiaddr

logger = logging.getLogger("hivepipe.reachability")

DIAL_TIMEOUT = 10.0  # seconds the checker spends dialling one server back
MAX_CHECKED_ADDRS = 8


def split_peer(maddr: str) -> tuple[str, str | None]:
    """('/ip4/1.2.3.4/tcp/5', 'Qm...') from '/ip4/1.2.3.4/tcp/5/p2p/Qm...' (peer id None without it)."""
    if "/p2p/" in maddr:
        addr, peer = maddr.rsplit("/p2p/", 1)
        return addr, peer
    return maddr, None


async def dial(peer_id: str, maddrs: list[str], timeout: float = DIAL_TIMEOUT) -> str | None:
    """Connect to `peer_id` at exactly `maddrs` from a new daemon; None on success, else why not."""
    probe = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, auto_nat=False, nat_port_map=False, dht_mode="client"
    )
    try:
        addrs = [Multiaddr(split_peer(m)[0]) for m in maddrs]
        await asyncio.wait_for(probe._client.connect(PeerID.from_base58(peer_id), addrs), timeout)
        return None
    except asyncio.TimeoutError:
        return f"no answer within {timeout:g} s"
    except Exception as e:
        return str(e).strip().splitlines()[-1][:300] or type(e).__name__
    finally:
        await probe.shutdown()


class DialBackService(ServicerBase):
    """`dial_back`: the caller names its announced multiaddrs; we dial it there and say whether it
    answered. Two checks at a time at most; the addresses are the caller's own (its peer id is the
    one libp2p authenticated), so the service cannot be used to make us dial a third party's peer."""

    def __init__(self, timeout: float = DIAL_TIMEOUT):
        self.timeout = timeout
        self._slots = asyncio.Semaphore(2)

    async def rpc_dial_back(self, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        try:
            meta = msgpack.unpackb(request.metadata, raw=False)
            maddrs = meta["maddrs"]
            if (
                not isinstance(maddrs, list)
                or not 0 < len(maddrs) <= MAX_CHECKED_ADDRS
                or not all(isinstance(m, str) and len(m) < 300 for m in maddrs)
            ):
                raise ValueError("maddrs must be a list of 1 to 8 multiaddr strings")
            for m in maddrs:
                Multiaddr(split_peer(m)[0])
        except Exception as e:
            return ExpertResponse(metadata=msgpack.packb({"error": f"bad dial_back request: {e}"}))
        caller = context.remote_id.to_base58()
        async with self._slots:
            problem = await dial(caller, maddrs, self.timeout)
        logger.info("dialled %s back at %s: %s", caller[-8:], maddrs, problem or "reachable")
        return ExpertResponse(metadata=msgpack.packb({"ok": problem is None, "problem": problem}))


async def ask_dial_back(
    p2p: P2P, checker: str, checker_maddrs: list[str], own_maddrs: list[str], timeout: float
) -> dict:
    """Ask `checker` (a peer id, reached at `checker_maddrs`) to dial us back: {"ok": bool, "problem": str}."""
    await p2p._client.connect(PeerID.from_base58(checker), [Multiaddr(split_peer(m)[0]) for m in checker_maddrs])
    stub = DialBackService.get_stub(p2p, PeerID.from_base58(checker))
    request = ExpertRequest(metadata=msgpack.packb({"maddrs": own_maddrs[:MAX_CHECKED_ADDRS]}))
    answer = await asyncio.wait_for(stub.rpc_dial_back(request), timeout)
    meta = msgpack.unpackb(answer.metadata, raw=False)
    if "error" in meta:
        raise RuntimeError(meta["error"])
    return meta


async def check_reachable(
    p2p: P2P, own_maddrs: list[str], checkers: list[tuple[str, list[str]]], timeout: float = 30.0
) -> tuple[bool | None, str]:
    """Ask each checker (peer id, its multiaddrs) in turn, within `timeout` seconds in all.
    (True, who) once one dialled us back; (False, why) when every checker that answered could not;
    (None, why) when no checker answered at all (none offers the service, or none could be reached)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    refusals, silent = [], []
    for peer, maddrs in checkers:
        left = deadline - loop.time()
        if left <= 1.0:
            silent.append(f"{peer[-8:]}: out of time")
            break
        try:
            answer = await asyncio.wait_for(ask_dial_back(p2p, peer, maddrs, own_maddrs, left), left)
        except Exception as e:
            silent.append(
                f"{peer[-8:]}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__}"
            )
            continue
        if answer.get("ok"):
            return True, peer
        refusals.append(f"{peer[-8:]} could not dial it: {answer.get('problem')}")
    if refusals:
        return False, "; ".join(refusals)
    return None, "; ".join(silent) or "no peer to ask"


def advice_for(problem: str) -> str:
    """The fix that fits what a dial-back (or the ask for one) ran into."""
    text = problem.lower()
    if "protocols not supported" in text or "protocol not supported" in text:
        return (
            "the peer asked does not serve the dial-back check (not a hivepipe server, or one that hangs): "
            "stop that peer, or pass --initial-peers of a running server of the run"
        )
    if "refused" in text:
        return (
            "the address answers but nothing listens on that port: check that --announce-maddrs names the "
            "port this server listens on (--host-maddrs) and that a forwarded port leads to it"
        )
    if "no answer within" in text or "timed out" in text or "timeout" in text or "deadline" in text:
        return (
            "nothing answered at that address: open its TCP port to the internet (firewall, port forwarding), "
            "or pass --announce-maddrs with the public address that forwards to it"
        )
    if "no route" in text or "unreachable" in text:
        return "that address cannot be routed to from the checker: announce a public address (--announce-maddrs)"
    return (
        "open its TCP port to the internet (firewall, port forwarding), or pass --announce-maddrs with the "
        "public address that forwards to it"
    )
