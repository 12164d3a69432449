"""What a client has earned at one pool: how many leases it may hold at once, and how long a lease of
a client that has not yet delivered may run.

Taking work without doing it must cost the taker, not the run (a stranger that registers many
identities and answers nothing would else hold the run's tasks until their timeouts):

* **allowance**: a client starts with ``start`` open leases; each task it completes on time (its own
  lease, before the deadline) adds one, up to ``most``; each of its leases that runs out halves it
  (at least one).  A hoarder is soon down to one lease; an honest client is at ``most`` after a few
  tasks.
* **strikes**: rounds of the client's leases that ran out in a row (an on-time completion clears
  them).  Leases the client took before its last strike ran out under the same short deadline and
  add no strike of their own: an honest newcomer that took two tasks at once and was slow with its
  first is one strike, not two.  The pool's owner drops a client with too many and makes it
  register again.
* **probation deadline**: until a client has completed a task on time, its leases last at most
  ``probation_factor`` x the typical *first* lease (an exponential average of the leases that
  unproven clients completed on time here: a newcomer's first task also fetches the parameters and
  builds its slice, which a proven client's next one does not; the average of every lease before
  any first one has come in), scaled by the client's own deadline factor, and never less than
  ``probation_floor``: an unknown client cannot sit on a task for the full timeout, and an honest
  one gets what newcomers here have needed.  None disables it.

With ``start`` None a client may always hold ``most`` leases and a task whose lease ran out is
anyone's again at once (the pool's plain behaviour); strikes are counted either way.

Plain bookkeeping: no clock, no I/O; the pool calls it.
"""

from __future__ import annotations

TYPICAL_WEIGHT = 0.2  # weight of the newest lease in the typical lease's average


class Standing:
    __slots__ = (
        "earning",
        "start",
        "most",
        "probation_factor",
        "probation_floor",
        "typical",
        "typical_first",
        "_allow",
        "_strikes",
        "_struck_at",
        "_proven",
    )

    def __init__(
        self, *, start: int | None, most: int, probation_factor: float | None = None, probation_floor: float = 1.0
    ) -> None:
        self.earning = start is not None  # leases are earned (else every client may hold `most`)
        self.start = most if start is None else max(1, min(start, most))
        self.most = most
        self.probation_factor = probation_factor
        self.probation_floor = probation_floor
        self.typical: float | None = None  # seconds from lease to on-time completion, averaged
        self.typical_first: float | None = None  # the same, of unproven clients' leases only
        self._allow: dict[str, int] = {}
        self._strikes: dict[str, int] = {}
        self._struck_at: dict[str, float] = {}  # when each client's last strike came (the pool's clock)
        self._proven: set[str] = set()

    def allowance(self, client: str) -> int:
        return self._allow.get(client, self.start)

    def strikes(self, client: str) -> int:
        return self._strikes.get(client, 0)

    def on_time(self, client: str, held_for: float) -> None:
        """The client completed its own lease before the deadline, `held_for` seconds after it took it."""
        allow = self._allow.get(client, self.start)
        if allow < self.most:
            self._allow[client] = allow + 1
        if client in self._strikes:
            del self._strikes[client]
        held_for = max(0.0, held_for)
        if client not in self._proven:
            first = self.typical_first
            self.typical_first = held_for if first is None else first + TYPICAL_WEIGHT * (held_for - first)
        self._proven.add(client)
        self.typical = held_for if self.typical is None else self.typical + TYPICAL_WEIGHT * (held_for - self.typical)

    def delivered_late(self, client: str) -> None:
        """The client completed a task whose lease of its own had run out: slow, not hoarding. Its
        strikes go (it is not dropped for them); its allowance and probation stay as they are."""
        self._strikes.pop(client, None)

    def expired(self, client: str, leased_at: float | None = None, now: float | None = None) -> int:
        """A lease of the client, taken at `leased_at`, ran out unanswered at `now`; returns its strikes
        now. A lease taken before the client's last strike adds none (the same round of short leases)."""
        if self.earning:
            self._allow[client] = max(1, self._allow.get(client, self.start) // 2)
        self._proven.discard(client)
        last = self._struck_at.get(client)
        if leased_at is not None and last is not None and leased_at < last and client in self._strikes:
            return self._strikes[client]
        if now is not None:
            self._struck_at[client] = now
        strikes = self._strikes[client] = self._strikes.get(client, 0) + 1
        return strikes

    def probation_cap(self, client: str, factor: float = 1.0) -> float | None:
        """The longest a new lease of `client` may last at a deadline factor of `factor`, or None (no
        cap: it has delivered, or nothing is known yet of how long a lease takes here)."""
        typical = self.typical if self.typical_first is None else self.typical_first
        if self.probation_factor is None or typical is None or client in self._proven:
            return None
        # doubled at each of its leases that ran out in a row: a slow honest newcomer gets a lease long
        # enough for its task after a few, a hoarder is dropped first
        return max(self.probation_floor, self.probation_factor * typical * factor) * 2 ** self.strikes(client)

    def trust(self, client: str) -> None:
        """The client is trusted (a worker of the run's own servers): it may hold `most` leases, and its
        leases run their full time."""
        self._allow[client] = self.most
        self._proven.add(client)

    def waits(self, client: str) -> bool:
        """Whether `client` must let a newly open task wait for the clients that have delivered (it has
        not, and some have): taking work nobody proven wanted is how a newcomer proves itself."""
        return self.earning and client not in self._proven and bool(self._proven)

    def proven(self, client: str) -> bool:
        """Whether the client has completed a task on time here since its last lease ran out."""
        return client in self._proven

    def forget(self, client: str) -> None:
        self._allow.pop(client, None)
        self._strikes.pop(client, None)
        self._struck_at.pop(client, None)
        self._proven.discard(client)
