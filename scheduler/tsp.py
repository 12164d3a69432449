"""Open travelling-salesman path (a Hamiltonian path with free ends) on a small symmetric
graph: simulated annealing over segment reversals (section 3.3.3 of the design paper), and a
brute force to check it against."""

from __future__ import annotations

import itertools
import math

import numpy as np


def path_cost(W: np.ndarray, path) -> float:
    return float(sum(W[path[i], path[i + 1]] for i in range(len(path) - 1)))


def brute_force_open_path(W: np.ndarray) -> list:
    """The cheapest open path by trying every order (n <= 9 or so)."""
    n = len(W)
    best, best_c = list(range(n)), math.inf
    for perm in itertools.permutations(range(n)):
        if n > 1 and perm[0] > perm[-1]:
            continue  # a path and its reverse cost the same
        c = path_cost(W, perm)
        if c < best_c - 1e-12:
            best, best_c = list(perm), c
    return best


def _reversal_delta(W, p, i, j) -> float:
    """Cost change of reversing p[i..j] (inclusive) in an open path."""
    n = len(p)
    d = 0.0
    if i > 0:
        d += W[p[i - 1], p[j]] - W[p[i - 1], p[i]]
    if j < n - 1:
        d += W[p[i], p[j + 1]] - W[p[j], p[j + 1]]
    return d


def two_opt(W: np.ndarray, path: list) -> list:
    """Segment reversals until none helps (a local optimum for the annealing to end in)."""
    p = list(path)
    n = len(p)
    improved = True
    while improved:
        improved = False
        for i in range(n - 1):
            for j in range(i + 1, n):
                if (i, j) != (0, n - 1) and _reversal_delta(W, p, i, j) < -1e-12:
                    p[i : j + 1] = p[i : j + 1][::-1]
                    improved = True
    return p


def anneal_open_path(W: np.ndarray, rng: np.random.Generator, iterations: int | None = None, restarts: int = 2) -> list:
    """Simulated annealing for the open TSP on the symmetric matrix W; deterministic given rng.

    Moves reverse a random segment of the path (a 2-opt move on an open path; reversing a
    prefix or suffix moves an end). The temperature falls geometrically from the mean edge
    weight to a thousandth of the smallest positive edge difference; the best path seen is kept
    and finished with two_opt."""
    W = np.asarray(W, dtype=float)
    n = len(W)
    if n <= 2:
        return list(range(n))
    if n == 3:
        return brute_force_open_path(W)
    if iterations is None:
        iterations = min(60_000, 400 + 150 * n * n)
    off = W[~np.eye(n, dtype=bool)]
    t0 = max(float(off.mean()), 1e-12)
    diffs = np.diff(np.unique(off))
    t1 = max(float(diffs[diffs > 0].min()) * 1e-3 if (diffs > 0).any() else t0 * 1e-6, t0 * 1e-9)
    alpha = (t1 / t0) ** (1.0 / max(iterations - 1, 1))
    Wl = W.tolist()
    best, best_c = None, math.inf
    for _ in range(restarts):
        p = [int(x) for x in rng.permutation(n)]
        c = path_cost(W, p)
        rb, rb_c = list(p), c
        ii = rng.integers(0, n, size=iterations).tolist()
        jj = rng.integers(0, n - 1, size=iterations).tolist()
        uu = rng.random(iterations).tolist()
        t = t0
        for it in range(iterations):
            i, j = ii[it], jj[it]
            if j >= i:
                j += 1
            else:
                i, j = j, i
            if i == 0 and j == n - 1:
                t *= alpha
                continue
            d = 0.0
            if i > 0:
                d += Wl[p[i - 1]][p[j]] - Wl[p[i - 1]][p[i]]
            if j < n - 1:
                d += Wl[p[i]][p[j + 1]] - Wl[p[j]][p[j + 1]]
            if d <= 0 or uu[it] < math.exp(-d / t):
                p[i : j + 1] = p[i : j + 1][::-1]
                c += d
                if c < rb_c - 1e-12:
                    rb, rb_c = list(p), c
            t *= alpha
        rb = two_opt(W, rb)
        rb_c = path_cost(W, rb)
        if rb_c < best_c - 1e-12:
            best, best_c = rb, rb_c
    return best
