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

from core.layout import assign_shards, owners
from core.model.task_math import KeptForward, backward_kept, backward_rows, forward_keeping, forward_rows
from core.model.transformer import StageSlice, build_slice
from core.protocol.aio import check_cancelled
from core.protocol.params import NotReady, fetch_slot
from core.protocol.refusals import Refusal
from core.protocol.retry import Attempts
from core.protocol.wire import RemoteError, StreamCut, wait_to_redial
from peer.volunteer.device import EmulatedDevice
from peer.volunteer.faults import KILL_POINTS, die_here
from peer.volunteer.handins import HandIns
from peer.volunteer.sums import GradientSums
from peer.volunteer.versions import Versions
from taskpool.types import priority

logger = logging.getLogger("hivepipe.worker")


# the requests a task in hand needs (its parameters and inputs, handing its results in), retried while
# their server is away for up to AWAY_GRACE_S (a crashed server restarted by its supervisor answers
# again within about a second; a lost one is failed over in minutes, and its tasks are handed back
# after this wait); each is safe to repeat (core/protocol/methods.py)
WAITS_FOR_RESTART = frozenset({"get_params", "get_inputs", "push_outputs", "push_input_grads", "push_grads"})
AWAY_GRACE_S = 5.0

# how long an idle worker's take waits at a server for a task (the server caps it at MAX_TAKE_WAIT)
TAKE_WAIT = 3.0


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
    ):
        self.run, self.layout, self.cfg = run, layout, cfg
        self.stage = stage
        self.st = layout.stages[stage]
        self.lo, self.hi = self.st.layers
        self.last = stage == layout.num_stages - 1
        self.device_id = device_id
        self.links = links  # device id -> link (P2PLink/LocalLink) for every server of this stage
        self.compute = compute
        self.torch_device = torch.device(torch_device)
        self.poll = poll
        self.heartbeat = heartbeat
        self.rows = run.batch_size // run.micro_batches
        self.total_tokens = run.batch_size * cfg.seq_len
        self.model: StageSlice = build_slice(cfg, self.lo, self.hi, run.seed, device=self.torch_device)
        self.epoch = epoch  # of `layout`
        self._set_layout(layout)
        # forward passes kept for the backward task of the same rows (the backward server prefers the
        # client of the forward pass), oldest dropped first beyond `activation_memory` bytes
        self.kept: dict[tuple, KeptForward] = {}
        self.activation_memory = activation_memory
        # (batch, micro-batch, layout epoch) -> the input rows a forward task received: a task of an older
        # epoch that ends after a rollback stores its own, which the re-made batch's tasks must not read
        self.input_cache: dict[tuple[int, int, int], list[tuple[int, int, torch.Tensor]]] = {}
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
            own_server=self._own_server,
            stats=self.stats,
            on_pulled=lambda: self._point("pulling_params"),
        )
        # the tasks finished (credited by every server, or a forward pass's outputs delivered) and
        # handed in with the next take or heartbeat to the server that leased each (peer/volunteer/handins.py)
        self.hand_ins = HandIns()
        # task id -> the ticket of its lease, while this worker holds it: a `register` that lists what it
        # holds proves each lease with its ticket (a server that restarted adopts only proven leases)
        self.held_tickets: dict[str, str | None] = {}
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
            finish_later=self._finish_later,
            hand_back=self._hand_back,
            point=self._point,
            die_at=die_at,
        )
        self.current: tuple[str, str] | None = None  # (server device, task id) being worked on
        # an idle worker waits for a task at every server of its stage at once (long-polled `take`s, at
        # most one per server); a task that arrives while it works on another waits here, leased to it
        self.waiting: dict[str, asyncio.Future] = {}
        # server device -> whether its last take answer said tasks were queued there ("more"): one
        # that said none is asked again only by a waiting take, once this worker is idle, or after a
        # task went back undone (_undone)
        self.more: dict[str, bool] = {}
        self.unready: str | None = None  # the server whose last task went back undone (_undone)
        self.ready: list[tuple] = []  # (link, meta, tensors)
        if die_at is not None and die_at not in KILL_POINTS:
            raise ValueError(f"unknown kill point {die_at!r}; choose from {', '.join(KILL_POINTS)}")
        self.die_at = die_at
        self.cheat = cheat  # peer/volunteer/cheat.py: a lying volunteer, for tests of the servers' checks
        # why the run refuses this worker for good (its work failed a check; it is not on a closed run's
        # list): such a refusal will not change, so the worker stops rather than ask again
        self.banned: str | None = None  # the words of a refusal for good (banned, not allowed), once heard
        self.refusal: Refusal | None = None  # and its code
        # a server of the stage answered that the run is over (every server of the run applied its
        # last step): nothing more will come, and the worker stops (`over`)
        self.over = False
        self._halt: asyncio.Event | None = None
        self._turn = 0

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
                elif self._refused_for_good(e):
                    pass
                elif e.refusal is Refusal.NOT_REGISTERED and not registered:
                    # the server does not know this worker (it restarted and forgot its clients, or
                    # dropped it): a refused call changed nothing, so register there and try once more
                    # instead of dropping the task
                    registered = True
                    await self._quiet(link.call, "register", self._registration(link.device), timeout=10.0)
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
        self.hand_ins.clear()
        self.held_tickets.clear()
        # a rollback (a cheater was caught) re-makes versions after its batch, and their inputs
        self.versions.clear()
        self.kept.clear()
        self.input_cache.clear()
        logger.warning("%s: layout epoch %d (servers %s)", self.device_id, self.epoch, list(self.st.servers))

    def _point(self, name: str) -> None:
        if self.die_at == name:
            logger.warning("%s: dying at %s", self.device_id, name)
            die_here()

    # ------------------------------------------------------------------------------------------
    def holding(self, device: str) -> list[str]:
        """The task ids leased from server `device` that this worker works on or keeps in a sum."""
        held = self.sums.holding(device)
        held += self.hand_ins.listed(device)
        if self.current is not None and self.current[0] == device:
            held.append(self.current[1])
        self._harvest()
        held += [meta["task"] for link, meta, _ in self.ready if link.device == device]
        return held

    async def register(self, first: bool = False) -> None:
        """Register (and heartbeat) with every server of the stage, saying which of its tasks this
        worker holds: a lease it does not know of (an answer lost on the way) is re-queued at once.
        `first`: this worker just started, so any lease under its peer id is a predecessor's (a
        supervised server forked again) and goes back at once, however young."""
        extra = {"first": True} if first else {}
        self._forget_tickets()
        await asyncio.gather(*(self._heartbeat(d, **extra) for d in self.st.servers if d in self.links))

    def _forget_tickets(self) -> None:
        """Forget the tickets of tasks no longer held anywhere (done, handed back, or an old epoch's)."""
        held = {t for d in self.st.servers if d in self.links for t in self.holding(d)}
        for task in [t for t in self.held_tickets if t not in held]:
            del self.held_tickets[task]

    async def _heartbeat(self, device: str, **extra) -> None:
        """One `register` at `device`, carrying the tasks finished there (quiet: a failure is logged at
        debug, and the finished tasks go with the next call)."""
        meta, done = self._handing_in(device, self._registration(device, **extra))
        try:
            answer = await self._quiet(self.links[device].call, "register", meta, timeout=10.0)
        finally:
            self.hand_ins.release(device, done)
        if answer is not None:
            self.hand_ins.arrived(device, done)
            if isinstance(answer, tuple) and isinstance(answer[0], dict) and answer[0].get("over") is True:
                self.over = True
                if self._halt is not None:
                    self._halt.set()

    def _registration(self, device: str | None = None, **extra) -> dict:
        """A `register` request; with `device`, listing what this worker holds at that server."""
        meta = {"device": self.device_id, "compute": float(self.compute), "stage": self.stage, **extra}
        if device is not None:
            meta["holding"] = self.holding(device)
            meta["leases"] = [self.held_tickets.get(t) for t in meta["holding"]]
        return meta

    def _finish_later(self, device: str, task_id: str, epoch: int) -> None:
        """A task leased from `device` in layout epoch `epoch` is done: say so with the next take or
        heartbeat there (nothing to say of an older epoch's task: its lease is gone)."""
        if epoch == self.epoch:
            self.hand_ins.add(device, task_id)

    def _handing_in(self, device: str, meta: dict) -> tuple[dict, list[str]]:
        """`meta` carrying the tasks finished at `device` (and the epoch they belong to) that no call
        in flight carries, and their ids (in flight until hand_ins.release)."""
        done = self.hand_ins.take(device)
        return (dict(meta, complete=done, epoch=self.epoch) if done else meta), done

    async def hand_in_finished(self) -> None:
        """A heartbeat to every server that has finished tasks of this worker not handed in yet (a
        clean stop)."""
        await asyncio.gather(*(self._heartbeat(d) for d in self.hand_ins.devices() if d in self.links))

    async def _hand_back(self, link, task: str, epoch: int) -> None:
        """Give task `task` back to the server of `link` (`fail`: it is re-queued at once), quietly."""
        await self._quiet(self.call, link, "fail", {"task": task}, epoch=epoch)

    async def _quiet(self, call, *args, **kwargs):
        """`call(*args, **kwargs)`, its failure logged at debug and answered None. The call is made
        here, not handed in made: a gather of these cancelled before its tasks start would leave a
        handed-in coroutine never awaited ("coroutine 'StageWorker.call' was never awaited")."""
        try:
            return await call(*args, **kwargs)
        except Exception as e:
            if not self._refused_for_good(e):
                logger.debug("%s: %r", self.device_id, e)
            return None

    def _refused_for_good(self, e: Exception) -> bool:
        """Whether `e` is a refusal that will not change (Refusal.final); the first one is kept as
        `banned` (its words) and `refusal` (its code) and said once."""
        if not isinstance(e, RemoteError) or not e.refusal.final:
            return False
        if self.banned is None:
            self.banned, self.refusal = str(e), e.refusal
            logger.error("%s: %s", self.device_id, e)
        return True

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        """A heartbeat to each server of the stage on its own beat: a server slow to answer (its
        loop busy, or restarting) must not delay the others', which would count the delay as
        silence (sent and awaited together, one slow answer delays every beat).
        The stage's servers are looked up every beat (a failover changes them)."""
        beats: dict[str, asyncio.Future] = {}
        try:
            async for _ in Attempts(pause=self.heartbeat, stop=stop):
                devices = {d for d in self.st.servers if d in self.links}
                for d in [d for d, b in beats.items() if d not in devices or b.done()]:
                    beats.pop(d).cancel()
                for d in sorted(devices - beats.keys()):
                    beats[d] = asyncio.ensure_future(self._beat(d, stop))
        finally:
            for b in beats.values():
                b.cancel()
            await asyncio.gather(*beats.values(), return_exceptions=True)

    async def _beat(self, device: str, stop: asyncio.Event) -> None:
        async for _ in Attempts(pause=self.heartbeat, stop=stop):
            link = self.links.get(device)
            if link is None or device not in self.st.servers:
                return
            self._forget_tickets()
            await self._heartbeat(device)

    async def run_loop(self, stop: asyncio.Event) -> None:
        """Pull and compute tasks until `stop`, a refusal for good (`banned`) or the run's end (`over`)."""
        outer, stop = stop, asyncio.Event()  # set by the caller's stop, or when the run is over here
        self._halt = stop
        relay = asyncio.ensure_future(outer.wait())
        relay.add_done_callback(lambda _: stop.set())
        await self.register(first=True)
        beat = asyncio.ensure_future(self.heartbeat_loop(stop))
        try:
            while not stop.is_set() and self.banned is None and not self.over:
                check_cancelled()
                got = await self.take_one()
                if got is None:  # idle: push what it holds, then wait for work at every server at once
                    await self.sums.flush(self.sums.due(None, self.kept))
                    got = await self.wait_for_task(stop, until=self.sums.hold_left())
                if got is not None:  # held from now on (the heartbeat says so), also while pushing below
                    self.current = (got[0].device, got[1]["task"])
                await self.sums.flush(self.sums.due(None if got is None else got[1], self.kept))
                if got is None:
                    continue
                link, meta, tensors = got
                self.current = (link.device, meta["task"])
                self.stats.setdefault("first_task", time.monotonic())  # its time in the run counts from here
                started, computed, pulled = time.monotonic(), self.stats["compute_seconds"], self.stats["param_seconds"]
                try:
                    await self.process(link, meta, tensors)
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
                    await self._undone(link, meta)
                    await asyncio.sleep(self.poll)
                except RemoteError as e:
                    self.stats["dropped"] += 1
                    logger.info("%s: task %s dropped: %s", self.device_id, meta["task"], e)
                    await self._undone(link, meta)
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
                    await self._undone(link, meta)
                else:
                    self.unready = None
                finally:
                    self.current = None
            await self.sums.flush_all()  # a clean stop hands in what it has
            await self.hand_in_finished()
        finally:
            relay.cancel()
            beat.cancel()
            self.versions.drop_prefetches()
            await self._stop_waiting()

    async def _stop_waiting(self) -> None:
        """Cancel the waiting takes and hand back the tasks that arrived but were never started."""
        for fut in self.waiting.values():
            fut.cancel()
        await asyncio.gather(*self.waiting.values(), return_exceptions=True)
        self.waiting.clear()
        ready, self.ready = self.ready, []
        await asyncio.gather(*(self._hand_back(link, meta["task"], meta.get("epoch", 0)) for link, meta, _ in ready))

    async def _undone(self, link, meta: dict) -> None:
        """Hand back a task this worker could not work on (a version the stage has not reached, a
        refusal, a failure). What the stage waits for may then be queued at a server whose last
        answer said it had none, which a worker kept busy by such tasks would never ask again (a slot
        taken over at an older version waits for backward tasks of the batch it lacks while the
        frontal servers hand out tasks of later batches: every worker took, handed back and took
        those for minutes): every server is asked again, this task's server last, until a task is done."""
        await self._hand_back(link, meta["task"], meta.get("epoch", 0))
        self.more.clear()
        self.unready = link.device

    def _order(self) -> list[str]:
        """The stage's servers to ask for a task: backward servers first, rotating the start; the
        server whose last task could not be worked on goes last."""
        order = [d for d in list(self.st.backward) + list(self.st.frontal) if d in self.links]
        if not order:
            return order
        self._turn = (self._turn + 1) % len(order)
        order = order[self._turn :] + order[: self._turn]
        return sorted(order, key=lambda d: d == self.unready)

    async def _take(self, device: str, wait: float = 0.0):
        """(link, meta, tensors) of a task leased from `device`, or None; waits up to `wait` seconds
        there for one (a long poll) when asked to."""
        link = self.links[device]
        request, done = self._handing_in(device, {"wait": wait} if wait else {})
        try:
            meta, tensors = await self.call(link, "take", request, timeout=10.0 + wait)
        except RemoteError as e:
            self.hand_ins.release(device, done)
            if e.refusal is Refusal.NOT_REGISTERED:
                await self._quiet(link.call, "register", self._registration())
            if wait:
                await asyncio.sleep(self.poll)  # the answer came at once: no tight loop of refused waits
            return None
        except BaseException as e:
            self.hand_ins.release(device, done)
            if not isinstance(e, Exception):
                raise  # (cancelled: a stop)
            logger.info("%s: take from %s failed: %r", self.device_id, device, e)
            leased = e.meta.get("task") if isinstance(e, StreamCut) and isinstance(e.meta, dict) else None
            if isinstance(leased, str):  # the answer was cut after naming the task: the server leased it
                # to us; hand it back now rather than leave it until a heartbeat reclaims it (>= 5 s)
                await self._hand_back(link, leased, e.meta.get("epoch", self.epoch))
            elif isinstance(e, (ConnectionError, asyncio.TimeoutError)):
                # no answer at all: the server may have leased a task whose answer was lost. This was the
                # only take in flight there, so say so with what we hold: it re-queues the rest at once
                # (else a heartbeat does once the lease is 5 s old, the time an answer may be on its way)
                await self._quiet(link.call, "register", self._registration(device, take_lost=True), timeout=10.0)
            if wait:
                await asyncio.sleep(self.poll)
            return None
        self.hand_ins.release(device, done)
        self.hand_ins.arrived(device, done)
        self.more[device] = meta.get("more") is not False
        if not meta.get("task"):
            return None
        self.held_tickets[meta["task"]] = meta.get("lease")
        return link, meta, tensors

    def _harvest(self) -> None:
        """Move the tasks that waiting takes brought into `ready`."""
        for device, fut in list(self.waiting.items()):
            if fut.done():
                del self.waiting[device]
                got = None if fut.cancelled() or fut.exception() is not None else fut.result()
                if got is not None:
                    self.ready.append(got)

    def _pop_ready(self):
        """The best task that already arrived, in the pools' own order (lower batch, then lower
        micro-batch, then backward first): tasks that servers leased into this worker's waiting takes
        while it was busy wait for it, and the one the oldest batch waits for goes first."""

        def order(j):
            meta = self.ready[j][1]
            return priority(meta.get("batch", 0), meta.get("micro", 0), meta.get("kind"))

        i = min(range(len(self.ready)), key=order)
        return self.ready.pop(i)

    async def take_one(self):
        """A task that already arrived, else one from the first server that has one (backward servers
        first, rotating the start; a server with a waiting take is not asked twice, nor one whose last
        answer said it had no more tasks queued); None if none has."""
        self._harvest()
        if self.ready:
            return self._pop_ready()
        for device in self._order():
            if device in self.waiting or not self.more.get(device, True):
                continue
            got = await self._take(device)
            if got is not None:
                return got
        return None

    async def wait_for_task(self, stop: asyncio.Event, wait: float = TAKE_WAIT, until: float | None = None):
        """Wait up to `wait` seconds for a task at every server of the stage at once (one long-polled
        take per server): an idle worker costs each server one open call per `wait` seconds rather
        than a poll every `poll` seconds, and gets a task the moment one is cut. The first task to
        arrive is returned; one that another server hands out meanwhile waits in `ready`. With
        `until`, this returns None after that many seconds, the takes still waiting (a held gradient
        sum falls due then)."""
        for device in self._order():
            if device not in self.waiting:
                self.waiting[device] = asyncio.ensure_future(self._take(device, wait))
        if not self.waiting:
            await asyncio.sleep(self.poll)
            return None
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([*self.waiting.values(), stopped], timeout=until, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        self._harvest()
        return self._pop_ready() if self.ready else None

    # ------------------------------------------------------------------------------------------
    async def _fetch_slot(
        self, device: str, slot: int, version: int, patience: float, epoch: int, digest_only: bool
    ) -> tuple[dict, list]:
        """`get_params` of `slot` at `version` of layout epoch `epoch` from its host `device`
        (core.protocol.params.fetch_slot), over this worker's link to it."""
        call = functools.partial(self.call, self.links[device], timeout=60.0, epoch=epoch)
        return await fetch_slot(call, device, slot, version, patience, self.poll, digest_only=digest_only)

    def _own_server(self):
        """The server this worker runs in (its link to itself is a LocalLink to it), or None."""
        return getattr(self.links.get(self.device_id), "server", None)

    def _keep(self, key: tuple, kept: KeptForward) -> None:
        if kept.nbytes > self.activation_memory:
            return
        self.kept[key] = kept
        total = sum(k.nbytes for k in self.kept.values())
        while total > self.activation_memory:
            oldest = next(iter(self.kept))
            total -= self.kept.pop(oldest).nbytes

    def _lying(self, batch: int | None = None) -> bool:
        lying = self.cheat is not None and self.cheat.active(self.stats["forward"] + self.stats["backward"])
        if lying and not getattr(self, "_lie_logged", False):
            self._lie_logged = True
            logger.warning(
                "%s: cheat %s: handing in wrong results from task %d (batch %s) on%s",
                self.device_id,
                self.cheat.kind,
                self.stats["forward"] + self.stats["backward"] + 1,
                batch,
                f", one task in {self.cheat.every}" if self.cheat.every > 1 else "",
            )
        return lying

    def _corrupt(self, gin, grads, loss, batch: int | None = None):
        if not self._lying(batch):
            return gin, grads, loss
        return (
            None if gin is None else self.cheat.tensor(gin),
            {n: self.cheat.gradient(g) for n, g in grads.items()},
            self.cheat.loss(loss),
        )

    def _cached_inputs(self, t: int, m: int, a: int, b: int, epoch: int):
        for x0, y0, x in self.input_cache.get((t, m, epoch), []):
            if x0 <= a and b <= y0:
                return x[a - x0 : b - x0]
        return None

    # ------------------------------------------------------------------------------------------
    async def process(self, link, meta: dict, tensors: list) -> None:
        t = meta["batch"]
        pulling = time.monotonic()
        await self.versions.ensure(meta["version"])
        self.stats["param_seconds"] += time.monotonic() - pulling
        self.versions.prefetch_next(meta["version"])
        for key in [k for k in self.input_cache if k[0] < t - 1]:
            del self.input_cache[key]
        if meta["kind"] == "forward":  # whether its server will cut more of the batch for this worker
            self.sums.owed(t, bool(meta.get("owed")))
        if meta["kind"] == "forward" and not self.last:
            await self._forward(link, meta, tensors)
        elif meta["kind"] == "forward":
            await self._forward_backward(link, meta, tensors)
        else:
            await self._backward(link, meta, tensors)

    async def _forward(self, link, meta, tensors) -> None:
        """A forward task of a stage before the last: its rows go, cut by the next backward servers'
        segments, to those servers; each piece's pass is kept (within the memory budget) for the
        backward task of the same rows, which that server offers this worker first."""
        t, m, (a, b) = meta["batch"], meta["micro"], meta["rows"]
        x = tensors[0]  # (no labels: only the last stage computes a loss, against the run's own)
        version = meta["version"]
        self._point("before_forward")
        nxt = self.st.backward
        pieces = owners(self.rows, len(nxt), a, b)

        def fwd():
            self._point("during_forward")
            model = self.versions.model(version)
            if self.activation_memory <= 0:
                return [(forward_rows(model, x[p - a : q - a], self.torch_device), None) for _, p, q in pieces]
            return [forward_keeping(model, x[p - a : q - a], self.torch_device) for _, p, q in pieces]

        outs = await self.device.run(fwd)
        for key in [k for k in self.kept if k[0] < t - 1]:
            del self.kept[key]
        for (_, p, q), (_, kept) in zip(pieces, outs):
            if kept is not None:
                self._keep((t, m, p, q, version, meta["epoch"]), kept)  # (an epoch's own, as the inputs)
        if self._lying(t):
            outs = [(self.cheat.tensor(out), kept) for out, kept in outs]
        self.input_cache.setdefault((t, m, meta["epoch"]), []).append((a, b, x))
        if self.cheat is not None and self.cheat.kind == "unsent" and self._lying(t):
            self._finish_later(link.device, meta["task"], meta["epoch"])  # done, it says; nothing was sent
            self.stats["forward"] += 1
            return
        await asyncio.gather(
            *(
                self.call(
                    self.links[nxt[j]],
                    "push_outputs",
                    {
                        "task": meta["task"],
                        "batch": t,
                        "micro": m,
                        "rows": [p, q],
                        "frontal": meta["frontal"],
                        "lease": meta.get("lease"),
                    },
                    [out],
                    timeout=60.0,
                    epoch=meta["epoch"],
                )
                for (j, p, q), (out, _) in zip(pieces, outs)
            )
        )
        self._point("after_outputs")
        self._finish_later(link.device, meta["task"], meta["epoch"])
        self.stats["forward"] += 1

    def _backward_pass(self, version: int, x: torch.Tensor, out_grad=None, labels=None):
        """Recompute the slice on x and backpropagate; returns (input grad or None, loss_sum or None)."""
        self._point("during_backward")
        return backward_rows(
            self.versions.model(version), x, self.torch_device, self.total_tokens, out_grad=out_grad, labels=labels
        )

    async def _forward_backward(self, link, meta, tensors) -> None:
        """The last stage: forward, loss and backward in one task."""
        x, y = tensors
        gin, loss, grads = await self.device.run(lambda: self._backward_pass(meta["version"], x, labels=y))
        await self._finish(link, link, meta, gin, grads, loss)
        self.stats["forward"] += 1

    async def _finish(self, link, frontal, meta, gin, grads, loss) -> None:
        """Hand a computed task in, in the order that makes any kill point safe: the input gradient
        to the frontal server (which relays it); then the parameter gradient into the batch's sum,
        the task staying leased until the sum is credited by every server. A task on its second
        attempt (its first client vanished or was late) is pushed alone at once, so that a sum never
        overlaps another client's in part for long."""
        gin, grads, loss = self._corrupt(gin, grads, loss, meta["batch"])
        if gin is not None:
            await self.call(
                frontal,
                "push_input_grads",
                {
                    "task": meta["task"],
                    "batch": meta["batch"],
                    "micro": meta["micro"],
                    "rows": meta["rows"],
                    "lease": meta.get("lease"),
                },
                [gin],
                epoch=meta["epoch"],
            )
            self._point("after_input_grads")
            if self.cheat is not None and self.cheat.kind == "relay" and self._lying(meta["batch"]):
                await self._hand_back(link, meta["task"], meta["epoch"])  # (no push would check the lie)
                return
        if meta["epoch"] != self.epoch:  # a failover voided it: it is run again in the new epoch
            raise RemoteError(
                f"task {meta['task']} belongs to layout epoch {meta['epoch']}, the run is at {self.epoch}"
            )
        if meta.get("attempt", 1) > 1:
            await self.sums.push_alone(link, meta, grads, loss)
        else:
            self.sums.add(link, meta, grads, loss)

    async def _backward(self, link, meta, tensors) -> None:
        t, m, (a, b) = meta["batch"], meta["micro"], meta["rows"]
        (g,) = tensors
        frontal = self.links[meta["frontal"]]
        kept = self.kept.pop((t, m, a, b, meta["version"], meta["epoch"]), None)
        if kept is not None:  # this worker ran the forward pass of these very rows: no recompute

            def bwd():
                self._point("during_backward")
                return backward_kept(self.versions.model(meta["version"]), kept, g, self.torch_device)

            gin, _, grads = await self.device.run(bwd)
            self.stats["recompute_avoided"] += 1
            await self._finish(link, frontal, meta, gin, grads, None)
            self.stats["backward"] += 1
            return
        self.stats["recomputed"] += 1
        x = self._cached_inputs(t, m, a, b, meta["epoch"])
        if x is None:
            _, (x,) = await self.call(
                frontal, "get_inputs", {"batch": t, "micro": m, "rows": [a, b]}, epoch=meta["epoch"]
            )
        gin, _, grads = await self.device.run(lambda: self._backward_pass(meta["version"], x, out_grad=g))
        await self._finish(link, frontal, meta, gin, grads, None)
        self.stats["backward"] += 1

    def measure_compute(self, rows: int = 1, repeats: int = 5) -> float:
        """Rows per second of this worker's slice on its device (EmulatedDevice.measure)."""
        return self.device.measure(self.model, self.cfg, rows, repeats)
