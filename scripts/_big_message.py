#!/usr/bin/env python3
"""An attacker for scripts/bench_trust.py, not a tool for users: sends server DEVICE of a run one
stream message that says it is --bytes long (default 1 GiB) and writes its body in 1 MiB pieces until
the server closes the stream or the body is sent. Prints one JSON line: bytes written, and whether the
server cut the stream."""

from __future__ import annotations

import argparse
import asyncio
import json


async def send(a) -> dict:
    from hivemind.p2p import P2P, PeerID

    from core.protocol import record_store
    from core.protocol.trust import split_run_id
    from parameter_server.service import StageServer
    from peer.directory import Directory
    from peer.node import start_dht, stop_dht

    run_id, run_fp = split_run_id(a.run_id)
    dht = start_dht([a.initial_peers], run_id=run_id, run_fp=run_fp, client_mode=True, timeout=60.0)
    p2p = await dht.replicate_p2p()
    out = {"claimed": a.bytes, "written": 0, "cut": False}
    try:
        run = await record_store.read_config(dht, run_id)
        directory = Directory(dht, run_id, len(run.layout["stages"]))
        while a.device not in await directory.refresh():
            await asyncio.sleep(0.5)
        link = directory.link(p2p, a.device)
        await link.dial()
        handle = StageServer._get_handle_name(None, "rpc_push_grads")
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(directory.known[a.device]), handle)
        writer.write(P2P.MESSAGE_MARKER + a.bytes.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        piece = b"\x00" * (1 << 20)
        try:
            while out["written"] < a.bytes:
                writer.write(piece)
                await asyncio.wait_for(writer.drain(), 10.0)
                out["written"] += len(piece)
        except (ConnectionError, asyncio.TimeoutError, OSError):
            out["cut"] = True
        writer.close()
    finally:
        stop_dht(dht)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--initial-peers", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--device", default="s0f0")
    p.add_argument("--bytes", type=int, default=1 << 30)
    a = p.parse_args(argv)
    print(json.dumps(asyncio.run(send(a))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
