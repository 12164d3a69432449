"""A server's part that answers `get_params ... base` with a version's difference from the base the
worker holds (core/protocol/param_delta.py): the base's digest checked against the worker's, each
(slot, base, version) difference made once, off the event loop, however many workers ask.

Only the newest version a slot has made is sent as a difference, and only from one of the two
versions before it: that is what workers ask for (every worker fetches the next version as it is
made, against the one it computes on; one that missed a version, against the one before), and it
bounds what any asker can make a server compute and keep to KEPT differences of one version, each
under 0.9 of the slot's bytes. Any other base gets the version whole."""

from __future__ import annotations

import asyncio
from typing import Callable

import torch

from core.protocol import param_delta

KEPT = 2  # differences kept: the newest version's from each of the two versions before it
BASES = 2  # how far back a base may be: version - 1 or version - 2


class ParamDeltas:
    """`wire(shard, version, snapshot)`: the tensors a worker is sent for a kept version (fp32, or
    rounded to bfloat16 at --precision bf16), in the shard's names order."""

    def __init__(self, wire: Callable[[object, int, dict], list[torch.Tensor]]) -> None:
        self.wire = wire
        self.made: dict[tuple, asyncio.Future] = {}  # (shard, base, its token, version, its token) -> blob or None
        self.digests: dict[tuple, asyncio.Future] = {}  # (shard, base, its token) -> digest of its wire tensors
        self.sent = 0  # answers sent as a difference
        self.declined = 0  # asked, and the version went whole (base not held, other bits, not smaller)

    async def against(self, shard, base: int, base_digest: str, version: int, target: list) -> bytes | None:
        """Version `version` of `shard` (its wire tensors `target`) as a difference from `base`, or None
        when `version` is not the slot's newest, `base` is more than BASES before it or no longer
        kept, this server holds other bits under it than the worker's `base_digest`, or the difference
        is not smaller (the caller sends the version whole)."""
        snap = shard.params_at(base) if version == shard.version and base >= version - BASES else None
        if snap is None:
            self.declined += 1
            return None
        base_token = shard.tokens.get(base)
        base_wire = self.wire(shard, base, snap)
        key = (id(shard), base, base_token)
        if await self._once(self.digests, key, BASES + 1, param_delta.digest, shard.names, base_wire) != base_digest:
            self.declined += 1
            return None
        key = (id(shard), base, base_token, version, shard.tokens.get(version))
        blob = await self._once(self.made, key, KEPT, param_delta.encode, base_wire, target)
        if blob is None:
            self.declined += 1
        else:
            self.sent += 1
        return blob

    @staticmethod
    async def _once(cache: dict, key: tuple, kept: int, fn, *args):
        """fn(*args) in a worker thread, once per key while the key is among the `kept` newest."""
        made = cache.get(key)
        if made is None:
            for old in list(cache)[: max(0, len(cache) - kept + 1)]:
                del cache[old]
            made = cache[key] = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        return await asyncio.shield(made)
