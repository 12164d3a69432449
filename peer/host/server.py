"""`ServerHost`: one reliable server's life. `peer serve --reliable` parses its arguments and runs it.

    start      its DHT node and p2p daemon (or its supervisor's), the check that others can dial
               it back
    find       the run's config record: the same run key and the same training flags, or a
               one-line error (exit 2) that names both sides; then the lines another host needs
               (initial_peers=, run=)
    build      the stage server, from its checkpoint folder when it has one
    wait       for its stage's servers, for as long as it takes, said once a minute
    serve      the announcer, the failure detector, the maintenance loop, its own worker
    finish     at the run's last step, once every server of the run has reached it: its checkpoint
               is written, `run R finished at step N (loss L)` is said, and it exits 0 (unless
               --hold: it then serves its final state until stopped)
    stop       on SIGTERM/SIGINT (or a fence): offline record, tasks cancelled, checkpoint closed

Each state change is one line on stdout (peer.host.state.StateLine)."""

from __future__ import annotations

import asyncio
import logging
import time

from core.protocol.records import RecordState
from core.protocol.retry import Attempts
from peer.errors import NetworkError, UsageError
from peer.host.assembly import build_parts
from peer.host.entry import RunEntry
from peer.host.known_peers import KnownPeers
from peer.host.options import ServerOptions
from peer.host.state import PeerState, StateLine
from peer.runtime import Interrupted, freeze_startup_objects, until_stopped

logger = logging.getLogger("hivepipe.serve")

FAREWELL_S = 10.0  # seconds a finished server waits at most for its volunteers to learn the run is over
TASKS_END_S = 5.0  # seconds a stopping server waits for its tasks to end once cancelled


class ServerHost:
    """One server of the run, `device` of `layout`. `held`: a peer.node.HeldNode (the DHT node of a
    supervisor, which outlives this process), else it starts its own."""

    def __init__(self, options: ServerOptions, cfg, layout, device: str, run_cfg, corpus=None, held=None, out=None):
        if not isinstance(options, ServerOptions):
            raise TypeError(f"ServerHost takes ServerOptions (ServerOptions.from_args), got {type(options).__name__}")
        self.options, self.cfg, self.layout, self.device, self.run_cfg = options, cfg, layout, device, run_cfg
        self.corpus, self.held = corpus, held
        self.stage, self.role, _ = layout.locate(device)
        self.state = StateLine(device, out=out)
        self.server = self.directory = self.announcer = self.worker = None
        self.compute = 0.0  # rows/s of its own worker (measured at the start; 0 with --no-compute)
        self.writer = self.trainlog = None
        self.tasks: list[asyncio.Task] = []
        self.finished = asyncio.Event()  # every server of the run reached the last step
        self.halt = None
        # the run's other servers' multiaddrs, kept in the checkpoint folder for a restart (known_peers.py)
        self.known = KnownPeers(options.checkpoint_dir, device)
        # how it enters the run: its node, the run's config record (entry.py)
        self.entry = RunEntry(options, cfg, layout, device, run_cfg, held, self.known, self.state)
        self.report = None  # what the run has done, as this server sees it (report.py)

    # ---- start ---------------------------------------------------------------------------------

    # what its entry started (entry.py): also what `stop` closes when the start itself failed
    @property
    def dht(self):
        return self.entry.dht

    @property
    def p2p(self):
        return self.entry.p2p

    @property
    def maddrs(self) -> list[str]:
        return self.entry.maddrs

    @property
    def peer_id(self) -> str:
        return self.entry.peer_id

    def _die_at(self, version: int) -> None:
        """--die-at-version: lost for good right after applying that step (SIGKILL of the whole
        process group: no offline record, no checkpoint of the step, as when the host dies)."""
        if version >= self.options.die_at_version:
            from peer.volunteer.faults import die_here

            logger.warning("%s: applied step %d: lost here for good (--die-at-version)", self.device, version)
            die_here()

    def _remember_peers(self) -> None:
        """Keep the other servers' announced multiaddrs (KnownPeers): a restart without
        --initial-peers (the first server's own command) joins the run's DHT through them."""
        self.known.remember(m for peer, ms in self.directory.addresses.items() if peer != self.peer_id for m in ms)

    async def enter(self, stop: asyncio.Event) -> None:
        """Start its node, find the run, keep the run key, say where it is (peer/host/entry.py)."""
        entry = self.entry
        await until_stopped(entry.start(stop), stop)
        await until_stopped(entry.find_run(), stop)
        entry.keep_run_key()
        entry.say_where()

    # ---- build the stage server -----------------------------------------------------------------

    async def build(self) -> None:
        """Its stage server and the parts that serve it (peer/host/assembly.py)."""
        p = await build_parts(self)
        self.links, self.slowdown, self.directory, self.connector = p.links, p.slowdown, p.directory, p.connector
        self.server, self.compute, self.announcer, self.halt, self.report = (
            p.server,
            p.compute,
            p.announcer,
            p.halt,
            p.report,
        )
        self.detector, self.maintenance, self.writer, self.trainlog = p.detector, p.maintenance, p.writer, p.trainlog

    def finish(self) -> None:
        """The run is over: from now on the answers to heartbeats say so, and so does this server's
        record while it stays (--hold): a volunteer that comes later learns the end from it when the
        records of the servers that left have expired."""
        self.server.run_over = True
        if self.announcer is not None:
            self.announcer.record_state = RecordState.FINISHED
        self.finished.set()

    def _on_step(self, version: int):
        if version == self.run_cfg.steps and self.announcer.online.is_set():
            return self.announcer.announce_quietly(RecordState.ONLINE)
        return None

    # ---- states ---------------------------------------------------------------------------------

    def missing_servers(self, devices=None) -> list[str]:
        devices = devices if devices is not None else [d for s in self.server.layout.stages for d in s.servers]
        return [d for d in devices if d not in self.directory.known]

    def run_finished(self) -> bool:
        """Every server of the current layout has announced the run's last version."""
        steps = self.run_cfg.steps
        devices = [d for s in self.server.layout.stages for d in s.servers]
        # (records of the current layout epoch only: a record read before a failover can show a
        # version that the failover's re-run has not reached yet)
        return self.server.version >= steps and all(
            d == self.device
            or (self.directory.versions.get(d, 0) >= steps and self.directory.epochs.get(d, -1) == self.server.epoch)
            for d in devices
        )

    def _halt_changed(self, reason: str | None, stopped_for: float = 0.0) -> None:
        if reason is not None:
            self.state.say(PeerState.STOPPED, reason)
        else:
            self.state.say(PeerState.SERVING, f"the run goes on again after {stopped_for:.0f} s stopped")

    def _look(self) -> None:
        """Say the state the run is in, from the announcer's latest round."""
        if self.finished.is_set() or self.stopping:
            return
        if self.run_finished():
            self._finished_looks += 1
            if self._finished_looks >= 2:  # on two looks a period apart: no stale read ends the run
                self.finish()
            return
        self._finished_looks = 0
        # (not itself: its own record is read back a period after it was first announced)
        missing = [d for d in self.missing_servers() if d != self.device]
        if missing:
            self.state.say(PeerState.WAITING, f"for the run's servers {' '.join(missing)} to announce themselves")
        elif self.server.halted:
            self.state.say(PeerState.STOPPED, self.server.halted)  # (said by the detector; reminded here)
        elif self.serving_detail and self.state.state is not PeerState.SERVING:
            self.state.say(PeerState.SERVING, self.serving_detail)
        elif self.state.state is PeerState.SERVING:
            self.state.progress(self.report.progress_text())

    # ---- serve ----------------------------------------------------------------------------------

    stopping = False
    serving_detail = ""
    _finished_looks = 0

    async def wait_for_stage(self, stop: asyncio.Event) -> bool:
        """Until every server of this stage has been seen in a record (its own worker computes with
        all of them), for as long as it takes (the state line, said by `_look`, names them once a
        minute); False if stopped meanwhile, also when fenced (failed over while it was away)."""
        devices = self.server.st.servers
        async for _ in Attempts(pause=0.5, stop=stop):
            missing = self.missing_servers(devices)
            if not missing:
                return True
            try:
                await self.directory.refresh()
            except Exception as e:
                logger.debug("%s: reading the run's servers failed: %r", self.device, e)
        return False

    async def _catch_up_epoch(self, target: int, stop: asyncio.Event) -> None:
        """Restarted while the run is at a later layout epoch than the log says (a crash between
        taking a slot over and logging the epoch): take the epoch record from another server of
        it and adopt it (the replicas it needs are on disk)."""
        server = self.server
        async for _ in Attempts(f"{self.device}: catching up with layout epoch {target}", pause=1.0, stop=stop):
            if server.epoch >= target:
                return
            await self.directory.refresh()
            for d in [d for s_ in server.layout.stages for d in s_.servers if d != self.device]:
                link = self.connector(d)
                if link is None:
                    continue
                try:
                    record, _ = await link.call("get_layout", {}, timeout=10.0)
                    if record.get("epoch", 0) > server.epoch:
                        server.epochs.adopt(record)
                        logger.warning("%s: caught up with layout epoch %d from %s", self.device, server.epoch, d)
                        return
                except Exception as e:
                    logger.debug("%s: get_layout from %s: %r", self.device, d, e)

    def _report_crash(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: background task failed", self.device, exc_info=task.exception())

    async def serve(self, stop: asyncio.Event) -> None:
        from peer.volunteer.worker import StageWorker

        args, server = self.options, self.server
        self.tasks = [
            asyncio.ensure_future(self.announcer.run(stop)),
            asyncio.ensure_future(self.detector.run(stop, self.announcer.online)),
            asyncio.ensure_future(self.maintenance.run(stop)),
        ]
        current = self.entry.current_config or {}
        run_epoch = current.get("epoch", 0)
        if isinstance(run_epoch, int) and run_epoch > server.epoch:
            try:
                await asyncio.wait_for(self._catch_up_epoch(run_epoch, stop), 120)
            except asyncio.TimeoutError:
                logger.warning(
                    "%s: the run is at layout epoch %d, this server at %d: no server of the run gave its "
                    "record within 120 s; going on (its coordinator sends it again)",
                    self.device,
                    run_epoch,
                    server.epoch,
                )
        if not args.no_compute and await self.wait_for_stage(stop):
            # after a replayed failover the server is already in a later layout epoch: its worker starts there
            server.directory.update(self.directory.servers)
            self.worker = worker = StageWorker(
                run=self.run_cfg,
                layout=server.layout,
                cfg=self.cfg,
                stage=self.stage,
                device_id=self.device,
                links={d: self.connector(d) for d in server.st.servers},
                compute=1.0,
                torch_device=args.device,
                slowdown=self.slowdown,
                activation_memory=int(args.activation_memory * 2**20),
            )
            worker.epoch = server.epoch
            worker.compute = self.compute
            self.tasks.append(asyncio.ensure_future(worker.run_loop(stop)))
        for t in self.tasks:
            t.add_done_callback(self._report_crash)
        freeze_startup_objects()
        st = self.layout.stages[self.stage]
        stretched = (
            f", compute stretched x{self.slowdown:g} by the link profile"
            if self.slowdown > 1 and not args.no_compute
            else ""
        )
        self.serving_detail = (
            f"stage {self.stage} {self.role}, layers {st.layers[0]}-{st.layers[1]}{stretched}, as {self.peer_id}"
        )
        if not stop.is_set():
            self._look()

    async def farewell(self, stop: asyncio.Event) -> None:
        """Stay until every volunteer registered here has heartbeaten since the run ended (that answer
        alone tells it so: the answer to a `take` does not), at most FAREWELL_S: the run's records leave
        the DHT with its servers, so a volunteer would otherwise learn the end only from servers that no
        longer answer."""
        server = self.server
        deadline = time.monotonic() + FAREWELL_S
        while time.monotonic() < deadline and not stop.is_set():
            told = all(p in server.registry.told_over for p in server.clients if not server.directory.is_server(p))
            if told:
                return
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    # ---- finish and stop ------------------------------------------------------------------------

    def say_finished(self) -> None:
        if self.halt is not None:  # stopped until now: it went on to the end
            self.halt.went_on()
        loss = self.report.loss_at_end()
        said = "" if loss is None else f" (loss {loss:.4f})"
        self.state.say(PeerState.FINISHED, f"run {self.run_cfg.run_id} finished at step {self.run_cfg.steps}{said}")

    async def stop(self, why: str) -> None:
        from peer.node import close_replica, stop_dht

        self.stopping = True
        if self.state.state is not PeerState.FINISHED:
            self.state.say(PeerState.LEAVING, why)
        if self.announcer is not None:
            final = RecordState.FINISHED if self.finished.is_set() else RecordState.OFFLINE
            try:
                await asyncio.wait_for(self.announcer.announce(final), 5)
            except Exception:
                pass
        for t in self.tasks:
            t.cancel()
        if self.tasks:
            _, stuck = await asyncio.wait(self.tasks, timeout=TASKS_END_S)
            if stuck:  # (each loop checks for a cancellation a call swallowed: core.protocol.aio)
                logger.warning(
                    "%s: %d of its tasks did not end when cancelled; leaving without them", self.device, len(stuck)
                )
        if self.writer is not None:
            self.writer.close()  # the last step's checkpoint is on disk before the process ends
        if self.trainlog is not None:
            self.trainlog.close()
        if self.server is not None and self.server.old_versions is not None:
            self.server.old_versions.close()
        if self.held is None and self.dht is not None:
            await close_replica(self.p2p)
            stop_dht(self.dht)

    async def run(self, stop: asyncio.Event) -> int:
        """The whole life: 0 when the run finished (or a signal stopped it). UsageError (the command's
        exit 2) when this server is not part of the run: another run key, other flags, a live server
        holding its identity, or failed over (found at the start, or while it was away)."""
        try:
            # each phase ends as soon as a signal comes, whatever it waits for
            await self.enter(stop)
            await until_stopped(self.build(), stop)
            await self.serve(stop)
            if self.server.version >= self.run_cfg.steps and not self.finished.is_set():
                # restarted after its last step: the others say so within a few periods, or are gone
                try:
                    await asyncio.wait_for(self.finished.wait(), 3 * self.run_cfg.announce_period)
                except asyncio.TimeoutError:
                    self.finish()
            ended = asyncio.ensure_future(self.finished.wait())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({ended, stopped}, return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
            stopped.cancel()
            if self.finished.is_set() and not stop.is_set():
                await self.farewell(stop)
                if self.writer is not None:  # the last step's checkpoint is on disk before it says so
                    await asyncio.wrap_future(self.writer.flush())
                self.report.write_summary(self.options.checkpoint_dir)
                self.say_finished()
                if self.options.hold:
                    self.state.say(PeerState.FINISHED, "holding its final state (--hold) until stopped")
                    await stop.wait()
            fenced = self.announcer.fenced if self.announcer is not None else []
            await self.stop(fenced[0] if fenced else "stopped")
            if fenced:  # (as when find_run finds the layout without it: the command says why, exit 2)
                raise UsageError(fenced[0])
            return 0
        except BaseException as e:
            if not self.stopping:
                if isinstance(e, Interrupted):
                    why = "stopped"
                elif isinstance(e, (UsageError, NetworkError)):
                    why = str(e)
                else:
                    why = f"{type(e).__name__}: {e}"
                await asyncio.shield(self.stop(why or type(e).__name__))
            raise
