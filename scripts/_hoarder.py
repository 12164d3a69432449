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
import time

from _observer import add_run_arguments


async def hoard(a) -> dict:
    from _observer import RunObserver
    from hivemind.p2p import P2P

    from core.protocol.wire import RemoteError

    got = {"taken": 0, "refused": {}, "identities": a.identities, "most_held": 0, "calls": 0}
    peers = []
    async with RunObserver(a) as run:
        try:
            for _ in range(a.identities):  # (before the wait: 20 daemons take seconds to start; each link
                # dials its server at the addresses the server's record announces)
                peers.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            if not await run.wait_for_start():
                return got | {"versions": run.versions}
            stage = [d for d in run.directory.servers if d.startswith(f"s{a.stage}")]
            links = [(i, d, run.directory.link(p2p, d, backoff=False)) for i, p2p in enumerate(peers) for d in stage]
            held: dict[tuple[int, str], list[str]] = {(i, d): [] for i, d, _ in links}
            deadline = time.monotonic() + a.seconds
            got["started"] = time.monotonic()
            await run.note_version()
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

            while not run.stop.is_set() and time.monotonic() < deadline:
                await asyncio.gather(*(one(i, d, link) for i, d, link in links))
                got["most_held"] = max([got["most_held"]] + [len(v) for v in held.values()])
                if time.monotonic() - last_read >= 1.0:
                    last_read = time.monotonic()
                    if await run.note_version():
                        break
                await run.pause(a.period)
            got["seconds"] = time.monotonic() - got.get("started", time.monotonic())
        finally:
            for p2p in peers:
                await p2p.shutdown()
    return got | {"versions": run.versions}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    p.add_argument("--identities", type=int, default=20)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--period", type=float, default=0.2, help="seconds between rounds of takes")
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
