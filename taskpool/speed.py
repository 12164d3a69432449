"""Per-client bookkeeping: leases held, completions, throughput, and the deadline factor.

Throughput is an exponential moving average of completions per second on the pool's
clock, with a half-life ``h``.  With ``decay = ln 2 / h`` a client keeps

* ``s``: completions, each weighted by ``exp(-decay * age)`` (updated at each completion);
* ``t0``: when the pool first saw it.

Its rate at time ``t`` is ``s(t) / W(t)`` where ``W(t) = (1 - exp(-decay (t - t0))) / decay``
is the total weight of the time it has been observed.  For a client completing ``r``
tasks per second since ``t0`` this is ``r`` from the start (no warm-up bias), and after
many half-lives it is the usual EMA.  A client with no completion, or observed for no
time at all, has no measurement (``None``).

The deadline factor of a client is ``median / own``, clamped to ``[0.5, 4]``: over the
measured throughputs when the client has one, else over the speeds seeded with
``set_client_speed`` when it has one, else 1.0.  The two scales are never mixed (tasks/s
and relative compute power are different units).
"""

from __future__ import annotations

import math

MIN_FACTOR = 0.5
MAX_FACTOR = 4.0
# A client's deadline factor, and the median of measured throughputs, are recomputed at
# most once per half-life / 64 of clock time, or when the set of clients in a median
# changes; within that interval an average moves by about 1 %, and take() stays O(1) in
# the number of clients.
REFRESH_PER_HALFLIFE = 64


class ClientRecord:
    """What the pool knows about one client.

    ``leases`` maps task id -> the pool's entry for every lease the client holds now
    (insertion ordered); it is the only place a client's leases are listed.
    """

    __slots__ = (
        "t0",
        "last",
        "s",
        "done",
        "leases",
        "seed",
        "factor",
        "factor_time",
        "factor_version",
        "busy_rows",
        "busy_seconds",
        "busy_until",
    )

    def __init__(self, now: float) -> None:
        self.t0 = now
        self.last = now
        self.s = 0.0
        self.done = 0
        self.leases: dict = {}
        self.seed: float | None = None
        self.factor = 1.0
        self.factor_time = -math.inf
        self.factor_version = -1
        self.busy_rows = 0.0  # rows completed, decayed like `s`
        self.busy_seconds = 0.0  # seconds with a lease of this client open, decayed alike
        self.busy_until = -math.inf

    def record_busy(self, leased_at: float, now: float, rows: int, decay: float) -> None:
        """A task of `rows` rows, leased at `leased_at`, completed at `now`: the time since the later
        of its lease and the client's last completion counts as busy (time with a lease of its open,
        counted once however many it held)."""
        keep = math.exp(-decay * max(now - self.busy_until, 0.0)) if self.busy_until > -math.inf else 1.0
        self.busy_seconds = self.busy_seconds * keep + max(now - max(leased_at, self.busy_until), 0.0)
        self.busy_rows = self.busy_rows * keep + rows
        self.busy_until = max(self.busy_until, now)

    def capacity(self) -> float | None:
        """Rows a second while the client holds work: what it can do, not what it was given (a client
        handed one batch in ten completes a tenth of the tasks a second, at its full speed)."""
        return self.busy_rows / self.busy_seconds if self.busy_seconds > 0 else None

    def record_completion(self, now: float, decay: float) -> None:
        dt = now - self.last
        self.s = (self.s * math.exp(-decay * dt) if dt > 0 else self.s) + 1.0
        if now > self.last:
            self.last = now
        self.done += 1

    def rate(self, now: float, decay: float) -> float | None:
        """Completions per second (moving average) at ``now``; None if not measured."""
        if not self.done:
            return None
        observed = now - self.t0
        if observed <= 0:
            return None
        weight = -math.expm1(-decay * observed) / decay
        dt = now - self.last
        return (self.s * math.exp(-decay * dt) if dt > 0 else self.s) / weight


def median(values: list[float]) -> float | None:
    if not values:
        return None
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2.0


def clamp_factor(factor: float) -> float:
    return MIN_FACTOR if factor < MIN_FACTOR else MAX_FACTOR if factor > MAX_FACTOR else factor


class SpeedBook:
    """All client records, and the deadline factor derived from them.

    ``version`` changes whenever the set of clients that could be in a median changes
    (a first completion, a seed, a client leaving); the cached medians depend on it.
    """

    __slots__ = (
        "clients",
        "decay",
        "refresh",
        "version",
        "_rate_median",
        "_rate_key",
        "_rate_time",
        "_seed_median",
        "_seed_key",
        "any_speed",
    )

    def __init__(self, halflife: float) -> None:
        self.clients: dict[str, ClientRecord] = {}
        self.decay = math.log(2.0) / halflife
        self.refresh = halflife / REFRESH_PER_HALFLIFE
        self.version = 0
        self.any_speed = False  # True once any client has a completion or a seed
        self._rate_median: float | None = None
        self._rate_key = -1
        self._rate_time = -math.inf
        self._seed_median: float | None = None
        self._seed_key = -1

    def get(self, client: str, now: float) -> ClientRecord:
        rec = self.clients.get(client)
        if rec is None:
            rec = self.clients[client] = ClientRecord(now)
        return rec

    def completed(self, client: str, now: float) -> None:
        rec = self.get(client, now)
        rec.record_completion(now, self.decay)
        if rec.done == 1:
            self.version += 1
            self.any_speed = True

    def seed(self, client: str, speed: float, now: float) -> None:
        self.get(client, now).seed = speed
        self.version += 1
        self.any_speed = True

    def forget(self, client: str) -> ClientRecord | None:
        rec = self.clients.pop(client, None)
        if rec is not None:
            self.version += 1
        return rec

    def rate_median(self, now: float) -> float | None:
        if self._rate_key != self.version or now - self._rate_time >= self.refresh or now < self._rate_time:
            decay = self.decay
            rates = [r for rec in self.clients.values() if (r := rec.rate(now, decay))]
            self._rate_median = median(rates)
            self._rate_key = self.version
            self._rate_time = now
        return self._rate_median

    def seed_median(self) -> float | None:
        if self._seed_key != self.version:
            self._seed_median = median([rec.seed for rec in self.clients.values() if rec.seed is not None])
            self._seed_key = self.version
        return self._seed_median

    def factor(self, rec: ClientRecord, now: float) -> float:
        """How much longer (>1) or shorter (<1) than the task timeout this client gets."""
        if rec.factor_version == self.version and 0 <= now - rec.factor_time < self.refresh:
            return rec.factor
        rec.factor = factor = self._factor(rec, now)
        rec.factor_time = now
        rec.factor_version = self.version
        return factor

    def _factor(self, rec: ClientRecord, now: float) -> float:
        own = rec.rate(now, self.decay)
        if own:
            med = self.rate_median(now)
            if med:
                return clamp_factor(med / own)
        if rec.seed is not None:
            med = self.seed_median()
            if med:
                return clamp_factor(med / rec.seed)
        return 1.0

    def figures(self, now: float, allowance) -> dict[str, dict]:
        """Each client's figures for the pool's stats: ``throughput`` (0.0 without a measurement),
        ``capacity`` (rows a second while it holds a lease, 0.0 unknown: `ClientRecord.capacity`),
        ``done``, ``leases`` held and ``allowance`` (`allowance(client)`, taskpool/standing.py)."""
        return {
            name: {
                "throughput": rec.rate(now, self.decay) or 0.0,
                "capacity": rec.capacity() or 0.0,
                "done": rec.done,
                "leases": len(rec.leases),
                "allowance": allowance(name),
            }
            for name, rec in self.clients.items()
        }
