"""How a reliable server enters its run (a part of peer/host/server.py's ServerHost): its DHT node and
p2p daemon (or its supervisor's), through --initial-peers or the run's servers it knew before a
restart; the check that no live server of the run holds its identity and that others can dial it
back; the run's config record (the same run key, the same training flags, this server still in the
layout), or a one-line error naming both sides; then the run key kept and the two lines another host
needs (initial_peers=, run=)."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from peer.errors import NetworkError, UsageError
from peer.host.known_peers import KnownPeers
from peer.host.network import check_own_reachability, start_server_dht
from peer.host.options import ServerOptions
from peer.host.run_config import differing_flags
from peer.host.state import PeerState, StateLine
from peer.runtime import interruptible

logger = logging.getLogger("hivepipe.serve")

KNOWN_PEERS_TIMEOUT = 15.0  # seconds a restart waits for the peers it knew before it starts alone


class RunEntry:
    """Server `device` of `layout` entering run `run_cfg`: `held` is a peer.node.HeldNode (the DHT node
    of a supervisor, which outlives this process), else it starts its own; `known` the run's servers'
    multiaddrs kept for a restart; `state` its state line. Once started: `dht`, `p2p`, `maddrs`,
    `peer_id`, `joined_through` (the peers its DHT node joined through); once the run is found:
    `current_config` (the run's config record, None when there is none yet)."""

    def __init__(
        self, options: ServerOptions, cfg, layout, device: str, run_cfg, held, known: KnownPeers, state: StateLine
    ):
        self.options, self.cfg, self.layout, self.device, self.run_cfg = options, cfg, layout, device, run_cfg
        self.held, self.known, self.state = held, known, state
        self.dht = self.p2p = None
        self.maddrs: list[str] = []
        self.joined_through: list[str] = list(options.initial_peers)
        self.peer_id = ""
        self.current_config: dict | None = None

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
