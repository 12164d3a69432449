"""What each volunteer sent a server: the batches of its work a ban's rollback must reach, its checks
passed (probation), whether a contribution is drawn for a check, an unusually large gradient push, and
forgetting volunteers that left beyond every rollback's reach. A part of a server, built with what it
reads of it (parameter_server/parts.py); its checks are verify.py's."""

from __future__ import annotations

import collections
import random
from typing import Callable, Mapping

import torch

from core.protocol.refusals import Refusal
from core.protocol.wire import PayloadError

BANNED = "banned from this run"  # (the refusal's words for a person; its code is Refusal.BANNED)
# A gradient push whose norm per row passes NORM_FACTOR x the median of the last NORM_HISTORY pushes of
# its shard slot (anyone's) is re-run whatever the sample says: a patient liar that scales a few
# percent of its pushes after probation is caught at its first such lie, not after 1 / verify_rate
NORM_FACTOR, NORM_HISTORY = 4.0, 64
# A gradient push that agrees with its slot's AdamW first moment less than all but DIRECTION_QUANTILE of
# the slot's last NORM_HISTORY pushes (cosine) is re-run too, on a slot whose pushes do agree with it
# (their median cosine at least DIRECTION_MIN_MEDIAN, over at least DIRECTION_MIN_HISTORY pushes): a
# sign flip keeps its norm but points against the direction honest pushes share. Measured on `tiny`
# (scripts/bench_directions.py, docs/bench_directions.md): the slot holding the output head re-runs
# 60-67% of sign-flipped pushes (`small`, 40 steps: 26-31%), the one holding the embedding 27-29% (`small`:
# its pushes never agree enough), for 4-11% more re-runs of honest pushes there; the slots of
# transformer layers alone do not agree with their moment (median cosine about 0) and are left to
# the sample
DIRECTION_QUANTILE, DIRECTION_MIN_MEDIAN, DIRECTION_MIN_HISTORY = 0.05, 0.2, 8


def direction_bar(history, sender: str) -> float | None:
    """The cosine under which `sender`'s next push is re-run, from a slot's recent pushes `history`
    ((sender, cosine) pairs): all but DIRECTION_QUANTILE of the others' cosines are above it. None
    while the others' pushes are too few or do not agree with the slot's moment (their median under
    DIRECTION_MIN_MEDIAN): no direction check there."""
    ranked = sorted(c for who, c in history if who != sender)
    if len(ranked) < DIRECTION_MIN_HISTORY or ranked[len(ranked) // 2] < DIRECTION_MIN_MEDIAN:
        return None
    return ranked[int(DIRECTION_QUANTILE * (len(ranked) - 1))]


class Arrivals:
    """A server's record of what its volunteers sent, given what it reads of its server: the check
    settings (`verify_rate`, `probation`, the secret `rng` that draws the sample, the `drift` test) and
    `counts` (the server's check counters, written here too); `banned` (peer id -> why) and `clients`
    (the registered ones) as they are now; `is_server(peer)`; `replaying()` (a request-log replay
    remembers nothing); `kept_from()` (the oldest batch a rollback can still reach)."""

    def __init__(
        self,
        *,
        verify_rate: float,
        probation: int,
        rng: random.Random,
        drift,
        counts: dict,
        banned: Mapping[str, str],
        clients: Mapping,
        is_server: Callable[[str], bool],
        replaying: Callable[[], bool],
        kept_from: Callable[[], int],
    ) -> None:
        self.verify_rate, self.probation, self.rng, self.drift, self.counts = verify_rate, probation, rng, drift, counts
        self.banned, self.clients, self.is_server, self.replaying, self.kept_from = (
            banned,
            clients,
            is_server,
            replaying,
            kept_from,
        )
        self.push_norms: dict[int, collections.deque] = {}  # slot -> recent pushes' norms per row
        # slot -> recent pushes' (sender, cosine with the slot's moment)
        self.push_cosines: dict[int, collections.deque] = {}
        # per volunteer, forgotten once it has left and its batches are out of the kept window
        # (forget_departed; a run of days sees tens of thousands of volunteers come and go)
        self.checks_passed: dict[str, int] = {}  # peer id -> its checks passed here (probation ends at `probation`)
        # peer ids whose probation ended with their differences not drifting (drift.suspicious): until
        # then a ban would roll back to their first work (unsettled_first)
        self.cleared: set[str] = set()
        self.contributed: dict[str, set[int]] = {}  # peer id -> batches it sent work of (kept window)
        # peer id -> the first batch it ever sent work of here, kept past the window: a ban then says
        # which of its work stays applied instead of rolling back to the window's start in silence
        self.first_contributed: dict[str, int] = {}
        self.passed_distance: dict[str, float] = {}  # peer -> the largest distance of a check it passed
        self.departed_distance = 0.0  # the same, of volunteers forgotten (forget_departed) and never banned

    def honest_distance(self) -> float:
        """The largest distance of a passed check of a volunteer not banned: how far honest re-runs go."""
        return max([self.departed_distance] + [d for p, d in self.passed_distance.items() if p not in self.banned])

    def refuse_banned(self, sender: str) -> None:
        """Refuse a request of a banned peer."""
        if sender in self.banned:
            raise PayloadError(f"peer {sender[-8:]} is {BANNED}: {self.banned[sender]}", Refusal.BANNED)

    def passed(self, sender: str, seen: list[float]) -> None:
        """A whole check of `sender`'s work passed with these distances (every one within the tolerance)."""
        self.passed_distance[sender] = max([self.passed_distance.get(sender, 0.0), *seen])
        self.counts["passed"] += 1
        self.checks_passed[sender] = self.checks_passed.get(sender, 0) + 1
        if self.checks_passed[sender] >= self.probation and not self.drift.suspicious(sender):
            self.cleared.add(sender)

    def note_contribution(self, sender: str, t: int, shared_by: int = 1) -> bool:
        """Remember that `sender` (a volunteer) sent work of batch t; True if this one is to be checked.
        Work that `shared_by` servers receive (a gradient push goes to every shard server) is checked by
        each with probability p = 1 - (1 - verify_rate) ** (1 / shared_by), drawn apart, so that it is
        re-run by at least one of them with probability verify_rate: every time at 1.0 (as
        verify_rate / shared_by, a push of two shard servers went unchecked one time in four at 1.0);
        on probation every server checks it."""
        if not self.note_work(sender, t):
            return False
        # on probation until `probation` checks passed (a check skipped for want of its rows does not count),
        # and again while its differences drift one way (drift.py)
        return (
            self.checks_passed.get(sender, 0) < self.probation
            or self.drift.suspicious(sender)
            or self.rng.random() < 1.0 - (1.0 - self.verify_rate) ** (1.0 / shared_by)
        )

    def unusual_norm(self, slot: int, grads: list[torch.Tensor], rows: int) -> bool:
        """Whether a gradient push of `rows` rows is far larger than the slot's recent pushes (NORM_FACTOR
        x their median norm per row); the push joins the slot's history either way."""
        norm = float(torch.sqrt(sum(g.float().pow(2).sum() for g in grads))) / max(rows, 1)
        history = self.push_norms.setdefault(slot, collections.deque(maxlen=NORM_HISTORY))
        typical = sorted(history)[len(history) // 2] if len(history) >= 8 else None
        history.append(norm)
        if typical is None or norm <= NORM_FACTOR * typical:
            return False
        self.counts["unusual_norms"] = self.counts.get("unusual_norms", 0) + 1
        return True

    def unsettled_first(self) -> int | None:
        """The oldest batch of work sent here by a registered volunteer not yet past its checks: its
        first work on while its probation has not ended with differences that do not drift (a liar
        under the tolerance drifts from its 3rd check: it stays there until banned), its work in the
        kept window on while its differences drift after that (drift.suspicious). A ban of it would
        roll back there."""
        firsts, suspects = [], self.drift.suspects()
        for peer, batches in self.contributed.items():
            if peer not in self.clients or peer in self.banned or not batches:
                continue
            if self.probation > 0 and peer not in self.cleared:
                firsts.append(self.first_contributed.get(peer, min(batches)))
            elif peer in suspects:
                firsts.append(min(batches))
        return min(firsts, default=None)

    def unusual_direction(self, slot: int, shard, grads: list[torch.Tensor], sender: str) -> bool:
        """Whether `sender`'s gradient push for `slot` (held here as `shard`) agrees with the slot's AdamW
        first moment less than all but DIRECTION_QUANTILE of the slot's recent pushes by others, where
        those agree with it; the push joins the slot's history either way. (Others' only: a liar's own
        flips, once in the history, would lower the bar its next flips are held to.)"""
        cosine = shard.momentum_cosine(grads)
        if cosine is None:
            return False
        history = self.push_cosines.setdefault(slot, collections.deque(maxlen=NORM_HISTORY))
        bar = direction_bar(history, sender)
        history.append((sender, cosine))
        if bar is None or cosine >= bar:
            return False
        self.counts["unusual_directions"] = self.counts.get("unusual_directions", 0) + 1
        return True

    def note_work(self, sender: str, t: int) -> bool:
        """Remember that `sender` (a volunteer) sent work of batch t, which a ban's rollback must reach:
        also work checked with another message (an input gradient, relayed to the previous stage at
        once and checked with its sender's gradient push, which may never come). False when there is
        nothing to remember: a replayed request, or a server's work."""
        if self.replaying() or self.is_server(sender):
            return False
        kept = self.kept_from()
        batches = self.contributed.setdefault(sender, set())
        batches.add(t)
        self.first_contributed[sender] = min(t, self.first_contributed.get(sender, t))
        batches.difference_update([b for b in batches if b < kept])
        return True

    def forget_departed(self) -> None:
        """Forget what this server remembers of volunteers that have left (not registered here) and
        whose contributions are all older than the kept versions, which no rollback can reach: their
        batches for a ban, and their passed checks (one that comes back is on probation again)."""
        kept = self.kept_from()
        for peer in [p for p in self.contributed if p not in self.clients]:
            if all(b < kept for b in self.contributed[peer]):
                del self.contributed[peer]
                self.first_contributed.pop(peer, None)
        for peer in [p for p in self.checks_passed if p not in self.clients and p not in self.contributed]:
            del self.checks_passed[peer]
            self.cleared.discard(peer)
            self.drift.forget(peer)
        for peer in [p for p in self.passed_distance if p not in self.clients and p not in self.contributed]:
            if peer not in self.banned:  # (gone for good, never banned: its distances were honest)
                self.departed_distance = max(self.departed_distance, self.passed_distance[peer])
            del self.passed_distance[peer]
