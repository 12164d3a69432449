"""Consistent small lies add up: a sequential test on the direction of a volunteer's differences.

A check compares a volunteer's result with a re-run by relative L2 distance against a tolerance
(verify.py) set wide enough for honest devices that sum in another order (another thread count, a GPU).
A liar that stays under it on every task, biasing its results the same way each time, passes every
such check and still moves the model (a bias of 3e-4 of the result's norm on one coordinate moved a
60-step run 3.3e-3 from the reference). What gives it away is the direction: honest differences come
from rounding and change sign from one input to the next, a bias points the same way every time.

So each server keeps, per volunteer and kind of result, a running sum along K fixed random directions
r_1..r_K (random signs, drawn from a secret of this server's own, so a volunteer cannot steer around
them) of each check's difference d = got - want, normalised by its own size:

    v_k = <d, r_k> / max(|d|, FLOOR |want|)          S_k = sum of v_k over the N checks so far

For honest differences (zero-mean along any fixed direction, independent from check to check) each
v_k has mean 0 and variance at most 1, so Q_N = sum_k S_k^2 / N is about chi-squared with K degrees of
freedom. A liar whose difference is a fixed vector has |v_k| near 1 with the same sign every time, and
Q_N near K N. The volunteer is banned when Q_N passes the chi-squared quantile at alpha_N =
6 ALPHA / (pi^2 N^2): summed over every N, the chance an honest volunteer is ever banned by this test
at one server, for one kind of result, is at most ALPHA (a union bound). Differences below FLOOR of
the result's norm count for less than one (an honest re-run on the same device is within 1e-6), so a
bias below about FLOOR is not caught; one at 3e-4 is caught at its 5th check with K = 16 (its Q_N is about K N).

A lie along the result itself (every result scaled by 1 + s, s under the tolerance) is consistent too,
but not along a fixed vector: the result changes from check to check, and so does the sign of its
projection on each r_k. So a second sum looks along the result, in K blocks of coordinates (each
coordinate's block drawn from the same secret):

    u_k = <d_k, want_k> / (|want_k| max(|d_k|, FLOOR |want_k|))          T_k = sum of u_k

|u_k| <= 1 (Cauchy-Schwarz), and honest rounding has no preferred sign along the result (rounding to
nearest is unbiased), so T is tested as S is, each of the two at ALPHA / 2. A scale lie s >= FLOOR
has u_k = 1 in every block: it is caught as soon as a fixed bias is.

Pure arithmetic on tensors: no network, no state of the server's but its sums.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading

import torch

DIRECTIONS = 16
FLOOR = 1e-5  # relative size under which a difference counts in proportion to FLOOR, not to itself
ALPHA = 1e-6  # the most an honest volunteer's chance of a ban by the two tests, per server and kind of result
CHUNK = 1 << 20  # elements of a direction drawn at once
SIGN_BITS = 16  # directions whose signs one random word gives (DriftTest.project)
SIGN_CHUNK = 1 << 16  # coordinates whose signs are drawn at once: a (chunk, 16) float64 matrix is 8 MiB


def chi2_survival(x: float, k: int) -> float:
    """P(X > x) for X chi-squared with an even number k of degrees of freedom (closed form)."""
    half = x / 2.0
    term, total = 1.0, 1.0
    for i in range(1, k // 2):
        term *= half / i
        total += term
    return math.exp(-half) * total


def chi2_quantile(p: float, k: int) -> float:
    """The x with P(X > x) = p, for X chi-squared with even k (bisection)."""
    lo, hi = 0.0, 10.0 * k + 200.0
    while chi2_survival(hi, k) > p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_survival(mid, k) > p else (lo, mid)
    return hi


def bound(n: int, k: int = DIRECTIONS, alpha: float = ALPHA) -> float:
    """Q_N's threshold after n checks."""
    return chi2_quantile(6.0 * alpha / (math.pi**2 * n * n), k)


class DriftTest:
    """The running sums of one server: `add` one check, and it says whether the volunteer's
    differences point the same way too often to be rounding."""

    def __init__(
        self, secret: bytes | None = None, directions: int = DIRECTIONS, floor: float = FLOOR, alpha: float = ALPHA
    ):
        if directions < 2 or directions % 2:
            raise ValueError("the drift test takes an even number of directions, at least 2")
        self.secret = os.urandom(16) if secret is None else secret
        self.k, self.floor, self.alpha = directions, floor, alpha
        self.sums: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}  # (peer, kind) -> (S_k, N)
        self.kinds: dict[str, set[str]] = {}  # peer -> its kinds in `sums` (a peer's sums without a scan)
        # `add` runs in a server's checks thread, the other methods in its event loop
        self._lock = threading.Lock()

    def _seed(self, k: int, n: int) -> int:
        digest = hashlib.sha256(self.secret + f":{k}:{n}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def _generator(self, k: int, n: int) -> torch.Generator:
        return torch.Generator().manual_seed(self._seed(k, n))

    def project(self, d: torch.Tensor) -> torch.Tensor:
        """<d, r_k> for k = 1..K, the directions drawn in chunks (no K x n matrix is held): one random
        16-bit word per coordinate gives the signs of 16 directions at once (bit j is direction
        g + j's), and a chunk's 16 sums are one matrix product (a sign drawn per coordinate and
        direction took 0.17 s for 1 M values, this 0.054 s)."""
        d = d.detach().flatten().double().cpu()
        n = d.numel()
        out = torch.zeros(self.k, dtype=torch.float64)
        for g in range(0, self.k, SIGN_BITS):
            width = min(SIGN_BITS, self.k - g)
            shifts = torch.arange(width, dtype=torch.int32)
            gen = self._generator(g, n)
            for lo in range(0, n, SIGN_CHUNK):
                part = d[lo : lo + SIGN_CHUNK]
                words = torch.randint(0, 1 << SIGN_BITS, (part.numel(),), generator=gen, dtype=torch.int32)
                bits = ((words.unsqueeze(1) >> shifts) & 1).to(torch.float64)  # (chunk, width): 1 is +, 0 is -
                out[g : g + width] += 2 * (part @ bits) - part.sum()
        return out

    def along(self, d: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """u_k for k = 1..K: d's component along `want`, block by block (the blocks drawn in chunks)."""
        d, want = d.detach().flatten(), want.detach().flatten()  # (in float64 a chunk at a time)
        n = d.numel()
        dw, ww, dd = (torch.zeros(self.k, dtype=torch.float64) for _ in range(3))
        gen = self._generator(self.k, n)  # (k = K: a stream of its own, apart from the directions')
        for lo in range(0, n, CHUNK):
            dp, wp = d[lo : lo + CHUNK].double().cpu(), want[lo : lo + CHUNK].double().cpu()
            block = torch.randint(0, self.k, (dp.numel(),), generator=gen)
            dw.index_add_(0, block, dp * wp)
            ww.index_add_(0, block, wp * wp)
            dd.index_add_(0, block, dp * dp)
        wn = ww.sqrt()
        size = torch.maximum(dd.sqrt(), self.floor * wn).clamp_min(1e-30)
        return torch.where(wn > 0, dw / (wn.clamp_min(1e-300) * size), torch.zeros_like(dw))

    def add(self, peer: str, kind: str, got: torch.Tensor, want: torch.Tensor) -> tuple[float, float] | None:
        """Add one check of `peer`'s result of `kind`; (Q_N, its bound) when Q_N passes the bound
        (ban), else None."""
        want64 = want.detach().flatten().double().cpu()
        d = got.detach().flatten().double().cpu() - want64
        scale = max(float(torch.linalg.vector_norm(d)), self.floor * float(torch.linalg.vector_norm(want64)), 1e-30)
        del want64
        v = torch.cat([self.project(d) / scale, self.along(d, want)])
        with self._lock:
            s, n = self.sums.get((peer, kind), (torch.zeros(2 * self.k, dtype=torch.float64), 0))
            s, n = s + v, n + 1
            self.sums[(peer, kind)] = (s, n)
            self.kinds.setdefault(peer, set()).add(kind)
        q, b = self.q(s, n), bound(n, self.k, self.alpha / 2)
        return (q, b) if q > b else None

    def q(self, s: torch.Tensor, n: int) -> float:
        """Q_N of a sum: the larger of the two tests' (along the directions, along the result)."""
        return max(float((s[: self.k] ** 2).sum()), float((s[self.k :] ** 2).sum())) / n

    def suspicious(self, peer: str) -> bool:
        """Whether some sum of `peer`'s has drifted past twice its honest mean (Q_N > 2K): its work is
        then checked every time, so that a bias is caught while a rollback can still undo it."""
        with self._lock:
            mine = [self.sums[(peer, kind)] for kind in self.kinds.get(peer, ())]
        return any(self.q(s, n) > 2 * self.k for s, n in mine)

    def suspects(self) -> set[str]:
        """Every peer `suspicious` holds for, in one pass over the sums (a server asks for each of
        its volunteers every maintenance tick: one `suspicious` call each would read every sum each)."""
        with self._lock:
            return {p for (p, _), (s, n) in self.sums.items() if self.q(s, n) > 2 * self.k}

    def forget(self, peer: str) -> None:
        with self._lock:
            for kind in self.kinds.pop(peer, ()):
                del self.sums[(peer, kind)]
