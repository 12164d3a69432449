"""What a ban may still need, kept: a step waits while a ban's rollback epoch is awaited or while it
would put work still being checked beyond a rollback's reach, and every server pins the oldest batch
of work not yet past its checks, so that every server of the run keeps the versions a ban of it would
roll back to. A part of a server, built with what it reads of it (parameter_server/parts.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from core.model.update_rule import version_for_batch
from core.protocol.fields import field as mfield
from core.protocol.wire import PayloadError, RemoteError
from parameter_server.updates import RETAIN

logger = logging.getLogger("hivepipe.server")

HOLD_SECONDS = 60.0  # the longest a server holds its steps between a ban and the rollback's epoch
# The longest a step waits for a check of work it would put beyond a rollback's reach (a check runs
# about as long as the task it re-runs; this bounds a check stuck on a lost server's answers).
CHECK_HOLD_SECONDS = 120.0
PIN_REFRESH, PIN_EXPIRY = 5.0, 15.0  # a server's pin is said again this often, and forgotten unsaid this long


class Pins:
    """A server's holds and pins, given what it reads of its server: `device_id` and `peer_id`; its
    `clock`; `layout()` and `shards()` (every shard kept here, hosted and replicas) as they are now;
    `checks_pending()` (batch -> checks of its work still running); `unsettled()` (the oldest batch of
    work not yet past its checks: Arrivals.unsettled_first); `counts` (the server's check counters);
    `call` (device, method, meta) -> (answer, tensors) to another server; `outbox`."""

    def __init__(
        self,
        *,
        device_id: str,
        peer_id: str,
        clock: Callable[[], float],
        layout: Callable[[], object],
        shards: Callable[[], list],
        checks_pending: Callable[[], dict],
        unsettled: Callable[[], int | None],
        counts: dict,
        call: Callable[[str, str, dict], Awaitable[tuple[dict, list]]],
        outbox,
        steps: int,
    ) -> None:
        self.steps = steps  # the run's last version: made only once every check here has been judged
        self.device_id, self.peer_id, self.clock, self.layout, self.shards = device_id, peer_id, clock, layout, shards
        self.checks_pending, self.unsettled, self.counts, self.call, self.outbox = (
            checks_pending,
            unsettled,
            counts,
            call,
            outbox,
        )
        self.hold_steps_until: float | None = None  # set by a ban (hold_for_ban), cleared by the next layout epoch
        # asked: the oldest batch each server of the run (by peer id, this one's included) asks every
        # server to keep within a rollback's reach (its pin); of each other server, its last pin's seq and when
        # it came (pins_heard: a pin not said again for PIN_EXPIRY is forgotten)
        self.asked: dict[str, int] = {}
        self.pins_heard: dict[str, tuple[int, float]] = {}
        self.pin_sent: tuple[int | None, float] = (None, float("-inf"))  # (none said yet: nothing to clear)
        self.pin_seq = 0  # the last pin sent from here
        self.check_hold_since: float | None = None  # when a step began to wait for a check (checks_hold)

    def hold_for_ban(self) -> None:
        """No step until the ban's rollback epoch comes (`release`), at most HOLD_SECONDS: a step now
        would apply the liar's work and could push the version to roll back to out of the kept window."""
        self.hold_steps_until = self.clock() + HOLD_SECONDS

    def release(self) -> None:
        """The layout epoch a ban waited for has come."""
        self.hold_steps_until = None

    @property
    def held_or_waiting(self) -> bool:
        """A hold that ran out, or a step waiting for a check: the server looks at its steps again."""
        return (self.hold_steps_until is not None and not self.steps_held()) or self.check_hold_since is not None

    def steps_held(self) -> bool:
        """True while a ban's rollback epoch is awaited (Updates.maybe_step does not step)."""
        if self.hold_steps_until is None:
            return False
        if self.clock() < self.hold_steps_until:
            return True
        logger.warning("%s: no layout epoch came within %.0f s of a ban: stepping again", self.device_id, HOLD_SECONDS)
        self.hold_steps_until = None
        return False

    def checks_hold(self, version: int) -> bool:
        """True while making version `version + 1` here would put work still being checked beyond a
        rollback's reach. A ban rolls back to the liar's first batch t, re-run on version_for_batch(t),
        which every server of the run must still keep; once this one has made `version + 1`, the others
        (at most two versions ahead of it per stage boundary, which is what snapshots_kept allows for)
        keep every version from `version + 2 - RETAIN` on. So a check of work of such a batch is waited
        for: a lying volunteer's work cannot outrun its checks, however far behind they fall (on a loaded
        machine they lagged a dozen tasks behind, and a liar's first batches then stayed applied). Bounded
        by CHECK_HOLD_SECONDS, should a check hang on a lost server. The run's last version waits for
        every check: the run's end is a ban's last chance (a lie in the last batches, checked for its
        outsized norm, ended applied when the last step came before its check)."""
        reach = version + 2 - RETAIN
        last = version + 1 >= self.steps
        late = [t for t in self.checks_pending() if last or version_for_batch(t) < reach]
        if not late:
            self.check_hold_since = None
            return False
        now = self.clock()
        if self.check_hold_since is None:
            self.check_hold_since = now
            self.counts["steps_held_for_checks"] = self.counts.get("steps_held_for_checks", 0) + 1
            logger.debug("%s: version %d waits for the checks of batch %d", self.device_id, version + 1, min(late))
        if now - self.check_hold_since < CHECK_HOLD_SECONDS:
            return True
        logger.warning(
            "%s: a check of batch %d has run for %.0f s: stepping on (a ban from it may not reach all of that work)",
            self.device_id,
            min(late),
            now - self.check_hold_since,
        )
        return False

    # pins ----------------------------------------------------------------------------------------
    def update_pins(self) -> None:
        """Pin the versions a ban may still need: this server's pin (unsettled_first) goes to every
        server of the run when it changes (and every PIN_REFRESH seconds while there is one), and every shard kept here
        keeps the versions from the run's oldest pin on (ShardState.pinned_from, bounded by PIN_EXTRA).
        Without it a liar whose checked work came a task every few steps was banned with its first
        batches beyond the kept versions (the drift test needs 5 checks), its work staying applied."""
        now = self.clock()
        for peer, (_, at) in self.pins_heard.items():  # (its seq stays: a late, older pin is still refused)
            if now - at > PIN_EXPIRY:
                self.asked.pop(peer, None)
        mine = self.unsettled()
        if mine is None:
            self.asked.pop(self.peer_id, None)
        else:
            self.asked[self.peer_id] = mine
        if mine != self.pin_sent[0] or (mine is not None and now - self.pin_sent[1] > PIN_REFRESH):
            self.pin_sent = (mine, now)
            self.outbox.spawn(self._send_pin(mine))
        self._apply_pins()

    def _apply_pins(self) -> None:
        oldest = min(self.asked.values(), default=None)
        pinned = None if oldest is None else version_for_batch(oldest)
        for shard in self.shards():
            shard.pinned_from = pinned

    async def _send_pin(self, batch: int | None) -> None:
        self.pin_seq += 1
        meta = {"batch": -1 if batch is None else batch, "seq": self.pin_seq}
        for d in [d for st in self.layout().stages for d in st.servers if d != self.device_id]:
            try:
                await self.call(d, "pin", meta)
            except (ConnectionError, RemoteError, PayloadError, asyncio.TimeoutError) as e:
                logger.debug("%s: pin to %s: %r", self.device_id, d, e)  # (sent again within PIN_REFRESH)

    async def on_pin(self, meta, tensors, sender):
        """A server's pin (update_pins): -1 for none. `seq` orders a server's pins (sent concurrently)."""
        batch, seq = mfield(meta, "batch", int), mfield(meta, "seq", int)
        if batch < -1:
            raise PayloadError(f"field 'batch' must be a batch or -1, got {batch}")
        if seq < self.pins_heard.get(sender, (0, 0.0))[0]:
            return {"ok": True}
        self.pins_heard[sender] = (seq, self.clock())
        if batch < 0:
            self.asked.pop(sender, None)
        else:
            self.asked[sender] = batch
        self._apply_pins()
        return {"ok": True}
