"""Who computes for this server: the registry of clients (volunteers, and the servers' own
workers), their registration and heartbeats, and dropping the silent ones, whose leases go back to
the pool at once. Owns ClientInfo; must not touch rows, tasks' contents or parameters. A part of a
server, built with what it reads of it (parameter_server/parts.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from core.protocol.fields import field as mfield
from core.protocol.leases import MAX_TICKET
from core.protocol.refusals import Refusal
from core.protocol.trust import Remembered
from core.protocol.wire import PayloadError
from parameter_server.leases import carried_completes

logger = logging.getLogger("hivepipe.server")
# a lease younger than this may still be on its way to its client (in the answer to its `take`)
LEASE_IN_FLIGHT = 5.0
# a client that this server's node has had no connection to for this long (in three reads of the
# connections, peer.host.maintenance.CONNECTION_READ_PERIOD apart) and that has not called meanwhile has left:
# a SIGKILLed volunteer's connection closes at once, so its leases go back without waiting out
# --client-timeout of silence. Twice this grace (1.0 s) dropped a killed holder only 2.1-2.4 s after
# the kill, long enough to be a soak's longest stall; at this one, no live client was dropped for a
# closed connection over a soak's 1,244 departures
DISCONNECT_GRACE = 0.5
# a gap this long between two of this server's silence checks (every 0.2 s) is the server's own
# stall (its event loop busy, its process starved of CPU), not its clients' silence: their
# heartbeats meanwhile wait unread, so the gap does not count against them (else a server whose loop
# stalls for 3 s drops every client it has as "silent" at once)
OWN_STALL = 1.0
# the words of the refusal of a call from a client this server does not know (never registered,
# dropped, or registered before this server restarted; code Refusal.NOT_REGISTERED: the client
# registers and tries again), and of one not on the allow list (Refusal.NOT_ALLOWED: final)
NOT_REGISTERED = "is not registered for stage"
NOT_ALLOWED = "is not on this run's --volunteers-allow list"
# a client whose leases run out unanswered this many times in a row is dropped (its leases go back)
# and may register again only after STRUCK_OUT_S, doubled at each further drop (a hoarder's cost)
STRIKES_TO_DROP = 3
STRUCK_OUT_S = 10.0
# ... and, while its leases are cut short (probation), not before the cut has doubled up to this:
# at 0.25, 0.5 and 1 s an honest newcomer slowed by a loaded machine was dropped before its first
# task was done (a dashboard test's volunteer, within 2 s of joining); a hoarder now holds its short
# leases for about 8 s in all (0.25 + 0.5 + 1 + 2 + 4) before it goes, its tasks going to others
# first each time one runs out
DROP_CAP_S = 8.0
# new clients a server admits: REGISTER_RATE a second, in bursts of REGISTER_BURST (heartbeats of
# known clients are not counted): identities are free to make, a server's pools and checks are not
REGISTER_RATE, REGISTER_BURST = 5.0, 20
TOO_MANY_NEW = "too many new clients at once"


class TokenBucket:
    """At most `rate` events a second on average, `burst` at once (times from the caller's clock)."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), None

    def take(self, now: float) -> bool:
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass
class ClientInfo:
    device: str
    compute: float
    last_seen: float
    tasks_done: int = 0
    unconnected_since: float | None = None  # first read of the node's connections that lacked it
    takes_lost: int = 0  # registrations that said a take's answer was lost (a take still waiting is dropped)


class Clients:
    """A server's registry of its clients, given what it reads of its server: `device_id`, `peer_id`
    and `stage` (its own), `rows` a micro-batch and `micro_batches` a batch, its `clock`,
    `client_timeout` (silence that drops a client), `volunteers_allow` (None: open), `requeue` (a
    departed client's leases go back at once), the run's `lease_tickets`, its `directory`, `counters`;
    as they are now: `pool()`, `version()`, `epoch()`, `replaying()` and `run_over()`; and
    `complete_carried(ids, sender)` (the leases part: what a call says it finished). It keeps the
    `clients` given (peer id -> ClientInfo) and `told_over` (peers told the run is over); `seen` bounds
    the peers it remembers as dropped."""

    def __init__(
        self,
        *,
        device_id: str,
        peer_id: str,
        stage: int,
        rows: int,
        micro_batches: int,
        clock: Callable[[], float],
        client_timeout: float,
        volunteers_allow: frozenset[str] | None,
        requeue: bool,
        lease_tickets,
        directory,
        counters: dict,
        pool: Callable[[], object],
        version: Callable[[], int],
        epoch: Callable[[], int],
        replaying: Callable[[], bool],
        run_over: Callable[[], bool],
        complete_carried: Callable[[list, str], None],
        seen: int,
        clients: dict,
    ) -> None:
        self.device_id, self.peer_id, self.stage, self.rows, self.micro_batches = (
            device_id,
            peer_id,
            stage,
            rows,
            micro_batches,
        )
        self.clock, self.client_timeout, self.volunteers_allow, self.requeue = (
            clock,
            client_timeout,
            volunteers_allow,
            requeue,
        )
        self.lease_tickets, self.directory, self.counters, self.pool = lease_tickets, directory, counters, pool
        self.version, self.epoch, self.replaying, self.run_over = version, epoch, replaying, run_over
        self.complete_carried = complete_carried
        self.clients = clients  # peer id -> ClientInfo (written here; the server's other parts read it)
        self.told_over: set[str] = set()  # peer ids a heartbeat's answer told that the run is over
        self.admissions = TokenBucket(REGISTER_RATE, REGISTER_BURST)  # new clients (_admit)
        self.struck_out = Remembered(seen)  # peer -> (drops, may register again at)
        self.last_silence_check: float | None = None  # (drop_stale_clients)

    async def on_register(self, meta, tensors, sender):
        device = mfield(meta, "device", str)
        compute = mfield(meta, "compute", float)
        if compute <= 0:
            raise PayloadError("field 'compute' must be positive")
        stage = mfield(meta, "stage", int)
        if stage != self.stage:
            raise PayloadError(f"this server serves stage {self.stage}, not {stage}")
        if (
            self.volunteers_allow is not None
            and sender not in self.volunteers_allow
            and not self.directory.is_server(sender)
        ):
            raise PayloadError(f"peer {sender} {NOT_ALLOWED}", Refusal.NOT_ALLOWED)
        holding = mfield(meta, "holding", list, optional=True)
        if holding is not None and (
            len(holding) > 4 * self.micro_batches * self.rows + 8
            or not all(isinstance(t, str) and len(t) <= 64 for t in holding)
        ):
            raise PayloadError("field 'holding' must list the task ids the client holds")
        # each held task's lease ticket (None where the client has none): what proves a lease to adopt
        tickets = mfield(meta, "leases", list, optional=True)
        if tickets is not None and (
            holding is None
            or len(tickets) != len(holding)
            or not all(t is None or (isinstance(t, str) and len(t) <= MAX_TICKET) for t in tickets)
        ):
            raise PayloadError("field 'leases' must give one lease ticket (or null) per task in 'holding'")
        # the client's last take here failed without an answer (it has one take in flight per server
        # at most): no lease of it here is on its way, so those it does not hold are lost now
        take_lost = mfield(meta, "take_lost", bool, optional=True)
        # the client's process just started (a supervised server's worker forked again keeps its
        # peer id, and its node keeps the connection open): what it held here was its predecessor's
        first = mfield(meta, "first", bool, optional=True)
        # what the client finished here since its last call, in its layout epoch 'epoch' (a task id
        # names the same rows in every epoch: one finished in an older epoch is not this one's)
        carried = carried_completes(meta)
        carried_epoch = mfield(meta, "epoch", int, optional=True) or 0
        new = sender not in self.clients
        if new and not self.directory.is_server(sender):
            self._admit(sender)
        info = self.clients.setdefault(sender, ClientInfo(device, compute, self.clock()))
        info.compute, info.device, info.last_seen = compute, device, self.clock()
        if take_lost:
            info.takes_lost += 1
        if new:
            logger.info("%s: client %s (%s) registered, compute %.3g", self.device_id, sender[-8:], device, compute)
            self.pool().set_client_speed(sender, compute)
            if self.directory.is_server(sender):  # a worker of the run's servers: trusted, it need not earn its leases
                self.pool().standing.trust(sender)
            if holding and self.requeue:
                # a client new here that holds tasks of ours: this server restarted (its leases are
                # not in its log, so their tasks were queued again) or dropped it as silent. It goes
                # on with them; leased back to it, nobody else does them a second time (after a 1 s
                # restart, a worker would otherwise take such tasks again and sum them twice);
                # before its carried completions, which this server takes only from a task's holder
                proven = self._proven_leases(sender, holding, tickets or [None] * len(holding))
                adopted = [t for t in proven if self.pool().adopt(sender, t) is not None]
                if adopted:
                    self.counters["leases_adopted"] = self.counters.get("leases_adopted", 0) + len(adopted)
                    logger.info("%s: %s holds %s: leased to it again", self.device_id, sender[-8:], ", ".join(adopted))
        if carried_epoch == self.epoch():  # (closed before the reclaim below looks at its leases)
            self.complete_carried(carried, sender)
        if holding is not None and self.requeue:  # (--no-requeue, the SWARM-like baseline, waits them out)
            # leases the client does not know it holds (a lost `take` answer, a lost hand-back) go
            # back to the pool now, not after --task-timeout; young ones may still be in flight
            lost = self.pool().reclaim(sender, holding, min_age=0.0 if take_lost or first else LEASE_IN_FLIGHT)
            if lost:
                self.counters["leases_reclaimed"] = self.counters.get("leases_reclaimed", 0) + len(lost)
                logger.info(
                    "%s: %s does not hold %s: re-queued",
                    self.device_id,
                    sender[-8:],
                    ", ".join(t.task_id for t in lost),
                )
        answer = {"ok": True, "version": self.version(), "epoch": self.epoch()}
        if not self.run_over():
            return answer
        self.told_over.add(sender)  # (only this answer says so: a finished server waits for it, farewell)
        return answer | {"over": True}

    def _proven_leases(self, sender: str, holding: list[str], tickets: list) -> list[str]:
        """Of the tasks a client new here says it holds, those whose lease it proves with its ticket
        (issued to it, in this layout epoch, by a server of the run): a client's word alone would let it
        take queued tasks by naming them, and then complete them without computing anything."""
        proven = []
        for task_id, ticket in zip(holding, tickets):
            try:
                self.lease_tickets.check(ticket, task_id, sender, self.epoch())
            except PayloadError:
                continue
            proven.append(task_id)
        if len(proven) < len(holding):
            self.counters["holding_unproven"] = self.counters.get("holding_unproven", 0) + len(holding) - len(proven)
            logger.info(
                "%s: %s says it holds %d task(s) it proves no lease of: not leased to it",
                self.device_id,
                sender[-8:],
                len(holding) - len(proven),
            )
        return proven

    def _admit(self, sender: str) -> None:
        """A new client's registration, within the limits: a peer dropped for leases it let run out
        waits out its time, and new clients come at most REGISTER_RATE a second overall."""
        now = self.clock()
        drops, until = self.struck_out.get(sender, (0, 0.0))
        if now < until:
            raise PayloadError(
                f"peer {sender[-8:]} was dropped after {STRIKES_TO_DROP} leases in a row ran out "
                f"unanswered ({drops} time(s)): it may register again in {until - now:.0f} s"
            )
        if not self.admissions.take(now):
            self.counters["registrations_limited"] = self.counters.get("registrations_limited", 0) + 1
            raise PayloadError(f"{TOO_MANY_NEW}: register again in a second")

    def drop_struck_clients(self) -> list[str]:
        """Drop the clients (not servers' workers) whose last STRIKES_TO_DROP rounds of leases here ran
        out unanswered, once their probation cut (if any) has doubled up to DROP_CAP_S: their leases go
        back, and they may register again after a while."""
        struck = [
            p
            for p in self.clients
            if self.pool().standing.strikes(p) >= STRIKES_TO_DROP
            and (self.pool().standing.probation_cap(p) or DROP_CAP_S) >= DROP_CAP_S
            and not self.directory.is_server(p)
        ]
        for p in struck:
            drops = self.struck_out.get(p, (0, 0.0))[0] + 1
            self.struck_out.put(p, (drops, self.clock() + STRUCK_OUT_S * 2 ** (drops - 1)))
            self.counters["clients_struck_out"] = self.counters.get("clients_struck_out", 0) + 1
            self.left(p, f"{STRIKES_TO_DROP} leases in a row ran out unanswered")
        return struck

    def drop_stale_clients(self) -> list[str]:
        now = self.clock()
        last, self.last_silence_check = self.last_silence_check, now
        if last is not None and now - last > OWN_STALL:
            for c in self.clients.values():
                c.last_seen = min(c.last_seen + (now - last), now)
        gone = [p for p, c in self.clients.items() if now - c.last_seen > self.client_timeout and p != self.peer_id]
        for p in gone:
            self.left(p, "silent")
        return gone

    def drop_disconnected_clients(self, connected: set[str]) -> list[str]:
        """Drop the clients that `connected` (the peers this server's node has a connection to now)
        lacked for DISCONNECT_GRACE seconds, in two reads at least, without a call meanwhile."""
        now = self.clock()
        gone = []
        for p, c in self.clients.items():
            if p == self.peer_id or p in connected:
                c.unconnected_since = None
            elif c.unconnected_since is None:
                c.unconnected_since = now
            elif now - c.unconnected_since >= DISCONNECT_GRACE and now - c.last_seen >= DISCONNECT_GRACE:
                gone.append(p)
        for p in gone:
            self.left(p, "its connection closed")
        return gone

    def left(self, peer: str, why: str) -> None:
        """`peer` left (or was dropped): its leases go back (kept to run out with --no-requeue)."""
        del self.clients[peer]
        if why in ("its connection closed", "silent"):
            key = "clients_disconnected" if why == "its connection closed" else "clients_timed_out"
            self.counters[key] = self.counters.get(key, 0) + 1
        # with --no-requeue the departed client's leases are left to run out their full timeout
        # (as a SWARM trainer waits out a request to a dead peer); the work is then done again
        n = len(self.pool().client_left(peer)) if self.requeue else len(self.pool().leases_of(peer))
        logger.info(
            "%s: client %s left (%s); %d tasks %s",
            self.device_id,
            peer[-8:],
            why,
            n,
            "re-queued" if self.requeue else "left to time out",
        )

    def caller(self, sender: str) -> ClientInfo:
        """The registered client calling (refused as not registered otherwise), seen now."""
        if self.replaying():  # the request was checked when it first arrived
            return ClientInfo("replay", 1.0, self.clock())
        c = self.clients.get(sender)
        if c is None:
            raise PayloadError(f"sender {sender[-8:]} {NOT_REGISTERED} {self.stage}", Refusal.NOT_REGISTERED)
        c.last_seen = self.clock()
        return c
