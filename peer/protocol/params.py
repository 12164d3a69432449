"""Fetching one shard slot's parameters at a version, from the server that hosts the slot. A host
that has not reached the version yet (it applies batches in order; a slot adopted at a failover can
trail its host's own shard by a step or two) answers `retry` with the version it holds: the fetch
asks again every `poll` seconds until `patience` runs out, then raises NotReady naming the host.
The volunteer (its task's parameters), the checking server (a re-run's parameters) and the
launcher (the assembled model) all fetch this way."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable


class NotReady(Exception):
    """A slot's host has not reached the version asked for within the patience given."""


async def fetch_slot(call: Callable[[str, dict], Awaitable[tuple[dict, list]]], host: str, slot: int,
                     version: int, patience: float, poll: float, clock=time.monotonic) -> tuple[dict, list]:
    """`call(method, meta)` is one request to `host` (whatever retries of the link it makes); the
    answer of the first `get_params` that is not `retry`."""
    deadline = clock() + patience
    while True:
        meta, tensors = await call("get_params", {"version": version, "slot": slot})
        if not meta.get("retry"):
            return meta, tensors
        if clock() >= deadline:
            raise NotReady(f"{host} holds slot {slot} at version {meta.get('version')}, not {version} "
                           f"(asked for {patience:.1f} s)")
        await asyncio.sleep(poll)
