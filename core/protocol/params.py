"""Fetching one shard slot's parameters at a version, from the server that hosts the slot. A host
that has not reached the version yet (it applies batches in order; a slot adopted at a failover can
trail its host's own shard by a step or two) waits for it up to the request's `wait` seconds (at most
MAX_PARAMS_WAIT: one open call instead of a poll every `poll` seconds), then answers `retry` with the
version it holds: the fetch asks again until `patience` runs out, then raises NotReady naming the host.
The volunteer (its task's parameters), the checking server (a re-run's parameters) and the
launcher (the assembled model) all fetch this way."""

from __future__ import annotations

import time
from typing import Awaitable, Callable

from core.protocol.retry import Attempts

# the longest a `get_params` may wait on its server for the version it asks for (its `wait` field)
MAX_PARAMS_WAIT = 5.0


class NotReady(Exception):
    """A slot's host has not reached the version asked for within the patience given."""


async def fetch_slot(
    call: Callable[[str, dict], Awaitable[tuple[dict, list]]],
    host: str,
    slot: int,
    version: int,
    patience: float,
    poll: float,
    clock=time.monotonic,
    digest_only: bool = False,
    base: tuple[int, str] | None = None,
) -> tuple[dict, list]:
    """`call(method, meta)` is one request to `host` (whatever retries of the link it makes); the
    answer of the first `get_params` that is not `retry`. Each asks the host to wait for the version
    for what is left of `patience` (at most MAX_PARAMS_WAIT). `digest_only`: the answer carries the
    version's digest (ShardState.digest) instead of its parameters. `base`: (a version the caller
    holds, the digest of its tensors as sent): the host may answer with the difference from it
    (core/protocol/param_delta.py; the answer's `encoding` says so)."""
    attempts = Attempts(within=patience, pause=poll, clock=clock)
    async for attempt in attempts:
        wait = min(max(attempts.deadline - clock(), 0.0), MAX_PARAMS_WAIT)
        ask = {"version": version, "slot": slot, "wait": wait}
        if digest_only:
            ask["digest_only"] = True
        elif base is not None:
            ask["base"], ask["base_digest"] = base
        meta, tensors = await call("get_params", ask)
        if not meta.get("retry"):
            return meta, tensors
        if attempt.last:
            raise NotReady(
                f"{host} holds slot {slot} at version {meta.get('version')}, not {version} (asked for {patience:.1f} s)"
            )
    raise AssertionError("unreachable: the last attempt returns or raises")
