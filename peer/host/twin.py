"""Whether another live process holds this server's identity: the run's own records decide.

hivemind checks at start that no live peer holds an identity on disk, but it finds the holder
through the libp2p DHT of the initial peers, best effort: under load it let a second server with a
live server's identity through. Every server re-announces a signed record under its peer id once an
announce period, so the run itself knows: a record under this identity that is re-announced while
this process has not announced anything yet comes from someone else, alive. A record that stops
changing is a predecessor that died (a crash before a restart). The watch costs a start whose
identity file was already on disk (a restart, or a copy) stale_after(period) plus a period: 12 s at
the default announce period; a new identity, made by the start itself, is nobody else's and is not
watched. Dialing the holder instead is not possible: a daemon cannot dial its own peer id."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from core.protocol import record_store, records

logger = logging.getLogger("hivepipe.serve")

Read = Callable[[], Awaitable[list[tuple[str, dict | None, str | None]]]]


def _held_by(found: list[tuple[str, dict | None, str | None]], peer_id: str) -> dict | None:
    """The newest server record announced under `peer_id` among `found` (peer, record, problem)."""
    mine = [rec for peer, rec, _ in found if peer == peer_id and rec is not None and rec.get("kind") == "server"]
    return max(mine, key=lambda r: float(r["time"]), default=None)


async def live_holder(
    read: Read,
    peer_id: str,
    period: float,
    *,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    who: str = "this server",
) -> dict | None:
    """The record of a live server announced under `peer_id` (this process's own identity, before it
    announces anything), or None. `read()` gives the run's server records as (peer id, record,
    problem). The records are read every half period for stale_after(period) plus a period, whatever
    the first read shows (a DHT read under load can miss a record): a record under `peer_id` that is
    re-announced meanwhile has a live holder; one that never changes was a crashed predecessor's."""
    wait = records.stale_after(period) + period
    logger.info("%s: watching the run's records for %.0f s: is its identity held by a live server?", who, wait)
    deadline = monotonic() + wait
    first = None
    while True:
        try:
            now = _held_by(await read(), peer_id)
        except Exception:  # (a read that failed under load says nothing: look again)
            now = None
        if now is not None:
            if first is None:
                first = now
            elif float(now["time"]) > float(first["time"]):
                return now
        left = deadline - monotonic()
        if left <= 0:
            return None
        await sleep(min(period / 2, left))


def read_servers(dht, run_id: str, num_stages: int) -> Read:
    """`read` for live_holder: every stage's records of run `run_id`, in one DHT traversal."""

    async def read():
        return [entry for found in await record_store.read_stages(dht, run_id, num_stages) for entry in found]

    return read
