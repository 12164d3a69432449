"""The launcher's view of a run: the servers' DHT records for progress and the layout epoch, and
P2P calls (at the addresses the records announce) for the final statuses and the assembled model.
Must not start or stop processes (processes.py does)."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time

from core.protocol.records import RecordState
from core.protocol.wire import wait_to_redial

logger = logging.getLogger("hivepipe.swarm")


class Monitor:
    """The launcher's view of the run: DHT records for progress, P2P calls for the final state."""

    def __init__(self, dht, p2p, run_id: str, layout, tokens_per_batch: int, eval_every: int = 0):
        self.dht, self.p2p, self.run_id, self.layout = dht, p2p, run_id, layout
        self.eval_every = eval_every
        self.num_layers = layout.stages[-1].layers[1]
        self.epoch = 0
        self.tokens_per_batch = tokens_per_batch
        self.servers: dict[str, tuple[str, dict]] = {}  # device -> (peer id, record)
        self.server_ids = set(self.all_devices())  # of every epoch (a failover only removes servers)
        self.reached = StepTimes()
        self.online_since: dict[str, float] = {}  # device -> `time` of its first "online" record seen

    async def refresh(self) -> None:
        from core.layout import RunLayout
        from core.protocol import record_store

        try:  # after a failover the servers announce the layout of the new epoch
            config = await record_store.read_config_value(self.dht)
            if isinstance(config, dict) and config.get("epoch", 0) > self.epoch:
                self.layout = RunLayout.from_dict(config["layout"], self.num_layers)
                self.epoch = config["epoch"]
        except Exception as e:
            logger.debug("read config failed: %r", e)
        try:
            per_stage = await record_store.read_stages(self.dht, self.run_id, self.layout.num_stages)
        except Exception as e:
            logger.debug("reading the stage records failed: %r", e)
            per_stage = []
        for found in per_stage:
            for peer, rec, _ in found:
                if rec is not None and rec["kind"] == "server":
                    self.servers[rec["device"]] = (peer, rec)
                    self.reached.note(rec["device"], rec.get("step_times"))
                    if rec["state"] == RecordState.ONLINE:
                        self.online_since.setdefault(rec["device"], float(rec["time"]))

    def halted(self) -> str | None:
        """Why the run is stopped, as a live server of it announces (None while it runs)."""
        from core.protocol import records

        return records.halted_reason(rec for _, rec in self.servers.values())

    def all_devices(self) -> list[str]:
        return [d for st in self.layout.stages for d in st.servers]

    def all_online(self) -> bool:
        """Every server of the layout announced itself online (or finished, which a holding server
        says once the run is over: a reader that first looks after a short run's end sees that)."""
        return all(
            d in self.servers and self.servers[d][1]["state"] in (RecordState.ONLINE, RecordState.FINISHED)
            for d in self.all_devices()
        )

    def online_at(self) -> float:
        """When the last server of the layout went online, by its own clock (its first "online"
        record: servers announce every JOINING_PERIOD until then, so one is rarely missed), not when
        this reader saw it; now at the latest, and no later than the first version the servers reached
        (a reader that missed the first records of a run of a few short steps saw them "online" only
        after its last step: a test's 3-step run then measured -0.0 s)."""
        reached = self.reached.completed()
        return min(
            time.time(),
            min(reached.values(), default=time.time()),
            max((self.online_since.get(d, time.time()) for d in self.all_devices()), default=time.time()),
        )

    def min_version(self) -> int:
        if not all(d in self.servers for d in self.all_devices()):
            return 0
        return min(self.servers[d][1]["version"] for d in self.all_devices())

    def loss(self, t: int) -> float | None:
        last = self.layout.stages[-1]
        for d in last.servers:
            rec = self.servers.get(d, (None, {}))[1]
            if str(t) in rec.get("losses", {}):
                return rec["losses"][str(t)] / self.tokens_per_batch
        return None

    def eval_loss(self) -> tuple[int, float] | None:
        """The last held-out loss (--eval-every) any server's record carries: (version, loss)."""
        seen = {}
        for _, rec in self.servers.values():
            for v, loss in (rec.get("eval_losses") or {}).items():
                seen[int(v)] = loss
        return max(seen.items(), default=None)

    def _link(self, device: str):
        from peer.server_links import P2PLink

        peer, rec = self.servers[device]
        return P2PLink(self.p2p, peer, device, addresses=lambda: rec.get("maddrs", []))

    async def _call(
        self, device: str, method: str, meta: dict, timeout: float = 30.0, patience: float = 60.0
    ) -> tuple[dict, list]:
        """One request to a server, asked again while it cannot be reached for up to `patience`
        seconds: a server just brought back can still be in this process's dial backoff (its own and
        libp2p's, which the launcher's DHT node ran into while it was away) for some seconds."""
        deadline = time.monotonic() + patience
        while True:
            link = self._link(device)
            try:
                return await link.call(method, meta, timeout=timeout)
            except ConnectionError:
                logger.debug("%s.%s: not reachable yet, asking again in %.1f s", device, method, link.retry_in())
                if not await wait_to_redial(link, deadline):
                    raise

    async def statuses(self, patience: float = 60.0) -> dict[str, dict]:
        out = {}
        for d in self.all_devices():
            meta, _ = await self._call(d, "status", {}, patience=patience)
            out[d] = meta
        return out

    async def assemble(self, version: int, patience: float = 120.0, poll: float = 0.25) -> dict:
        """The full model at `version`, from every shard slot's host. A host whose slot is not there
        yet answers `retry` (a slot adopted at a failover can trail its host's own shard by a step or
        two): asked again until `patience` runs out, then NotReady naming it."""
        from core.protocol.params import fetch_slot

        state = {}
        for st in self.layout.stages:
            for slot, d in enumerate(st.hosts):
                meta, tensors = await fetch_slot(
                    functools.partial(self._call, d, timeout=120), d, slot, version, patience, poll
                )
                state.update(zip(meta["names"], tensors))
        return state

    async def final(self, version: int) -> tuple[dict[str, dict], dict]:
        """The servers' statuses and the full model at `version`, the model first: once every slot's
        host holds the slot at `version`, every slot's counters are final. A slot adopted at a
        failover can trail its host's own shard by a step or two, and statuses read before it caught
        up counted its last batch as not applied (in CI: 52 of 56 micro-batches)."""
        state = await self.assemble(version)
        await self.wait_for_eval(version)
        return await self.statuses(), state

    async def wait_for_eval(self, version: int, patience: float = 120.0, poll: float = 0.25) -> None:
        """With --eval-every, the held-out loss of the last version: computed once every stage made it
        (parameter_server/evaluate.py), so asked for until it is there (or `patience` runs out, said)."""
        if not self.eval_every:
            return
        device = self.layout.stages[-1].frontal[0]
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            meta, _ = await self._call(device, "status", {})
            if str(version) in meta.get("eval_losses", {}):
                return
            await asyncio.sleep(poll)
        logger.warning("the held-out loss of version %d did not come within %.0f s", version, patience)

    def summary(self, args, cfg, statuses: dict, killed: int, wall: float) -> dict:
        last = self.layout.stages[-1]
        loss_sums = statuses[last.servers[0]]["losses"]
        losses = {int(k): v / self.tokens_per_batch for k, v in loss_sums.items()}
        applied = sum(statuses[st.servers[0]]["microbatches_applied"] for st in self.layout.stages)
        return {
            "steps": args.steps,
            "first_loss": losses[min(losses)],
            "last_loss": losses[max(losses)],
            # version -> held-out loss (--eval-every), from the server that computes it
            "eval_losses": statuses.get(last.frontal[0], {}).get("eval_losses", {}),
            "microbatches_expected": args.steps * args.micro_batches * self.layout.num_stages,
            "microbatches_applied": applied,
            "duplicates_dropped": sum(s["duplicates"] for s in statuses.values()),
            "requeued": sum(s["requeued"] for s in statuses.values()),
            "volunteers_killed": killed,
            "layout_epoch": self.epoch,
            "layout": self.layout.to_dict(),
            "servers": sorted(self.server_ids),  # (of every epoch: a name not here is a volunteer's)
            # the volunteers (not servers) that registered with, or completed tasks at, each stage's
            # servers (a volunteer leaves once the run is over: it may be gone from the clients by now)
            "volunteers_by_stage": {
                str(st.index): sorted(
                    (
                        {c["device"] for d in st.servers for c in statuses[d].get("clients", {}).values()}
                        | {w for d in st.servers for w in statuses[d].get("tasks_by_device", {})}
                    )
                    - self.server_ids
                )
                for st in self.layout.stages
            },
            # checked work (parameter_server/verify.py): re-runs of volunteers' work and the bans they caused
            "checks": {
                k: sum(s.get("checks", {}).get(k, 0) for s in statuses.values())
                for k in ("checked", "passed", "caught", "skipped", "tasks_rerun")
            },
            # every task completed once at the server that leased it (re-runs of lost work included)
            "tasks_completed": sum(s.get("pool", {}).get("done", 0) for s in statuses.values()),
            # of them, by each worker (a server's own worker under its server's name), also those that
            # left (a volunteer leaves once the run is over): who computed the run (a batch goes first
            # to a free server's worker)
            "tasks_by_worker": dict(
                sorted(
                    sum(
                        (collections.Counter(s.get("tasks_by_device", {})) for s in statuses.values()),
                        collections.Counter(),
                    ).items()
                )
            ),
            # takes over the network that leased nothing: answered at once, or after waiting their time out
            "takes_empty": {
                k: sum(s.get("counters", {}).get(k, 0) for s in statuses.values())
                for k in ("takes_found_nothing", "takes_waited_out")
            },
            "max_honest_distance": max(
                (s.get("checks", {}).get("max_honest_distance", 0.0) for s in statuses.values()), default=0.0
            ),
            "banned": sorted({p for s in statuses.values() for p in s.get("banned", {})}),
            "wall_seconds": round(wall, 3),
            "tokens_per_second": round(args.steps * args.batch_size * cfg.seq_len / max(wall, 1e-9), 1),
            "bytes_on_wire": sum(sum(s.get("traffic", {}).values()) for s in statuses.values()),
            # parameter versions answered as differences from the asker's, and asked so but sent whole
            "param_deltas": {
                k: sum(s.get("param_deltas", {}).get(k, 0) for s in statuses.values()) for k in ("sent", "declined")
            },
            "traffic": dict(
                sum((collections.Counter(s.get("traffic", {})) for s in statuses.values()), collections.Counter())
            ),
            # tensor elements the requests of each method carried (bytes / values: the wire's bytes per value)
            "traffic_values": dict(
                sum(
                    (collections.Counter(s.get("traffic_values", {})) for s in statuses.values()), collections.Counter()
                )
            ),
            # calls that reached a server over the network, per method (a server's own worker calls its
            # own server in-process: no RPC)
            "rpc_calls": dict(
                sum((collections.Counter(s.get("calls", {})) for s in statuses.values()), collections.Counter())
            ),
            # of them, those that came over a session (core/protocol/session.py)
            "rpc_session_calls": dict(
                sum((collections.Counter(s.get("session_calls", {})) for s in statuses.values()), collections.Counter())
            ),
        }


class StepTimes:
    """When the run reached each version, from the servers' own clocks: a server's record carries
    the wall time of its last 16 versions (`step_times`), so a reader that misses records for a
    while (a DHT read under load can miss some for seconds) still learns every version's time,
    where polling `min_version` would see a pause and then a jump. A version is reached when its
    last server reached it; a server that applied a version again (replaying its log after a
    restart) keeps the first time seen."""

    def __init__(self):
        self.by_server: dict[str, dict[int, float]] = {}

    def note(self, device: str, step_times) -> None:
        if not isinstance(step_times, dict):
            return
        seen = self.by_server.setdefault(device, {})
        for v, t in step_times.items():
            try:
                v, t = int(v), float(t)
            except (TypeError, ValueError):
                continue
            if v not in seen or t < seen[v]:
                seen[v] = t

    def completed(self) -> dict[int, float]:
        """version -> wall time its last server reached it (versions some server was seen at)."""
        out: dict[int, float] = {}
        for seen in self.by_server.values():
            for v, t in seen.items():
                out[v] = max(out.get(v, t), t)
        return dict(sorted(out.items()))
