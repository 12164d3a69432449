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
import os
import time

from core.protocol.retry import Attempts
from peer.errors import NetworkError, UsageError
from peer.host.announcer import Announcer
from peer.host.failures import PROBE_S, FailureDetector
from peer.host.known_peers import KnownPeers
from peer.host.maintenance import Maintenance
from peer.host.network import check_own_reachability, start_server_dht
from peer.host.options import ServerOptions
from peer.host.report import RunReport
from peer.host.run_config import differing_flags
from peer.host.state import PeerState, StateLine
from peer.runtime import Interrupted, freeze_startup_objects, interruptible, link_emulator, until_stopped

logger = logging.getLogger("hivepipe.serve")

FAREWELL_S = 10.0  # seconds a finished server waits at most for its volunteers to learn the run is over
TASKS_END_S = 5.0  # seconds a stopping server waits for its tasks to end once cancelled
KNOWN_PEERS_TIMEOUT = 15.0  # seconds a restart waits for the peers it knew before it starts alone


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
        self.dht = self.p2p = self.server = self.directory = self.announcer = self.worker = None
        self.compute = 0.0  # rows/s of its own worker (measured at the start; 0 with --no-compute)
        self.writer = self.trainlog = None
        self.maddrs: list[str] = []
        self.joined_through: list[str] = list(options.initial_peers)  # (the peers its DHT node joined through)
        self.peer_id = ""
        self.current_config: dict | None = None
        self.tasks: list[asyncio.Task] = []
        self.finished = asyncio.Event()  # every server of the run reached the last step
        self.halt = None
        # the run's other servers' multiaddrs, kept in the checkpoint folder for a restart (known_peers.py)
        self.known = KnownPeers(options.checkpoint_dir, device)
        self.report = None  # what the run has done, as this server sees it (report.py)

    # ---- start ---------------------------------------------------------------------------------

    async def start(self, stop: asyncio.Event) -> None:
        from peer.reachability import DialBackService

        args = self.options
        if self.held is None:
            # (an identity on disk before the start may be a live server's: refuse_a_live_twin)
            existed = bool(args.identity_path) and os.path.exists(args.identity_path)
            with interruptible(stop):  # (it waits for the initial peers without giving the loop a turn)
                try:
                    self.dht = self._start_dht()
                except NetworkError as e:
                    if not existed:
                        raise
                    # (a second process under a live server's peer id can fail here: the peers it joins
                    # through dial that peer id back and reach the other one)
                    raise NetworkError(
                        f"{e}. If the identity {args.identity_path} is held by a live server of the run, that "
                        "alone makes this start fail: stop that server first, or give this one another "
                        "--identity-path"
                    ) from None
            self.p2p = await self.dht.replicate_p2p()
            from peer.addresses import announced_maddrs

            self.maddrs = announced_maddrs(self.dht)
        else:
            # (a supervised server's first process checks what its supervisor's start found; a
            # restarted one is the supervisor's own, under the identity it already holds)
            existed = args.identity_existed and not args.restarted
            t0 = time.perf_counter()
            self.dht, self.maddrs = self.held.dht, self.held.maddrs
            self.p2p = await self.held.replicate()
            logger.info("%s: attached to its supervisor's DHT node in %.1f s", self.device, time.perf_counter() - t0)
        self.peer_id = str(self.dht.peer_id)
        if existed:
            await self.refuse_a_live_twin()
        await DialBackService().add_p2p_handlers(self.p2p)
        if not args.no_reachability_check and not args.restarted:
            await check_own_reachability(
                self.dht,
                self.p2p,
                self.joined_through,
                self.run_cfg.run_id,
                self.layout.num_stages,
                self.maddrs,
                self.device,
            )

    def _die_at(self, version: int) -> None:
        """--die-at-version: lost for good right after applying that step (SIGKILL of the whole
        process group: no offline record, no checkpoint of the step, as when the host dies)."""
        if version >= self.options.die_at_version:
            from peer.volunteer.faults import die_here

            logger.warning("%s: applied step %d: lost here for good (--die-at-version)", self.device, version)
            die_here()

    def keep_run_key(self) -> None:
        """Write the run key this start made (--run-key named no file) now that the run admitted this
        server: one refused (another run's key, other flags, an address it cannot listen on) leaves no
        key file behind. UsageError when another server wrote a different key at that path meanwhile."""
        from core.protocol.trust import SigningKey

        args = self.options
        if not args.run_key_new:
            return
        try:
            args.run_key_obj.save(args.run_key)
        except FileExistsError:  # (a server started beside this one with the same new path wrote first)
            written = SigningKey.load(args.run_key).fingerprint
            if written != args.run_fp:
                raise UsageError(
                    f"--run-key {args.run_key} was written by another server meanwhile (fingerprint {written}), "
                    f"while this one made {args.run_fp}: start this server again to use the file"
                ) from None
        except OSError as e:
            raise UsageError(f"--run-key {args.run_key}: {e}") from None
        else:
            logger.warning(
                "made a new run key %s (fingerprint %s): copy it to this run's other servers", args.run_key, args.run_fp
            )
        args.run_key_new = False

    def say_where(self) -> None:
        """The run's two lines on stdout, once this server is known to be part of the run (its key,
        flags and place checked by find_run: a server refused says only why, on stderr)."""
        # the first: what a volunteer (or another server) passes to --initial-peers
        print("initial_peers=" + " ".join(self.maddrs), flush=True)
        # the second: what a volunteer passes to --run-id, so that it believes only this run's servers
        print(f"run={self.run_cfg.run_id}@{self.options.run_fp}", flush=True)
        self.state.say(PeerState.STARTING, f"{self.device} of run {self.run_cfg.run_id}, as {self.peer_id}")

    async def refuse_a_live_twin(self) -> None:
        """UsageError when a live server of the run holds this server's identity (peer.host.twin):
        backs hivemind's best-effort check at start with the run's own records."""
        from peer.host.twin import live_holder, read_servers

        read = read_servers(self.dht, self.run_cfg.run_id, self.layout.num_stages)
        try:
            holder = await live_holder(read, self.peer_id, self.run_cfg.announce_period, who=self.device)
        except Exception as e:  # (the run's records unreadable: hivemind's check at start is all there is)
            logger.info("%s: could not read the run's records to check its identity: %r", self.device, e)
            return
        if holder is not None:
            raise UsageError(
                f"identity {self.options.identity_path} ({self.peer_id}) is held by a live server of run "
                f"{self.run_cfg.run_id!r} ({holder.get('device')}, announcing at {' '.join(holder.get('maddrs', []))}): "
                "stop that server first, or give this one another --identity-path"
            )

    def _remember_peers(self) -> None:
        """Keep the other servers' announced multiaddrs (KnownPeers): a restart without
        --initial-peers (the first server's own command) joins the run's DHT through them."""
        self.known.remember(m for peer, ms in self.directory.addresses.items() if peer != self.peer_id for m in ms)

    def _start_dht(self):
        """This server's DHT node: through --initial-peers, else through the run's servers it knew
        before a restart (if none of them answers, it starts alone and says so)."""
        args = self.options
        known = [] if args.initial_peers else self.known.read()
        if not known:
            return start_server_dht(args, self.run_cfg, self.device, on_wait=self.state.waiting_for_initial_peers)
        logger.warning(
            "%s: joining the run through the %d peers it knew before (%s)", self.device, len(known), self.known.path
        )
        timeout = min(args.timeout or KNOWN_PEERS_TIMEOUT, KNOWN_PEERS_TIMEOUT)
        try:
            dht = start_server_dht(args, self.run_cfg, self.device, initial_peers=known, timeout=timeout)
            self.joined_through = known
            return dht
        except NetworkError as e:
            logger.warning("%s: none of the peers it knew answered (%s); starting alone", self.device, e)
            return start_server_dht(args, self.run_cfg, self.device, initial_peers=[])

    # ---- find the run ---------------------------------------------------------------------------

    async def find_run(self) -> None:
        """Read the run's config record: UsageError when the run is published under another run key,
        with other training flags, or without this server (failed over)."""
        from core.layout import RunLayout
        from core.protocol import record_store

        t0 = time.perf_counter()
        current = await record_store.read_config_value(self.dht)
        logger.info("%s: read the run's config record in %.1f s", self.device, time.perf_counter() - t0)
        run_id, fp = self.run_cfg.run_id, self.options.run_fp
        if current is None:
            others = await record_store.other_run_keys(self.dht)
            if others:
                raise UsageError(
                    f"run {run_id!r} is published under run key {', '.join(others)}, and this server's "
                    f"--run-key {self.options.run_key} has fingerprint {fp}: give it the run's key file (or "
                    "start a new run under another --run-id)"
                )
        if isinstance(current, dict):
            differ = differing_flags(self.run_cfg.to_dict(), current)
            if differ:
                raise UsageError(
                    f"run {run_id!r} trains with other flags than this server: {'; '.join(differ)}. Every "
                    "server of a run is started with the same training flags"
                )
        if isinstance(current, dict) and isinstance(current.get("layout"), dict) and current.get("epoch", 0) > 0:
            later = RunLayout.from_dict(current["layout"], self.cfg.layers)
            if not any(self.device in s.servers for s in later.stages):
                raise UsageError(
                    f"{self.device} was failed over (the run is at layout epoch {current['epoch']} without it); "
                    "start it under a new device id as a volunteer, or start a new run"
                )
        self.current_config = current if isinstance(current, dict) else None

    # ---- build the stage server -----------------------------------------------------------------

    async def build(self) -> None:
        from core.protocol.leases import LeaseTickets
        from core.protocol.wire import MAX_MESSAGE_BYTES, bound_messages
        from parameter_server.service import StageServer
        from peer.directory import Directory, HaltNotice
        from peer.hf.init import initial_state
        from peer.server_links import LocalLink

        args, run_cfg = self.options, self.run_cfg
        t0 = time.perf_counter()
        self.links = links = link_emulator(args, self.device)
        self.slowdown = args.slowdown or links.compute_slowdown()
        self.directory = directory = Directory(self.dht, run_cfg.run_id, self.layout.num_stages)
        link_cache: dict[tuple[str, str], object] = {}

        def connector(dev: str):
            peer = directory.known.get(dev)
            if peer is None:
                return None
            if peer == self.peer_id:
                return LocalLink(self.server, self.peer_id)
            key = (dev, peer)
            if key not in link_cache:
                link_cache[key] = directory.link(self.p2p, dev, links, peer_id=peer, compress=run_cfg.compress)
            return link_cache[key]

        self.connector = connector
        st = self.layout.stages[self.stage]
        self.server = server = StageServer(
            run=run_cfg,
            layout=self.layout,
            cfg=self.cfg,
            device_id=self.device,
            peer_id=self.peer_id,
            stage_params=initial_state(self.cfg, *st.layers, run_cfg.seed, args.hf_model),
            corpus=self.corpus,
            links=links,
            task_timeout=args.task_timeout,
            client_timeout=args.client_timeout,
            connector=connector,
            requeue=not args.no_requeue,
            max_request_bytes=args.max_request_bytes,
            volunteers_allow=args.allowed,
            verify_rate=args.verify_rate,
            probation=args.probation,
            verify_device=args.device,
            task_tokens=args.task_tokens,
            client_batch_tokens=args.client_batch_tokens,
            local_first=not args.no_local_first,
            lease_tickets=LeaseTickets.of_run_key(args.run_key_obj),
        )
        logger.info("%s: its stage server built in %.1f s", self.device, time.perf_counter() - t0)
        if args.checkpoint_dir:
            await self._resume()
        server.on_step.append(server.note_step)
        if args.die_at_version is not None:
            server.on_step.append(self._die_at)
        if args.log_dir:
            from peer.host.trainlog import TrainingLog

            self.trainlog = TrainingLog(args.log_dir, server)
            server.on_step.append(self.trainlog.on_step)
            server.on_eval.append(self.trainlog.on_eval)
        # who the run's servers are, before this server answers anyone: a restarted server refused the
        # others' replicas and inputs ("not a server of this run") until its first announcement round
        try:
            server.set_directory(await directory.refresh(), directory.versions, directory.epochs)
        except Exception as e:
            logger.debug("%s: reading the run's servers before serving failed: %r", self.device, e)
        bound_messages(min(MAX_MESSAGE_BYTES, server.max_request_bytes))  # no message read past the bound
        if not args.no_compute:
            # measured before the first record: a record that said "online" with no compute while the
            # worker started made the stage look empty to a volunteer choosing one (`--stage auto`)
            from peer.volunteer.device import measured_compute

            self.compute = await asyncio.to_thread(
                measured_compute, run_cfg, self.layout, self.cfg, self.stage, args.device, self.slowdown
            )
        await server.add_p2p_handlers(self.p2p)
        self.announcer = Announcer(
            self.dht,
            server,
            directory,
            run_cfg,
            self.maddrs,
            self.peer_id,
            self.device,
            compute=lambda: self.worker.compute if self.worker is not None else self.compute,
        )
        self.halt = HaltNotice(self.device, on_change=self._halt_changed)
        self.report = RunReport(server, directory, run_cfg, self.cfg, self.device, self.peer_id)
        self.detector = FailureDetector(
            server,
            directory,
            self.device,
            run_cfg.announce_period,
            args.failover_after,
            answers=self._answers,
            halt=self.halt,
        )
        self.maintenance = Maintenance(server, self.p2p, self.device)
        # the run's last version is announced at once, not up to a period later: `peer swarm` and the
        # dashboard see the run end by it
        server.on_step.append(self._on_step)
        self.announcer.says = self.state.line
        self.announcer.on_refresh.append(self._look)
        self.announcer.on_refresh.append(self._remember_peers)

    async def _resume(self) -> None:
        from parameter_server.checkpoint import CheckpointWriter, load_checkpoint
        from parameter_server.requestlog import RequestLog
        from parameter_server.service import RETAIN
        from peer.hf.init import write_model_json

        args, server, device = self.options, self.server, self.device
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        write_model_json(args.checkpoint_dir, self.cfg, args.hf_model)  # what `peer export --checkpoint-dirs` reads
        t0 = time.perf_counter()
        resumed = load_checkpoint(server, args.checkpoint_dir)
        request_log, logged = RequestLog.resume(os.path.join(args.checkpoint_dir, f"{device}.requests.log"))
        replayed = await server.recover(logged)
        del logged
        if resumed or replayed:
            logger.warning(
                "%s resumed from %s at version %d, replayed %d logged requests in %.1f s",
                device,
                args.checkpoint_dir,
                server.version,
                replayed,
                time.perf_counter() - t0,
            )
        server.log = request_log
        self.writer = writer = CheckpointWriter(server, args.checkpoint_dir)

        def persist(version: int) -> None:  # the log forgets old batches once the checkpoint is on disk
            writer.after_step(lambda: request_log.compact(version - (RETAIN - 1)))

        server.on_step.append(persist)
        server.on_adopt.append(lambda record: writer.now())
        server.on_replica.append(writer.replica)

    async def _answers(self, d: str) -> bool:
        """Whether server `d` answers a ping within PROBE_S, dial and retries included: a host that
        froze or lost its network (its connections hang rather than close) must not hold the
        watcher for a timeout per retry."""

        link = self.directory.link(self.p2p, d, self.links, backoff=False)
        try:
            await asyncio.wait_for(link.call("ping", {}, timeout=PROBE_S), PROBE_S)
            return True
        except Exception:
            return False

    def finish(self) -> None:
        """The run is over: from now on the answers to heartbeats say so, and so does this server's
        record while it stays (--hold): a volunteer that comes later learns the end from it when the
        records of the servers that left have expired."""
        self.server.run_over = True
        if self.announcer is not None:
            self.announcer.record_state = "finished"
        self.finished.set()

    def _on_step(self, version: int):
        if version == self.run_cfg.steps and self.announcer.online.is_set():
            return self.announcer.announce_quietly("online")
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
                        server.adopt(record)
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
        current = self.current_config or {}
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
            server.set_directory(self.directory.servers)
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
            told = all(p in server.told_over for p in server.clients if not server._is_server(p))
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
            final = "finished" if self.finished.is_set() else "offline"
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
        if self.held is None and self.dht is not None:
            await close_replica(self.p2p)
            stop_dht(self.dht)

    async def run(self, stop: asyncio.Event) -> int:
        """The whole life: 0 when the run finished (or a signal stopped it). UsageError (the command's
        exit 2) when this server is not part of the run: another run key, other flags, a live server
        holding its identity, or failed over (found at the start, or while it was away)."""
        try:
            # each phase ends as soon as a signal comes, whatever it waits for
            await until_stopped(self.start(stop), stop)
            await until_stopped(self.find_run(), stop)
            self.keep_run_key()
            self.say_where()
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
