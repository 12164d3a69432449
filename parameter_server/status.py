"""What a server says about itself: `ping` (the link probe), `status` (counters for the launcher and
the dashboard, with the traffic counters), and the record it announces in the DHT. Reads the
server's state; keeps only what the announcement itself needs (step times, volunteers seen). A part
of a server, built with what it reads of it (parameter_server/parts.py)."""

from __future__ import annotations

import time
from typing import Callable

from core.protocol.fields import field as mfield
from core.protocol.records import ServerRecord
from core.protocol.traffic import CALLS, SESSION_CALLS, TRAFFIC, VALUES
from core.protocol.trust import Remembered

# volunteers a server remembers by peer id to count each once in its announcement's "clients_joined"
SEEN_VOLUNTEERS = 4096
SAYS_CHARS = 240  # the state line a record carries, cut to this length (records stay small)
# the last held-out losses a record carries (a dashboard keeps the curve from what it has seen);
# its gradient norms are the status's recent 8, as its losses
RECORD_SERIES = 8


class Status:
    """A server's ping, status and announcement, given what it reads of its server: its `place`;
    `links` (the emulated link a ping's answer is sent back over); `clients` (the registered ones);
    `shard` (its own slot's); as they are now: `stage_layers()`, `pool()`, `hosted()` and `replicas()`
    (slot -> shard), `version()`, `epoch()`, `halted()` (why the run stopped, if it did); the parts and
    counters it reports: `evaluation`, `clipping`, `deltas`, `arrivals`, `bans`, `counters`,
    `check_counts`, `tasks_by_device`. It keeps `step_times` (version -> when reached) and the
    volunteers it has seen."""

    def __init__(
        self,
        *,
        place,
        links,
        clients: dict,
        shard,
        stage_layers: Callable[[], tuple],
        pool: Callable[[], object],
        hosted: Callable[[], dict],
        replicas: Callable[[], dict],
        version: Callable[[], int],
        epoch: Callable[[], int],
        halted: Callable[[], str | None],
        evaluation,
        clipping,
        deltas,
        arrivals,
        bans,
        counters: dict,
        check_counts: dict,
        tasks_by_device: dict,
    ) -> None:
        self.place, self.links, self.clients, self.shard = place, links, clients, shard
        self.stage_layers, self.pool, self.hosted, self.replicas = stage_layers, pool, hosted, replicas
        self.version, self.epoch, self.halted = version, epoch, halted
        self.evaluation, self.clipping, self.deltas, self.arrivals, self.bans = (
            evaluation,
            clipping,
            deltas,
            arrivals,
            bans,
        )
        self.counters, self.check_counts, self.tasks_by_device = counters, check_counts, tasks_by_device
        self.step_times: dict[int, float] = {}  # version -> wall time it was reached (note_step)
        # volunteers that registered here (announcement): the count, and the last SEEN_VOLUNTEERS of
        # them to tell a new one from one seen before (one that returns after that many others counts again)
        self.volunteers_joined = 0
        self.seen_volunteers = Remembered(SEEN_VOLUNTEERS)

    async def on_ping(self, meta, tensors, sender):
        """Round-trip and throughput probe: a tiny answer, sent back over the prober's emulated link
        (a prober is not registered yet, so it names its device)."""
        device = mfield(meta, "device", str, optional=True)
        if device is not None and sender not in self.clients:
            await self.links.send(device, 64)
        return {"ok": True, "received": sum(t.numel() * t.element_size() for t in tensors), "stage": self.place.stage}

    async def on_status(self, meta, tensors, sender):
        return self.status(recent=None)

    def status(self, recent: int | None = 8) -> dict:
        """Counters for the DHT record and the launcher; `losses` maps batch -> summed token loss (the
        `recent` last batches, or all of them)."""
        pool = self.pool().stats()
        hosted, replicas = self.hosted(), self.replicas()
        losses = sorted(self.shard.losses.items())
        return {
            "device": self.place.device_id,
            "stage": self.place.stage,
            "role": self.place.role,
            "version": self.version(),
            "epoch": self.epoch(),
            "hosted": {str(k): sh.version for k, sh in hosted.items()},
            "replicas": {str(k): sh.version for k, sh in replicas.items()},
            # the oldest version each hosted slot still keeps in memory: where a failover's re-run can start
            # (one kept on disk for bans is not served: old_versions.py)
            "kept_from": {str(k): sh.memory_from() for k, sh in hosted.items()},
            "losses": {str(k): v for k, v in (losses if recent is None else losses[-recent:])},
            # version -> its held-out loss (--eval-every; the last stage's first frontal server)
            "eval_losses": {str(k): v for k, v in sorted(self.evaluation.eval_losses.items())},
            # batch -> its gradient's global L2 norm before clipping (--clip-grad-norm runs only)
            "grad_norms": {
                str(k): v
                for k, v in sorted(self.clipping.grad_norms.items())[-(recent or len(self.clipping.grad_norms)) :]
            },
            "microbatches_applied": min(sh.microbatches_applied for sh in hosted.values()),
            "duplicates": self.shard.duplicates
            + pool.get("duplicates", 0)
            + self.counters["relay_duplicates"]
            + self.counters["output_duplicates"],
            "requeued": pool.get("requeued", 0),
            "pool": pool,
            "counters": dict(self.counters),
            # get_params answered as a difference from the asker's version, or asked so and sent whole
            "param_deltas": {"sent": self.deltas.sent, "declined": self.deltas.declined},
            "clients": {
                p: {"device": c.device, "compute": c.compute, "tasks_done": c.tasks_done}
                for p, c in self.clients.items()
            },
            "tasks_by_device": dict(self.tasks_by_device),
            "traffic": dict(TRAFFIC),
            "traffic_values": dict(VALUES),
            "calls": dict(CALLS),
            "session_calls": dict(SESSION_CALLS),
            "checks": dict(self.check_counts, max_honest_distance=self.arrivals.honest_distance()),
            "banned": dict(self.bans.banned),
        }

    def note_step(self, version: int) -> None:
        """When each of the last 16 versions was reached (the dashboard's seconds per step)."""
        self.step_times[version] = time.time()
        for v in [v for v in self.step_times if v <= version - 16]:
            del self.step_times[v]

    def announcement(
        self, state: str, maddrs: list[str], compute: float, servers: set[str], says: str | None = None
    ) -> ServerRecord:
        """The record this server announces under its stage key: its place, addresses, version and
        pools, its own worker's compute, the wall time of its last versions, and how many volunteers
        (peers that are not `servers`) ever registered here and left."""
        s = self.status()
        volunteers = set(self.clients) - servers
        for peer in volunteers:
            if self.seen_volunteers.get(peer) is None:
                self.volunteers_joined += 1
                self.seen_volunteers.put(peer, True)
        for peer in servers:  # registered before it was known as a server
            if self.seen_volunteers.pop(peer) is not None:
                self.volunteers_joined -= 1
        stats = {k: s[k] for k in ("microbatches_applied", "duplicates", "requeued")} | {
            "clients": len(self.clients),
            "payload_errors": s["counters"]["payload_errors"],
            "clients_joined": self.volunteers_joined,
            "clients_left": self.volunteers_joined - len(volunteers),
            # the stage's volunteers as this server sees them (registered here), and their compute in
            # rows/s of the stage's slice: what a volunteer choosing its stage reads (stage_choice.py),
            # in place of every volunteer's own record
            "volunteers": len(volunteers),
            "volunteer_compute": float(sum(self.clients[p].compute for p in volunteers)),
            "checked": self.check_counts["checked"],
            "banned": len(self.bans.banned),
            # how many versions back a ban can undo here now (memory's and those on disk: old_versions.py)
            "ban_reach": self.version() - max(sh.kept_from() for sh in self.hosted().values()),
        }
        return ServerRecord(
            device=self.place.device_id,
            role=self.place.role,
            stage=self.place.stage,
            state=state,
            version=self.version(),
            epoch=self.epoch(),
            maddrs=list(maddrs),
            pool=s["pool"],
            layers=list(self.stage_layers()),
            losses=s["losses"],
            # (None when empty: only the evaluating server and clipped runs carry them)
            eval_losses=dict(list(s["eval_losses"].items())[-RECORD_SERIES:]) or None,
            grad_norms=s["grad_norms"] or None,
            stats=stats,
            compute=compute,
            step_times={str(v): t for v, t in sorted(self.step_times.items())},
            time=time.time(),
            halted=self.halted(),
            says=says[:SAYS_CHARS] if says else None,
        )
