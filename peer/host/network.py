"""A server's start on the network: its DHT node, and the check that a peer of the run can dial it
back at the addresses it announces."""

from __future__ import annotations

import logging
import time

from core.protocol.records import RecordState
from peer.errors import NetworkError

logger = logging.getLogger("hivepipe.serve")


def start_server_dht(
    options, run_cfg, device: str, initial_peers: list[str] | None = None, timeout: float | None = None, on_wait=None
):
    """The server's DHT node (`options`: a peer.host.options.ServerOptions), through `initial_peers`
    (default --initial-peers) within `timeout`
    seconds (default --timeout, else 60); `on_wait` as peer.node.start_dht takes it."""
    from peer.node import NetworkStartError, start_dht

    t0 = time.perf_counter()
    try:
        dht = start_dht(
            options.initial_peers if initial_peers is None else initial_peers,
            run_id=run_cfg.run_id,
            run_fp=options.run_fp,
            run_key=options.run_key_obj,
            identity_path=options.identity_path,
            host_maddrs=options.host_maddrs,
            announce_maddrs=options.announce_maddrs,
            timeout=timeout or options.timeout or 60.0,
            on_wait=on_wait,
        )
    except NetworkStartError as e:
        raise NetworkError(str(e)) from None
    logger.info("%s: DHT node and p2p daemon up in %.1f s", device, time.perf_counter() - t0)
    return dht


async def check_own_reachability(
    dht, p2p, initial_peers: list[str], run_id: str, num_stages: int, maddrs: list[str], device: str
) -> None:
    """Ask a server of the run (for a new run: one of `initial_peers`, the peers this server joined
    the DHT through) to dial us back at `maddrs`.
    NetworkError when nobody can, saying what failed and the fix that fits it; a first server on
    private addresses only gets one warning."""
    from core.protocol import record_store
    from peer.addresses import is_public
    from peer.reachability import advice_for, check_reachable, split_peer

    peer_id = str(dht.peer_id)
    private = [m for m in maddrs if not is_public(m)]
    if not initial_peers:
        if len(private) == len(maddrs):
            logger.warning(
                "%s announces only private or loopback addresses (%s): hosts outside this network "
                "cannot reach it; pass --announce-maddrs with a public address if they should",
                device,
                " ".join(maddrs),
            )
        return
    servers = []
    for k in range(num_stages):
        for peer, rec, _ in await record_store.read_stage(dht, run_id, k):
            if rec is not None and rec["kind"] == "server" and peer != peer_id and rec["state"] != RecordState.OFFLINE:
                servers.append((peer, [m for m in rec["maddrs"] if isinstance(m, str)]))
    initial = [(split_peer(m)[1], [m]) for m in initial_peers if split_peer(m)[1] not in (None, peer_id)]
    t0 = time.perf_counter()
    ok, detail = await check_reachable(p2p, maddrs, servers or initial, timeout=30.0)
    if ok:
        logger.info(
            "%s: reachable at %s (checked by %s in %.1f s)",
            device,
            " ".join(maddrs),
            detail[-8:],
            time.perf_counter() - t0,
        )
    elif ok is False:
        raise NetworkError(
            f"no peer of the run could dial this server back at {' '.join(maddrs)} ({detail}): {advice_for(detail)}"
        )
    else:  # nobody answered the ask itself: that says nothing about this server's own address
        logger.warning(
            "%s: could not check that others can dial %s: no peer asked could run the check (%s); %s",
            device,
            " ".join(maddrs),
            detail,
            advice_for(detail),
        )
