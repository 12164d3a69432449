"""`VolunteerSession`: one volunteer's life. `peer join` parses its arguments and runs it.

    start      its DHT node (client mode: it dials out only, and works behind NAT)
    find       the run's config record; a run published under another run key than --run-id's
               fingerprint is a one-line error (exit 2) naming both; a finished run is said, exit 0
    wait       for the run's servers (after a failover, the current layout's)
    choose     a stage (`--stage auto`: measured links and the planner's rule)
    work       pull tasks from the stage's servers, announce itself, move to another stage when it
               is needed more there, say when the run stops and goes on
    finish     the run reached its last step: what it did is said, exit 0
    leave      on SIGTERM/SIGINT, a ban (exit 3) or an error: the task it holds is handed back

Each state change is one line on stdout (peer.host.state.StateLine)."""

from __future__ import annotations

import asyncio
import logging

from core.protocol.records import RecordState, volunteer_period
from core.protocol.refusals import Refusal
from core.protocol.retry import Attempts
from peer.errors import UsageError
from peer.host.join_clock import JoinClock
from peer.host.state import PeerState, StateLine
from peer.host.tally import Tally, client_record
from peer.runtime import freeze_startup_objects, interruptible, link_emulator, until_stopped

logger = logging.getLogger("hivepipe.join")


class VolunteerSession:
    def __init__(self, args, device: str, state: StateLine | None = None):
        self.args, self.device = args, device
        self.state = state or StateLine(device)
        self.dht = self.p2p = self.run_cfg = self.cfg = self.layout = self.directory = None
        self.epoch = 0  # the layout epoch of `layout` (the run config carries it after a failover)
        self.end_layout, self.end_epoch = None, -1  # the newest layout the run config showed, and its epoch
        self.peer_id = ""
        self.tally = Tally()  # what it did, stage by stage (peer/host/tally.py)
        self.join_clock = JoinClock()  # where its join's seconds went (peer/host/join_clock.py)
        self.banned: str | None = None  # a refusal for good, its words and its code (worker.StageWorker)
        self.refusal = None
        self.over = False  # the run reached its last step
        self.worker = None  # the StageWorker of the stage it works on now (None between stages)
        self.halt = None

    # ---- start and find the run ----------------------------------------------------------------

    async def start(self, stop: asyncio.Event) -> None:
        from peer.errors import NetworkError
        from peer.node import NetworkStartError, start_dht

        args = self.args
        try:  # a volunteer dials out only (client mode): it works behind NAT without opening a port
            with interruptible(stop):  # (it waits for the initial peers without giving the loop a turn)
                self.dht = start_dht(
                    args.initial_peers,
                    run_id=args.run_id,
                    run_fp=args.run_fp,
                    client_mode=True,
                    identity_path=args.identity_path,
                    timeout=args.timeout or 120.0,
                    on_wait=self.state.waiting_for_initial_peers,
                )
        except NetworkStartError as e:
            raise NetworkError(str(e)) from None
        self.p2p = await self.dht.replicate_p2p()
        self.peer_id = str(self.dht.peer_id)
        self.join_clock.mark("dht")

    async def _config(self):
        """The run's config, or None while there is none; UsageError when the run exists under
        another run key than the one --run-id names."""
        from core.protocol import record_store

        run = await record_store.read_config(self.dht, self.args.run_id)
        if run is None and self.args.run_fp is not None:
            others = await record_store.other_run_keys(self.dht)
            if others:
                raise UsageError(
                    f"run {self.args.run_id!r} is published under run key {', '.join(others)}, not the "
                    f"{self.args.run_fp} that --run-id names: check the fingerprint (the run= line its "
                    "servers print)"
                )
        return run

    async def find_run(self, stop: asyncio.Event) -> bool:
        from core.layout import RunLayout
        from core.model.config import run_model
        from peer.directory import Directory

        args = self.args
        run = await self.state.wait_for(
            stop, f"run {args.run_id!r} to appear in the DHT (its config record)", self._config
        )
        if run is None:
            return False
        try:
            self.cfg = run_model(run.model, run.arch)
        except ValueError as e:
            raise UsageError(f"run {run.run_id!r} names a model this peer cannot build: {e}") from None
        self.run_cfg = run
        self.layout = RunLayout.from_dict(run.layout, self.cfg.layers)
        if args.stage != "auto" and int(args.stage) >= self.layout.num_stages:
            raise UsageError(f"--stage {args.stage}: the run has {self.layout.num_stages} stages")
        self.directory = Directory(self.dht, run.run_id, self.layout.num_stages)
        self.join_clock.mark("run")
        return True

    async def _all_servers(self):
        """The run's current layout once all its servers are in the DHT: a failover while we wait
        changes the layout (the config record carries the current epoch's), and a lost server
        never comes back."""
        current = await self._current_layout()
        if current is not None:
            # that layout's epoch: a first request of an older one is refused ("stale epoch")
            self.layout, self.epoch = current
        await self.directory.refresh()
        if self.finished():
            return True
        return True if all(d in self.directory.servers for s in self.layout.stages for d in s.servers) else None

    async def _current_layout(self):
        """(layout, epoch) as the run config carries them now (after a failover: the current epoch's),
        or None when the record is not there; the layout `finished` judges the end by follows it."""
        from core.layout import RunLayout
        from core.protocol import record_store

        value = await record_store.read_config_value(self.dht)
        if not (isinstance(value, dict) and isinstance(value.get("layout"), dict)):
            return None
        layout = RunLayout.from_dict(value["layout"], self.cfg.layers)
        epoch = value["epoch"] if isinstance(value.get("epoch"), int) and value["epoch"] >= 0 else 0
        if epoch >= self.end_epoch:
            self.end_layout, self.end_epoch = layout, epoch
        return layout, epoch

    def finished(self) -> bool:
        """A server of the newest layout known announced the run finished, or every one of them its
        last version (the layout the run config shows now: a server failed over since this volunteer
        started on its stage stays at the version it was lost at, and a volunteer whose own stage kept
        its servers learns of that failover only from the config)."""
        steps = self.run_cfg.steps
        layout = self.end_layout or self.layout
        devices = [d for s in layout.stages for d in s.servers]
        if self.directory.finished & set(devices):  # (a server says so once every server reached the end)
            return True
        return bool(devices) and all(self.directory.versions.get(d, -1) >= steps for d in devices)

    async def wait_for_servers(self, stop: asyncio.Event) -> bool:
        servers = " ".join(d for s in self.layout.stages for d in s.servers)
        what = f"the servers of run {self.run_cfg.run_id} in the DHT ({servers} at the start)"
        seen = await self.state.wait_for(stop, what, self._all_servers) is not None
        self.join_clock.mark("servers")
        return seen

    async def choose_stage(self, stop: asyncio.Event, slowdown: float):
        """(stage, picker): the stage to work on, and the picker that re-checks it (`--stage auto`)."""
        from peer.volunteer.device import measured_compute
        from peer.volunteer.stage_choice import StagePicker

        args = self.args
        if args.stage != "auto":
            return int(args.stage), None
        picker = StagePicker(
            self.run_cfg,
            self.layout,
            self.cfg,
            self.directory,
            self.p2p,
            self.links_emulator,
            self.peer_id,
            args.probe_bytes,
            args.compute or measured_compute(self.run_cfg, self.layout, self.cfg, 0, args.device, slowdown),
        )

        async def measured():
            await picker.measure()
            return True

        if await self.state.wait_for(stop, "link measurements to every server", measured, poll=2.0) is None:
            return None, None
        decision = await self.state.wait_for(stop, "the stage records to choose a stage", lambda: picker.decide(None))
        if decision is None:
            return None, None
        return decision.stage, picker

    # ---- work -----------------------------------------------------------------------------------

    async def look_at_run(self) -> None:
        """Read the records: the run stopped, going on, or over."""
        run = self.run_cfg
        try:
            await asyncio.wait_for(self._current_layout(), 10.0)
            await asyncio.wait_for(self.directory.refresh(), 10.0)
            self.halt.update(
                self.directory.halted(run.announce_period), max(self.directory.versions.values(), default=0)
            )
        except Exception as e:
            logger.debug("reading the stage records failed: %r", e)
            return
        if self.finished():
            self.over = True
        elif self.halt.reason is not None:
            self.state.say(PeerState.STOPPED, self.halt.reason)  # (reminded once a minute)

    def _halt_changed(self, reason: str | None, stopped_for: float = 0.0) -> None:
        if reason is not None:
            self.state.say(PeerState.STOPPED, reason)
        else:
            self.state.say(PeerState.SERVING, f"the run goes on again after {stopped_for:.0f} s stopped")

    async def watch_run(self, stop: asyncio.Event, over: asyncio.Event) -> None:
        """Say so when the run stops (a server announces that a role lost its last server), a
        minute while it stays stopped, and when it goes on; set `over` at its last step. The
        directory (and the servers' addresses, which a restarted server may have changed) stays
        fresh meanwhile: read every two announce periods, or once a minute while calm (run_watch.py)."""
        from peer.host.run_watch import ReadSchedule, calm

        self.reads = ReadSchedule(self.run_cfg.announce_period)
        async for _ in Attempts(pause=self.reads.look, stop=stop):
            if not self.reads.due(calm(self.worker, self.halt)):
                continue
            await self.look_at_run()
            if self.over:
                over.set()
                return

    working_on = ""

    async def _publish(self, stage: int, worker, state: str) -> None:
        from core.protocol import record_store, records

        rec = records.record_to_dict(client_record(self.device, stage, worker, state))
        ttl = records.record_ttl(records.volunteer_period(self.run_cfg.announce_period))
        await record_store.publish(self.dht, rec, ttl=ttl, stage=stage)

    def _step(self, step: str) -> None:
        """A step of its join ended (peer/host/join_clock.py); at the first task, where it went."""
        self.join_clock.mark(step)
        if step == "first_task":
            logger.info("%s: %s", self.device, self.join_clock.said())

    async def work_on(self, stage: int, picker, slowdown: float, stop: asyncio.Event, over: asyncio.Event):
        """Work on `stage` until stopped, the run is over, or another stage needs this volunteer
        more; returns the stage to move to (or None)."""
        from peer.volunteer.worker import StageWorker

        args, run, device = self.args, self.run_cfg, self.device
        st = self.layout.stages[stage]
        links = {d: self.directory.link(self.p2p, d, self.links_emulator, compress=run.compress) for d in st.servers}
        worker = StageWorker(
            run=run,
            layout=self.layout,
            cfg=self.cfg,
            stage=stage,
            device_id=device,
            links=links,
            compute=1.0,
            torch_device=args.device,
            slowdown=slowdown,
            die_at=args.die_at,
            cheat=args.cheat,
            activation_memory=int(args.activation_memory * 2**20),
            epoch=self.epoch,
            on_step=self._step,
            param_deltas=not args.no_param_deltas,
        )
        worker.compute = args.compute or worker.measure_compute()
        self.join_clock.mark("compute")
        self.worker = worker
        stretched = f" (compute stretched x{slowdown:g} by the link profile)" if slowdown > 1 else ""
        verb = "moved in run" if self.tally.stages_worked else "joined run"
        self.working_on = (
            f"{verb} {run.run_id} as {device} ({self.peer_id}) on stage {stage}, compute {worker.compute:.3g} rows/s"
            f"{stretched}"
        )
        self.state.say(PeerState.SERVING, self.working_on)
        leave = asyncio.Event()  # set when the run stops us, ends, or another stage needs us more
        moving: list[int] = []

        async def relay(event: asyncio.Event):
            await event.wait()
            leave.set()

        async def announce():
            async for _ in Attempts(pause=volunteer_period(run.announce_period), stop=leave):
                try:
                    await self._publish(stage, worker, RecordState.ONLINE)
                except Exception as e:
                    logger.debug("announce failed: %r", e)

        async def pause(seconds: float) -> bool:
            """Sleep; True if we are leaving meanwhile."""
            try:
                await asyncio.wait_for(leave.wait(), seconds)
                return True
            except asyncio.TimeoutError:
                return False

        async def rebalance():
            first_look = min(args.rebalance_period, 3 * run.announce_period + self.rng.uniform(0.0, 2.0))
            better = await picker.better_stage(device, stage, args.rebalance_period, first_look, self.rng, pause)
            if better is not None:
                moving.append(better)
                leave.set()

        helpers = [
            asyncio.ensure_future(relay(stop)),
            asyncio.ensure_future(relay(over)),
            asyncio.ensure_future(announce()),
        ]
        if picker is not None and args.rebalance_period > 0:
            helpers.append(asyncio.ensure_future(rebalance()))
        freeze_startup_objects()
        await worker.run_loop(leave)  # returns once what it holds is finished and its gradients pushed
        for h in helpers:
            h.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        if worker.current is not None:  # a clean stop hands its task back at once
            dev, task = worker.current
            try:
                await links[dev].call("fail", {"task": task}, timeout=5)
            except Exception:
                pass
        try:  # say at once that we left this stage, rather than let the record expire
            await self._publish(stage, worker, RecordState.OFFLINE)
        except Exception as e:
            logger.debug("offline announce failed: %r", e)
        worker.device.shutdown()
        self.worker = None
        self.tally.add(stage, worker.stats)
        if worker.banned is not None:
            self.banned, self.refusal = worker.banned, worker.refusal
            return None
        if worker.over:  # a server of its stage answered that the run is over
            self.over = True
            over.set()
            return None
        self.layout, self.epoch = worker.layout, worker.epoch  # as its last failover left them
        return moving[0] if moving and not stop.is_set() and not over.is_set() else None

    # ---- the whole life -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """0 when the run is over or a signal stopped it; 3 when the run refused this volunteer for
        good (banned, not admitted)."""
        import random

        import torch

        from peer.directory import HaltNotice
        from peer.node import close_replica, stop_dht

        torch.set_num_threads(1)
        await until_stopped(self.start(stop), stop)
        try:
            self.rng = random.Random(self.peer_id)
            if not await self.find_run(stop) or not await self.wait_for_servers(stop):
                self.state.say(PeerState.LEAVING, "stopped before it joined")
                return 0
            run = self.run_cfg
            if self.finished():
                self.state.say(
                    PeerState.FINISHED, f"run {run.run_id} already finished at step {run.steps}: nothing to do"
                )
                return 0
            self.links_emulator = link_emulator(self.args, self.device)
            slowdown = self.args.slowdown or self.links_emulator.compute_slowdown()
            stage, picker = await self.choose_stage(stop, slowdown)
            self.join_clock.mark("stage")
            if stage is None:
                self.state.say(PeerState.LEAVING, "stopped before it joined")
                return 0
            self.halt = HaltNotice(self.device, clear_after=6 * run.announce_period, on_change=self._halt_changed)
            over = asyncio.Event()
            watcher = asyncio.ensure_future(self.watch_run(stop, over))
            while stage is not None:
                stage = await self.work_on(stage, picker, slowdown, stop, over)
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            if self.banned is not None:  # a refusal that will not change: said once, exit 3
                what = "banned from run" if self.refusal is Refusal.BANNED else "refused by run"
                self.state.say(
                    PeerState.LEAVING,
                    f"{what} {run.run_id} as {self.device} ({self.peer_id}) after {self.tally.tasks()}: {self.banned}",
                )
                return 3
            if over.is_set():
                # stopped when it learned the end (from a server's answer, or records in which a
                # server's stop is still fresh): the run went on to its last step meanwhile
                self.halt.went_on()
                self.state.say(PeerState.FINISHED, f"run {run.run_id} is over at step {run.steps}: {self.tally.said()}")
            else:
                self.state.say(PeerState.LEAVING, f"left run {run.run_id} as {self.device}: {self.tally.said()}")
            return 0
        finally:
            await close_replica(self.p2p)
            stop_dht(self.dht)
