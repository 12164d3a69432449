"""The compute loop of one stage: what a volunteer (`peer join`) runs, and what every server runs
beside its services (the paper's partially collocated servers). It pulls backward tasks first (they
free memory and finish batches), then forward tasks; runs its slice; pushes outputs and input
gradients per task, and accumulates its parameter gradients per batch, pushing each batch's sum,
sharded, to every server of the stage with the ids of the tasks it covers.

Ordering for exactly-once: a task's input gradient is handed to the frontal server first; its
parameter gradient joins the batch's sum while the task stays leased; the sum goes to every server
(each credits it all or nothing, and a task at most once), and only then are its tasks completed. A
worker killed at any point leaves each server with either nothing or the whole contribution of each
task, and its tasks are re-run (pushed alone) until completed; re-runs are counted duplicates."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import torch

from core.layout import assign_shards
from core.model.transformer import StageSlice, build_slice
from core.protocol.aio import check_cancelled
from core.protocol.params import NotReady, fetch_slot
from core.protocol.refusals import Refusal
from core.protocol.wire import RemoteError, wait_to_redial
from peer.volunteer.device import EmulatedDevice
from peer.volunteer.faults import KILL_POINTS, die_here
from peer.volunteer.intake import Intake
from peer.volunteer.kept import KeptForwards
from peer.volunteer.membership import Membership
from peer.volunteer.passes import Passes
from peer.volunteer.sums import GradientSums
from peer.volunteer.versions import Versions

logger = logging.getLogger("hivepipe.worker")


# the requests a task in hand needs (its parameters and inputs, handing its results in), retried while
# their server is away for up to AWAY_GRACE_S (a crashed server restarted by its supervisor answers
# again within about a second; a lost one is failed over in minutes, and its tasks are handed back
# after this wait); each is safe to repeat (core/protocol/methods.py)
WAITS_FOR_RESTART = frozenset({"get_params", "get_inputs", "push_outputs", "push_input_grads", "push_grads"})
AWAY_GRACE_S = 5.0
# how long a newcomer waits for its stage's current parameters before its first take (warm_up)
WARM_UP_PATIENCE_S = 10.0


class StageWorker:
    def __init__(
        self,
        *,
        run,
        layout,
        cfg,
        stage: int,
        device_id: str,
        links: dict,
        compute: float,
        torch_device: str = "cpu",
        slowdown: float = 1.0,
        poll: float = 0.05,
        heartbeat: float = 1.0,
        die_at: str | None = None,
        cheat=None,
        activation_memory: int = 1 << 30,
        epoch: int = 0,
        on_step=None,
        param_deltas: bool = True,
    ):
        self.run, self.layout, self.cfg = run, layout, cfg
        self.on_step = on_step or (lambda step: None)  # its join's steps as they end (peer/host/join_clock.py)
        self.stage = stage
        self.st = layout.stages[stage]
        self.lo, self.hi = self.st.layers
        self.last = stage == layout.num_stages - 1
        self.device_id = device_id
        self.links = links  # device id -> link (P2PLink/LocalLink) for every server of this stage
        self.compute = compute
        self.torch_device = torch.device(torch_device)
        self.poll = poll
        self.rows = run.batch_size // run.micro_batches
        self.total_tokens = run.batch_size * cfg.seq_len
        self.model: StageSlice = build_slice(cfg, self.lo, self.hi, run.seed, device=self.torch_device)
        self.epoch = epoch  # of `layout`
        self._set_layout(layout)
        # its forward passes and their inputs, kept for the backward tasks of the same rows (peer/volunteer/kept.py)
        self.kept = KeptForwards(activation_memory)
        self.stats = {
            "forward": 0,
            "backward": 0,
            "dropped": 0,
            "pushes": 0,
            "conflicts": 0,
            "param_seconds": 0.0,
            "started": time.time(),
            "recomputed": 0,
            "recompute_avoided": 0,
        }  # (its device adds "compute_seconds", its versions their counters: their constructors below)
        # its passes, one at a time, as long as they last on the device it emulates (peer/volunteer/device.py)
        self.device = EmulatedDevice(self.torch_device, slowdown, self.stats)
        # the parameters it computes with, by version (peer/volunteer/versions.py)
        self.versions = Versions(
            cfg=cfg,
            layers=(self.lo, self.hi),
            stage=stage,
            device_id=device_id,
            torch_device=self.torch_device,
            precision=getattr(run, "precision", "fp32"),
            shards=lambda: self.shards,
            epoch=lambda: self.epoch,
            fetch=self._fetch_slot,
            deltas=param_deltas,
            own_server=self._own_server,
            stats=self.stats,
            on_pulled=lambda: self._point("pulling_params"),
        )
        # its registration, heartbeats and hand-ins; a refusal for good; the run's end (peer/volunteer/membership.py)
        self.member = Membership(
            device_id=device_id,
            stage=stage,
            compute=lambda: self.compute,
            links=links,
            servers=lambda: self.st.servers,
            epoch=lambda: self.epoch,
            holding=self.holding,
            call=self.call,
            heartbeat=heartbeat,
        )
        # the tasks it takes, and those that arrive while it is busy (peer/volunteer/intake.py)
        self.intake = Intake(
            device_id=device_id,
            links=links,
            stage=lambda: self.st,
            epoch=lambda: self.epoch,
            call=self.call,
            member=self.member,
            poll=poll,
        )
        # its parameter gradients summed per batch, and their pushes (peer/volunteer/sums.py)
        self.sums = GradientSums(
            device_id=device_id,
            last=self.last,
            max_pending=2 * run.micro_batches,  # the servers lease a client 2 x micro-batches + 1 tasks
            call=self.call,
            links=self.links,
            shards=lambda: self.shards,
            own_server=self._own_server,
            stats=self.stats,
            finish_later=self.member.finish_later,
            hand_back=self.member.hand_back,
            point=self._point,
            die_at=die_at,
        )
        self.current: tuple[str, str] | None = None  # (server device, task id) being worked on
        if die_at is not None and die_at not in KILL_POINTS:
            raise ValueError(f"unknown kill point {die_at!r}; choose from {', '.join(KILL_POINTS)}")
        self.die_at = die_at
        # its passes: a task computed and handed in (peer/volunteer/passes.py)
        self.passes = Passes(
            device_id=device_id,
            last=self.last,
            rows=self.rows,
            total_tokens=self.total_tokens,
            torch_device=self.torch_device,
            versions=self.versions,
            kept=self.kept,
            sums=self.sums,
            device=self.device,
            member=self.member,
            call=self.call,
            links=links,
            stage=lambda: self.st,
            epoch=lambda: self.epoch,
            stats=self.stats,
            cheat=cheat,
            point=self._point,
        )

    @property
    def cheat(self):
        """peer/volunteer/cheat.py: a lying volunteer, for tests of the servers' checks (its passes lie)."""
        return self.passes.cheat

    @cheat.setter
    def cheat(self, cheat) -> None:
        self.passes.cheat = cheat

    @property
    def banned(self) -> str | None:
        """The words of a refusal for good (banned, not allowed), once heard (`Membership.banned`)."""
        return self.member.banned

    @property
    def refusal(self) -> Refusal | None:
        return self.member.refusal

    @property
    def over(self) -> bool:
        """A server of the stage answered that the run is over."""
        return self.member.over

    def _set_layout(self, layout) -> None:
        """The stage's servers and, per shard slot, (host, slot, parameter names)."""
        self.layout, self.st = layout, layout.stages[self.stage]
        sizes = {n: p.numel() for n, p in self.model.named_parameters()}
        names = assign_shards(sizes, len(self.st.hosts))
        self.shards = [(host, slot, names[slot]) for slot, host in enumerate(self.st.hosts)]

    async def call(self, link, method: str, meta: dict, tensors=(), timeout: float = 30.0, epoch: int | None = None):
        """A request of layout epoch `epoch` (a task's requests carry the epoch the task was taken in;
        default: the worker's). A server at a later epoch (a failover happened) makes the worker
        fetch the new layout and drop what it held of the old one. A request a task in hand needs
        (WAITS_FOR_RESTART) that cannot get through is tried again for up to AWAY_GRACE_S: a
        supervised server is back within about a second of a crash, and a retry costs that wait
        where handing the task back costs its whole re-run (each such request is safe to repeat)."""
        give_up = time.monotonic() + (AWAY_GRACE_S if method in WAITS_FOR_RESTART else 0.0)
        registered = False
        while True:
            check_cancelled()
            try:
                return await link.call(
                    method, dict(meta, epoch=self.epoch if epoch is None else epoch), list(tensors), timeout=timeout
                )
            except RemoteError as e:
                if e.refusal is Refusal.STALE_EPOCH:
                    await self.refresh_layout(link)
                elif self.member.refused_for_good(e):
                    pass
                elif e.refusal is Refusal.NOT_REGISTERED and not registered:
                    # the server does not know this worker (it restarted and forgot its clients, or
                    # dropped it): a refused call changed nothing, so register there and try once more
                    # instead of dropping the task
                    registered = True
                    await self.member.quiet(link.call, "register", self.member.registration(link.device), timeout=10.0)
                    continue
                raise
            except ConnectionError:
                if not await wait_to_redial(link, give_up):
                    raise

    async def refresh_layout(self, link) -> None:
        from core.layout import RunLayout

        record, _ = await link.call("get_layout", {}, timeout=10.0)
        if record["epoch"] <= self.epoch:
            return
        self.epoch = record["epoch"]
        self._set_layout(RunLayout.from_dict(record["layout"], self.cfg.layers))
        self.sums.clear()  # the old epoch's leases are gone: its tasks are run again in this one
        self.member.clear()
        # a rollback (a cheater was caught) re-makes versions after its batch, and their inputs
        self.versions.clear()
        self.kept.clear()
        logger.warning("%s: layout epoch %d (servers %s)", self.device_id, self.epoch, list(self.st.servers))

    def _point(self, name: str) -> None:
        if self.die_at == name:
            logger.warning("%s: dying at %s", self.device_id, name)
            die_here()

    # ------------------------------------------------------------------------------------------
    def holding(self, device: str) -> list[str]:
        """The task ids leased from server `device` that this worker works on or keeps in a sum."""
        held = self.sums.holding(device)
        held += self.member.hand_ins.listed(device)
        if self.current is not None and self.current[0] == device:
            held.append(self.current[1])
        return held + self.intake.arrived_from(device)

    async def run_loop(self, stop: asyncio.Event) -> None:
        """Pull and compute tasks until `stop`, a refusal for good (`banned`) or the run's end (`over`)."""
        outer, stop = stop, asyncio.Event()  # set by the caller's stop, or when the run is over here
        self.member.halt = stop
        relay = asyncio.ensure_future(outer.wait())
        relay.add_done_callback(lambda _: stop.set())
        await self.member.register(first=True)
        self.on_step("registered")
        beat = asyncio.ensure_future(self.member.heartbeat_loop(stop))
        try:
            await self.warm_up(stop)
            self.on_step("warmed")
            while not stop.is_set() and self.banned is None and not self.over:
                check_cancelled()
                got = await self.intake.take_one()
                if got is None:  # idle: push what it holds, then wait for work at every server at once
                    await self.sums.flush(self.sums.due(None, self.kept.passes))
                    got = await self.intake.wait_for_task(stop, until=self.sums.hold_left())
                if got is not None:  # held from now on (the heartbeat says so), also while pushing below
                    self.current = (got[0].device, got[1]["task"])
                await self.sums.flush(self.sums.due(None if got is None else got[1], self.kept.passes))
                if got is None:
                    continue
                link, meta, tensors = got
                self.current = (link.device, meta["task"])
                if "first_task" not in self.stats:
                    self.on_step("first_task")
                self.stats.setdefault("first_task", time.monotonic())  # its time in the run counts from here
                started, computed, pulled = time.monotonic(), self.stats["compute_seconds"], self.stats["param_seconds"]
                try:
                    await self.passes.process(link, meta, tensors)
                    # where a task's time went (-vv): the rest of it is calls (outputs, gradients, complete)
                    logger.debug(
                        "%s: %s done in %.3f s (compute %.3f s, parameters %.3f s)",
                        self.device_id,
                        meta["task"],
                        time.monotonic() - started,
                        self.stats["compute_seconds"] - computed,
                        self.stats["param_seconds"] - pulled,
                    )
                except NotReady as e:
                    logger.info("%s: handing back %s: %s", self.device_id, meta["task"], e)
                    await self.intake.undone(link, meta)
                    await asyncio.sleep(self.poll)
                except RemoteError as e:
                    self.stats["dropped"] += 1
                    logger.info("%s: task %s dropped: %s", self.device_id, meta["task"], e)
                    await self.intake.undone(link, meta)
                except Exception as e:  # a transport failure: hand the task back so it is re-queued at once
                    self.stats["dropped"] += 1
                    # a server that cannot be reached is reported by its link's health (one line when
                    # it starts failing, one a minute, one at recovery): a line per task would flood
                    transport = isinstance(e, (ConnectionError, asyncio.TimeoutError))
                    logger.log(
                        logging.INFO if transport else logging.WARNING,
                        "%s: task %s interrupted: %r",
                        self.device_id,
                        meta["task"],
                        e,
                    )
                    await self.intake.undone(link, meta)
                else:
                    self.intake.unready = None
                finally:
                    self.current = None
            await self.sums.flush_all()  # a clean stop hands in what it has
            await self.member.hand_in_finished()
        finally:
            relay.cancel()
            beat.cancel()
            self.versions.drop_prefetches()
            await self.intake.stop_waiting()

    async def warm_up(self, stop: asyncio.Event) -> None:
        """Fetch the parameter version the stage's servers said they are at (their answers to the
        first `register`) before the first take. A newcomer's first lease is short (an unproven
        client's, docs/trust.md): spent downloading, it ran out before the task was computed, and the
        task waited for the lease's end. The download is the task's cost either way, so it is paid
        outside the lease here. Best effort: a server that has not made the version within
        WARM_UP_PATIENCE_S, a failed call or the stop leave it to the first task."""
        version = self.member.stage_version()
        if version is None:
            return
        pulling = time.monotonic()
        fetch = asyncio.ensure_future(self.versions.ensure(version, patience=WARM_UP_PATIENCE_S))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([fetch, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not fetch.done():
            fetch.cancel()
            await asyncio.gather(fetch, return_exceptions=True)
            return
        e = fetch.exception()
        if e is not None:
            logger.info("%s: version %d not fetched before the first task: %r", self.device_id, version, e)
            return
        self.stats["warmed_up"] = version
        self.stats["param_seconds"] += time.monotonic() - pulling
        logger.debug("%s: holds version %d before its first task", self.device_id, version)

    # ------------------------------------------------------------------------------------------
    async def _fetch_slot(
        self, device: str, slot: int, version: int, patience: float, epoch: int, digest_only: bool, base=None
    ) -> tuple[dict, list]:
        """`get_params` of `slot` at `version` of layout epoch `epoch` from its host `device`
        (core.protocol.params.fetch_slot), over this worker's link to it."""
        call = functools.partial(self.call, self.links[device], timeout=60.0, epoch=epoch)
        return await fetch_slot(call, device, slot, version, patience, self.poll, digest_only=digest_only, base=base)

    def _own_server(self):
        """The server this worker runs in (its link to itself is a LocalLink to it), or None."""
        return getattr(self.links.get(self.device_id), "server", None)

    def measure_compute(self, rows: int = 1, repeats: int = 5) -> float:
        """Rows per second of this worker's slice on its device (EmulatedDevice.measure)."""
        return self.device.measure(self.model, self.cfg, rows, repeats)
