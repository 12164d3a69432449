#!/usr/bin/env python3
"""An attacker for scripts/bench_trust.py, not a tool for users: IDENTITIES peers in one process that
register with the servers of a stage, take every task they may and never answer, heartbeating that
they hold what they took (so that no server reclaims it early). A dropped identity registers again
as soon as it is let in. It starts once the run's servers announce version --after-version, and
measures the run's pace meanwhile from the servers' announced versions (with --identities 0 it only
measures: the calm figure). Prints one JSON line at the end (SIGTERM, --seconds, or the run's end).

    python scripts/_hoarder.py --initial-peers MADDR --run-id NAME@FP [--identities 20] [--stage 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time


async def hoard(a) -> dict:
    from hivemind.p2p import P2P

    from parameter_server.service import StageServer
    from peer.node import Directory, start_dht, stop_dht
    from peer.protocol import records
    from peer.protocol.trust import split_run_id
    from peer.protocol.wire import RemoteError

    run_id, run_fp = split_run_id(a.run_id)
    dht = start_dht([a.initial_peers], run_id=run_id, run_fp=run_fp, client_mode=True, timeout=60.0)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    got = {"taken": 0, "refused": {}, "identities": a.identities, "most_held": 0, "versions": [], "calls": 0}
    peers = []
    try:
        run = None
        while run is None and not stop.is_set():
            run = await records.read_config(dht, run_id)
            await asyncio.sleep(0.5)
        directory = Directory(dht, run_id, len(run.layout["stages"]))
        servers = len([d for st in run.layout["stages"] for d in st["frontal"] + st["backward"]])

        async def version() -> int | None:
            await directory.refresh()
            return min(directory.versions.values()) if len(directory.versions) == servers else None

        for _ in range(a.identities):  # (before the wait: 20 daemons take seconds to start; each link
            # dials its server at the addresses the server's record announces)
            peers.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        while not stop.is_set() and ((await version()) or -1) < a.after_version:
            await asyncio.sleep(0.25)
        stage = [d for d in directory.servers if d.startswith(f"s{a.stage}")]
        links = [
            (i, d, directory.link(p2p, d, StageServer, backoff=False)) for i, p2p in enumerate(peers) for d in stage
        ]
        held: dict[tuple[int, str], list[str]] = {(i, d): [] for i, d, _ in links}
        deadline = time.monotonic() + a.seconds
        got["started"] = time.monotonic()
        got["versions"].append((time.time(), await version()))
        last_read = time.monotonic()

        async def one(i, d, link):
            got["calls"] += 1  # (a round of register + take, answered or not)
            try:
                await link.call(
                    "register",
                    {"device": f"h{i}", "compute": 1e3, "stage": a.stage, "holding": held[(i, d)]},
                    timeout=10.0,
                )
                meta, _ = await link.call("take", {}, timeout=10.0) if a.take else ({}, [])
                if meta.get("task"):
                    held[(i, d)].append(meta["task"])
                    got["taken"] += 1
            except RemoteError as e:
                why = str(e).split(": ", 1)[-1][:60]
                got["refused"][why] = got["refused"].get(why, 0) + 1
                held[(i, d)].clear()
            except Exception as e:
                got["refused"][repr(e)[:80]] = got["refused"].get(repr(e)[:80], 0) + 1

        while not stop.is_set() and time.monotonic() < deadline:
            await asyncio.gather(*(one(i, d, link) for i, d, link in links))
            got["most_held"] = max([got["most_held"]] + [len(v) for v in held.values()])
            if time.monotonic() - last_read >= 1.0:
                last_read = time.monotonic()
                got["versions"].append((time.time(), await version()))
                if got["versions"][-1][1] is not None and got["versions"][-1][1] >= run.steps:
                    break
            try:
                await asyncio.wait_for(stop.wait(), a.period)
            except asyncio.TimeoutError:
                pass
        got["seconds"] = time.monotonic() - got.get("started", time.monotonic())
    finally:
        for p2p in peers:
            await p2p.shutdown()
        stop_dht(dht)
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--initial-peers", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--identities", type=int, default=20)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--after-version", type=int, default=2, help="start once the servers announce this version")
    p.add_argument("--period", type=float, default=0.2, help="seconds between rounds of takes")
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument(
        "--no-take",
        dest="take",
        action="store_false",
        help="register and heartbeat only: the attack's load on the machine without its hoarding",
    )
    a = p.parse_args(argv)
    print(json.dumps(asyncio.run(hoard(a))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
