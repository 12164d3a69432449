"""The parameters a stage worker computes with, by version (a part of peer/volunteer/worker.py's
StageWorker): each version's shards pulled from their hosts when a task needs them, or one version
ahead while the worker computes (scheduler/prefetch.py says when); a server's own worker reads the
other slots from the replicas its server keeps when their digests agree; and the slice built from
each version held. At most two versions are held (a kept forward pass needs the version it ran on)."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import torch

from core.model.precision import compute_dtype, rounded, wire_dtype
from core.model.transformer import StageSlice, slice_from_state
from core.protocol import param_delta
from core.protocol.params import NotReady
from core.protocol.wire import RemoteError
from scheduler.prefetch import version_to_fetch

logger = logging.getLogger("hivepipe.worker")

# how long a fetch of the next parameter version ahead of need waits for the stage's servers to make it
PREFETCH_PATIENCE = 15.0
# how long a server's own worker waits for the replica its server keeps of another server's slot to
# take a version its host has made (the host sends the step right after making it), and how many
# versions of that slot it pulls from the host after the replica missed one
REPLICA_WAIT = 2.0
REPLICA_BACKOFF = 10

# (device, slot, version, patience, layout epoch, digest_only, base) -> (meta, tensors): a host's
# get_params; base: (a version held, its digest as sent) to pull the version as a difference from
Fetch = Callable[[str, int, int, float, int, bool, tuple | None], Awaitable[tuple[dict, list]]]


class Versions:
    """The versions one worker holds. Given what it reads of its worker: `shards()` the stage's
    (host device, slot, parameter names) now, `epoch()` the worker's layout epoch now, `fetch` a
    slot's get_params from its host, `own_server()` the server the worker runs in (or None),
    `on_pulled()` called after each pull from a host (a kill point), and the `stats` dict it counts
    its prefetches and replica reads in (under COUNTERS, which it adds to that dict). `deltas`: pull a
    version as its difference from the one held before it (core/protocol/param_delta.py)."""

    COUNTERS = (
        "prefetched",
        "params_from_replica",
        "replica_late",
        "replica_other_bits",
        "other_slots_pulled",
        "delta_pulls",
    )

    def __init__(
        self,
        *,
        cfg,
        layers: tuple[int, int],
        stage: int,
        device_id: str,
        torch_device: torch.device,
        precision: str,
        shards: Callable[[], list],
        epoch: Callable[[], int],
        fetch: Fetch,
        own_server: Callable[[], object | None],
        stats: dict,
        on_pulled: Callable[[], None] = lambda: None,
        deltas: bool = True,
    ):
        self.cfg, (self.lo, self.hi), self.stage, self.device_id = cfg, layers, stage, device_id
        self.torch_device, self.precision = torch_device, precision
        self.shards, self.epoch, self.fetch, self.own_server = shards, epoch, fetch, own_server
        self.stats, self.on_pulled, self.deltas = stats, on_pulled, deltas
        self.base_digests: dict[tuple[int, int], str] = {}  # (version, slot) -> its digest as sent (_base)
        for name in self.COUNTERS:
            stats.setdefault(name, 0)
        self.held: dict[int, dict[str, torch.Tensor]] = {}
        self.prefetching: dict[int, asyncio.Future] = {}  # version -> its fetch ahead (prefetch_next)
        self.worked: set[int] = set()  # the versions of the last tasks computed (prefetch_next)
        self.fetched_ahead: set[int] = set()  # versions fetched ahead that no task has used yet
        # version -> (the parameters it was built from, the slice holding them): kept forwards need theirs
        self.models: dict[int, tuple[dict, StageSlice]] = {}
        self.replica_skip_until: dict[int, int] = {}  # slot -> the first version the replica is tried for again

    def clear(self) -> None:
        """Forget every version (a new layout epoch: a rollback re-makes the versions after its batch)."""
        self.held.clear()
        self.models.clear()
        self.base_digests.clear()
        self.drop_prefetches()

    async def ensure(self, version: int, patience: float = 2.0) -> None:
        """Hold parameters `version` of every server of the stage: fetched ahead (prefetch_next), or
        now, from every server at once. A server that has not reached it within `patience` seconds
        raises NotReady: the caller hands its task back rather than hold a lease it cannot work on."""
        if version not in self.held:
            ahead = self.prefetching.get(version)
            if ahead is not None:
                try:  # the fetch ahead goes on if this gives up: the task is handed back, the version comes
                    await asyncio.wait_for(asyncio.shield(ahead), patience)
                except asyncio.TimeoutError:
                    raise NotReady(
                        f"version {version} not reached by every server of stage {self.stage} within {patience:.1f} s"
                    ) from None
                except asyncio.CancelledError:
                    if not ahead.cancelled():  # (this task itself is being cancelled, not the fetch ahead)
                        raise
            if version not in self.held:  # none ahead, or it failed: fetch it now
                epoch = self.epoch()
                state = await self._pull(version, patience)
                if self.epoch() != epoch:  # (a rollback may have re-made the version meanwhile: its task is gone)
                    raise NotReady(f"layout epoch {self.epoch()} began while version {version} was fetched")
                self.hold(version, state)
                return
        if version in self.fetched_ahead:  # a task uses a version fetched ahead (counted once)
            self.fetched_ahead.discard(version)
            self.stats["prefetched"] += 1

    async def _pull(self, version: int, patience: float) -> dict[str, torch.Tensor]:
        """Every shard of `version`, one `get_params` a server, all at once (a server that has not
        reached the version waits for it on its side, up to `patience` in all). Each request carries
        the worker's layout epoch as the pull began: a host answers from that epoch's lineage only."""
        epoch = self.epoch()

        async def one(device, slot, names):
            kept = await self._from_own_replica(device, slot, names, version, patience, epoch)
            if kept is not None:
                return kept
            if (
                device != self.device_id and self.own_server() is not None
            ):  # (a server's worker: its replica was not used)
                self.stats["other_slots_pulled"] += 1
            meta, tensors = await self._ask_host(device, slot, names, version, patience, epoch)
            self.on_pulled()
            return dict(zip(meta["names"], tensors))

        state: dict[str, torch.Tensor] = {}
        for part in await asyncio.gather(*(one(*shard) for shard in self.shards())):
            state.update(part)
        return state

    async def _ask_host(
        self, device: str, slot: int, names: list, version: int, patience: float, epoch: int, digest_only: bool = False
    ) -> tuple[dict, list]:
        """`get_params` of `slot` at `version` of layout epoch `epoch` from its host `device`,
        RemoteError unless the host serves the shard of `names`; asked against the version held
        before it, when there is one (the host answers the difference where it is smaller)."""
        # (its own server's slot is read in-process: a difference would save no bytes there)
        base = None if digest_only or device == self.device_id else await self._base(slot, names, version)
        meta, tensors = await self.fetch(device, slot, version, patience, epoch, digest_only, base and base[:2])
        if meta.get("names") != names:
            raise RemoteError(f"{device} serves shard {meta.get('names')}, expected {names}")
        if meta.get("encoding") == param_delta.ENCODING:
            if base is None or meta.get("base") != base[0] or len(tensors) != 1:
                raise RemoteError(f"{device} sent a difference from version {meta.get('base')}, not asked for")
            try:
                tensors = await asyncio.to_thread(param_delta.decode, base[2], tensors[0].numpy().tobytes())
            except ValueError as e:
                raise RemoteError(f"{device}: {e}") from None
            self.stats["delta_pulls"] += 1
        return meta, tensors

    async def _base(self, slot: int, names: list, version: int) -> tuple[int, str, list] | None:
        """(version, digest, tensors as a host sends them) of the newest version held before `version`
        with every tensor of `names`: what to pull `version` against. None when none is held, or
        differences are off."""
        older = [v for v in self.held if v < version and all(n in self.held[v] for n in names)]
        if not self.deltas or not older:
            return None
        v = max(older)
        dtype = wire_dtype(self.precision)  # (a version read from a replica is held in fp32)
        tensors = [self.held[v][n].to(dtype) for n in names]
        if (v, slot) not in self.base_digests:
            self.base_digests[(v, slot)] = await asyncio.to_thread(param_delta.digest, names, tensors)
        return v, self.base_digests[(v, slot)], tensors

    async def _from_own_replica(
        self, device: str, slot: int, names: list, version: int, patience: float, epoch: int
    ) -> dict[str, torch.Tensor] | None:
        """Version `version` of another server's slot read from the replica this worker's own server
        keeps of it (a server's worker pulled it whole, 0.92 MB a step for the default swarm's
        shards), once the slot's host says that version's digest (one small `get_params`) and the
        replica's agree; None (the caller pulls it) when this worker runs in no server, its server
        keeps no replica of the slot, or the replica does not hold that version within REPLICA_WAIT
        or holds other bits (then the slot is pulled for REPLICA_BACKOFF versions)."""
        server = self.own_server()
        if (
            server is None
            or device == self.device_id
            or slot not in server.replicas
            or version < self.replica_skip_until.get(slot, 0)
        ):
            return None
        meta, _ = await self._ask_host(device, slot, names, version, patience, epoch, digest_only=True)
        kept = await server.copies.replica_at(slot, version, REPLICA_WAIT)
        if kept is None or kept[0] != meta.get("digest"):
            # (told apart: a late copy is the load's doing, other bits a replica that is not the slot's)
            self.stats["replica_late" if kept is None else "replica_other_bits"] += 1
            self.replica_skip_until[slot] = version + REPLICA_BACKOFF
            logger.debug(
                "%s: the replica of slot %d %s version %d: pulling it from %s",
                self.device_id,
                slot,
                "does not hold" if kept is None else "holds other bits of",
                version,
                device,
            )
            return None
        self.stats["params_from_replica"] += 1
        return {n: kept[1][n] for n in names}

    def hold(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Hold `state` as `version`, dropping versions older than the one before it."""
        self.held[version] = state
        for v in [v for v in self.held if v < version - 1]:
            del self.held[v]
            self.models.pop(v, None)
        self.base_digests = {k: d for k, d in self.base_digests.items() if k[0] in self.held}

    def prefetch_next(self, version: int) -> None:
        """Fetch version + 1 in the background while the worker computes on `version`, when the rule
        below the worker says so (scheduler/prefetch.py: it worked on version - 1 too, one fetch
        ahead at a time); each server answers once it has made the version."""
        nxt, self.worked = version_to_fetch(self.worked, version, self.held, self.prefetching)
        if nxt is None:
            return
        epoch = self.epoch()

        async def fetch():
            try:
                state = await self._pull(nxt, PREFETCH_PATIENCE)
            except Exception as e:  # a task that needs the version fetches it itself
                logger.debug("%s: fetching version %d ahead failed: %r", self.device_id, nxt, e)
                return
            finally:
                if self.prefetching.get(nxt) is fut:
                    del self.prefetching[nxt]
            if self.epoch() == epoch and nxt not in self.held:  # (a new epoch cleared what it held)
                self.hold(nxt, state)
                self.fetched_ahead = {v for v in self.fetched_ahead if v in self.held} | {nxt}

        fut = self.prefetching[nxt] = asyncio.ensure_future(fetch())

    def drop_prefetches(self) -> None:
        for fut in self.prefetching.values():
            fut.cancel()
        self.prefetching.clear()

    def model(self, version: int) -> StageSlice:
        """The slice holding parameters `version` (one per kept version, so a kept forward pass stays
        valid while the worker computes tasks of the other version), built from the parameters held
        now: a slice is built in the compute thread, and one built for a task of an older layout epoch
        can be stored after a rollback cleared the cache; the version re-made since is other
        parameters (an honest volunteer computed on such a slice and was banned)."""
        state = self.held[version]
        built = self.models.get(version)
        if built is None or built[0] is not state:
            # (parameters arrive in the run's precision: at bf16, rounded already; a replica's are rounded here)
            model = slice_from_state(self.cfg, self.lo, self.hi, rounded(state, self.precision), self.torch_device)
            model.compute_dtype = compute_dtype(self.precision)
            built = self.models[version] = (state, model)
        return built[1]
