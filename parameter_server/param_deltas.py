"""A server's part that answers `get_params ... base` with a version's difference from the base the
worker holds (core/protocol/param_delta.py): the base's digest checked against the worker's, each
(slot, base, version) difference made once, off the event loop, however many workers ask, and the
newest few kept."""

from __future__ import annotations

import asyncio
from typing import Callable

import torch

from core.protocol import param_delta

KEPT = 4  # differences kept (each a few versions' worth at most: a deflated XOR of two of them)


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
        when this server no longer keeps `base`, holds other bits under it than the worker's
        `base_digest`, or the difference is not smaller (the caller sends the version whole)."""
        snap = shard.params_at(base)
        if snap is None:
            self.declined += 1
            return None
        base_token = shard.tokens.get(base)
        base_wire = self.wire(shard, base, snap)
        key = (id(shard), base, base_token)
        if await self._once(self.digests, key, param_delta.digest, shard.names, base_wire) != base_digest:
            self.declined += 1
            return None
        key = (id(shard), base, base_token, version, shard.tokens.get(version))
        blob = await self._once(self.made, key, param_delta.encode, base_wire, target)
        if blob is None:
            self.declined += 1
        else:
            self.sent += 1
        return blob

    @staticmethod
    async def _once(cache: dict, key: tuple, fn, *args):
        """fn(*args) in a worker thread, once per key while the key is among the KEPT newest."""
        made = cache.get(key)
        if made is None:
            for old in list(cache)[: max(0, len(cache) - KEPT + 1)]:
                del cache[old]
            made = cache[key] = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        return await asyncio.shield(made)
