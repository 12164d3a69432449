"""Baselines: `random` (the best of random valid plans) and `ga`, the competitor's scheduler:
the hybrid genetic algorithm of section 3.4 of papers/decentralized-fm-scheduling.txt,
adapted to this cost model.

ga, as adapted here:
- an individual is a balanced partition of the reliable devices into K groups (sizes differ by
  at most one); K is fixed per individual, the population spreads over several K;
- volunteers (which this paper does not have) get one gene each, taking part or idle; those
  taking part join the stage of smallest mean a + t/b (the design paper's rule);
- decoding: the groups' order is the open TSP on the coarse graph (the paper's pipeline cost,
  eq. 4; solved here by annealing), roles by the design paper's rule (this paper has no
  frontal/backward roles), layers by the exact split; fitness is the exact cost;
- crossover (Bui and Moon style): the second parent's groups are relabelled to best overlap the
  first's, the child takes each device's group from either parent at random, then is
  rebalanced by moving random devices from groups that are too large; volunteer genes are
  taken from either parent at random and each flipped with probability 1/U;
- local search: the paper's own, for pairs of groups j, j': the fastest edge inside each
  (d1-d2, d1'-d2'), the four swaps d1/d2 <-> d1'/d2', gain = mean w(d, C_j') - w(d1, d2) +
  mean w(d', C_j) - w(d1', d2'); the best swap with positive gain is made, until none;
- steady state: the child replaces the worst individual when it is better.
"""

from __future__ import annotations

import time

import numpy as np

from scheduler.cost import Engine
from scheduler.paper import assign_roles, assign_volunteers, coarse_graph, edge_weights
from scheduler.refine import polish_orders, random_layout
from scheduler.state import Layout, State
from scheduler.tsp import anneal_open_path


def random_search(eng: Engine, rng: np.random.Generator, time_limit: float, t0: float) -> State:
    deadline = t0 + 0.92 * time_limit
    n = int(max(20, 300 * time_limit))
    best = None
    for i in range(n):
        if i and time.monotonic() > deadline:
            break
        s = State(eng, random_layout(eng, rng))
        if best is None or s.cand.better_than(best.pt, best.sec):
            best = s
    return best


def _balanced(rng, R: int, K: int) -> np.ndarray:
    g = np.arange(R) % K
    rng.shuffle(g)
    return g


def _crossover(rng, p1: np.ndarray, p2: np.ndarray, K: int) -> np.ndarray:
    # relabel p2 to overlap p1 most (greedy on the overlap matrix)
    ov = np.zeros((K, K), dtype=int)
    np.add.at(ov, (p2, p1), 1)
    relabel = np.full(K, -1)
    used = set()
    for a, b in sorted(((int(a), int(b)) for a in range(K) for b in range(K)), key=lambda ab: -ov[ab]):
        if relabel[a] < 0 and b not in used:
            relabel[a] = b
            used.add(b)
    q = relabel[p2]
    child = np.where(rng.random(len(p1)) < 0.5, p1, q)
    counts = np.bincount(child, minlength=K)
    while counts.max() - counts.min() > 1:
        src, dst = int(np.argmax(counts)), int(np.argmin(counts))
        members = np.flatnonzero(child == src)
        child[members[rng.integers(len(members))]] = dst
        counts[src] -= 1
        counts[dst] += 1
    return child


def _ga_local_search(W: np.ndarray, g: np.ndarray, K: int, rng, max_rounds: int = 4) -> np.ndarray:
    g = g.copy()
    for _ in range(max_rounds):
        groups = [np.flatnonzero(g == k) for k in range(K)]
        fast = []
        for c in groups:
            sub = W[np.ix_(c, c)] + np.where(np.eye(len(c), dtype=bool), np.inf, 0.0)
            a, b = np.unravel_index(int(np.argmin(sub)), sub.shape)
            fast.append((int(c[a]), int(c[b]), float(sub[a, b])))
        best_gain, best_swap = 0.0, None
        pairs = [(j, jj) for j in range(K) for jj in range(j + 1, K)]
        if len(pairs) > 4 * K:
            pairs = [pairs[i] for i in rng.choice(len(pairs), 4 * K, replace=False)]
        for j, jj in pairs:
            d1, d2, w12 = fast[j]
            e1, e2, w12b = fast[jj]
            for d, dpartner in ((d1, d2), (d2, d1)):
                for e, epartner in ((e1, e2), (e2, e1)):
                    gain = W[d, groups[jj]].mean() - W[d, dpartner] + W[e, groups[j]].mean() - W[e, epartner]
                    if gain > best_gain + 1e-15:
                        best_gain, best_swap = gain, (d, e)
        if best_swap is None:
            break
        d, e = best_swap
        g[d], g[e] = g[e], g[d]
    return g


def _decode(eng: Engine, W: np.ndarray, g: np.ndarray, K: int, use: np.ndarray, rng) -> Layout:
    clusters = [np.flatnonzero(g == k) for k in range(K)]
    path = anneal_open_path(coarse_graph(W, clusters), rng, iterations=min(4000, 200 + 20 * K * K), restarts=1)
    ordered = [clusters[i] for i in path]
    fs, bs = assign_roles(eng, ordered)
    us = assign_volunteers(eng, [f + b for f, b in zip(fs, bs)])
    return Layout(fs, bs, [[u for u in x if use[u]] for x in us])


def genetic(eng: Engine, rng: np.random.Generator, time_limit: float, t0: float) -> State:
    deadline = t0 + 0.92 * time_limit
    W = edge_weights(eng)
    kmax = max(1, min(eng.L, eng.R // 2))
    Ks = list(range(1, kmax + 1)) if kmax <= 8 else sorted({int(round(x)) for x in np.geomspace(1, kmax, 8)})
    pop_size = max(12, 2 * len(Ks))
    pop = []  # (pt, sec, K, labels, volunteer genes, state)
    for i in range(pop_size):
        K = Ks[i % len(Ks)]
        g = _ga_local_search(W, _balanced(rng, eng.R, K), K, rng)
        use = rng.random(eng.U) < (1.0, 0.0, 0.5)[i // len(Ks) % 3]
        s = State(eng, _decode(eng, W, g, K, use, rng))
        pop.append((s.pt, s.sec, K, g, use, s))
        if time.monotonic() > deadline:
            break
    generations = int(max(20, 150 * time_limit))
    for _ in range(generations):
        if time.monotonic() > deadline:
            break
        a = pop[int(rng.integers(len(pop)))]
        mates = [p for p in pop if p[2] == a[2] and p is not a]
        K = a[2]
        if mates and K > 1:
            b = mates[int(rng.integers(len(mates)))]
            child = _crossover(rng, a[3], b[3], K)
            use = np.where(rng.random(eng.U) < 0.5, a[4], b[4])
        else:  # no mate of the same K: a mutation (a random swap)
            child = a[3].copy()
            x, y = rng.choice(eng.R, 2, replace=False)
            child[x], child[y] = child[y], child[x]
            use = a[4].copy()
        use = use ^ (rng.random(eng.U) < 1.0 / max(eng.U, 1))
        child = _ga_local_search(W, child, K, rng)
        s = State(eng, _decode(eng, W, child, K, use, rng))
        worst = max(range(len(pop)), key=lambda i: (pop[i][0], pop[i][1]))
        if s.cand.better_than(pop[worst][0], pop[worst][1]):
            pop[worst] = (s.pt, s.sec, K, child, use, s)
    best = min(pop, key=lambda p: (p[0], p[1]))[5]
    return polish_orders(best, t0 + 0.97 * time_limit)
