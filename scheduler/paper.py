"""The design paper's planner (section 3.3.3 of papers/hybrid-ps-pipeline.txt, as
docs/cost-model.md spells it out):

1. communication graph of the reliable devices, edge weight a_ij + a_ji + t/b_ij + t/b_ji with
   t = m * a (one micro-batch's activations at a stage boundary);
2. divisive hierarchical clustering (DIANA: split the cluster of largest diameter, seeding the
   splinter group with its most remote device), scoring each level p with equation 2 and
   DT_k ~ D |H| / (d p sum C_s) (equation 3); stop at the level before PT rises;
3. stage order: open TSP on the coarse graph (mean edge weight between clusters), solved by
   simulated annealing;
4. roles: each device to the side (FS: from the previous stage, BS: to the next stage) with
   the smaller mean one-way time for t bytes; a side that is left empty takes the slowest
   device (least compute) of the other;
5. each volunteer to the stage of smallest mean a + t/b over the stage's servers;
6. layers in proportion to each stage's total compute (largest remainder, at least one each).
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.cost import Engine
from scheduler.state import Layout
from scheduler.tsp import anneal_open_path


def edge_weights(eng: Engine) -> np.ndarray:
    W = eng.rt_d + eng.ma * eng.rt_ib
    np.fill_diagonal(W, 0.0)
    return W


def diana_split(W: np.ndarray, members: np.ndarray):
    """Split `members` (>= 4) in two groups of at least 2 by DIANA's splinter procedure."""
    D = W[np.ix_(members, members)]
    n = len(members)
    in_spl = np.zeros(n, dtype=bool)
    first = int(np.argmax(D.sum(axis=1)))
    in_spl[first] = True
    to_spl = D[:, first].copy()
    to_rest = D.sum(axis=1) - to_spl
    n_spl = 1
    while n - n_spl > 2:
        n_rest = n - n_spl
        # mean distance to the rest (excluding itself) minus mean distance to the splinter group
        gain = np.where(in_spl, -np.inf, to_rest / (n_rest - 1) - to_spl / n_spl)
        j = int(np.argmax(gain))
        if gain[j] <= 0 and n_spl >= 2:
            break
        in_spl[j] = True
        n_spl += 1
        to_spl += D[:, j]
        to_rest -= D[:, j]
    return members[in_spl], members[~in_spl]


def divisive_levels(W: np.ndarray, max_p: int):
    """Clusterings with p = 1, 2, ... clusters (each of >= 2 devices), one split a level."""
    clusters = [np.arange(len(W))]
    yield [c.copy() for c in clusters]
    while len(clusters) < max_p:
        cand = [(float(W[np.ix_(c, c)].max()), len(c), -i) for i, c in enumerate(clusters) if len(c) >= 4]
        if not cand:
            return
        i = -max(cand)[2]
        a, b = diana_split(W, clusters[i])
        clusters[i : i + 1] = [np.sort(a), np.sort(b)]
        yield [c.copy() for c in clusters]


def coarse_graph(W: np.ndarray, clusters) -> np.ndarray:
    p = len(clusters)
    H = np.zeros((p, p))
    for x in range(p):
        for y in range(x + 1, p):
            H[x, y] = H[y, x] = float(W[np.ix_(clusters[x], clusters[y])].mean())
    return H


def eq2_time(eng: Engine, H: np.ndarray, path) -> float:
    """Equation 2 with equation 3: d * max_k (edge to the next stage + D |H| / (d p sum C_s))."""
    p = len(path)
    dt = eng.model.batch_tokens * eng.model.flops_per_token_per_layer * eng.L / (eng.d * p * float(eng.cr.sum()))
    link = max((H[path[i], path[i + 1]] for i in range(p - 1)), default=0.0)
    return eng.d * (dt + link)


def assign_roles(eng: Engine, ordered) -> tuple:
    """FS/BS lists per stage by the side with the smaller mean one-way time (FS: from the
    previous stage's devices; BS: to the next's); ties go to FS."""
    T = eng.delay_rr + eng.ma * eng.inv_rr  # one-way time of t bytes, i -> j
    fs_all, bs_all = [], []
    for k, c in enumerate(ordered):
        f_score = T[np.ix_(ordered[k - 1], c)].mean(axis=0) if k > 0 else np.full(len(c), math.inf)
        b_score = T[np.ix_(c, ordered[k + 1])].mean(axis=1) if k + 1 < len(ordered) else np.full(len(c), math.inf)
        to_f = f_score <= b_score
        for side, other, score in ((to_f, ~to_f, b_score), (~to_f, to_f, f_score)):
            if not side.any():  # this side is empty: it takes the slowest device of the other
                idx = np.flatnonzero(other)
                order = np.lexsort((-idx, -np.nan_to_num(score[idx], posinf=0.0), eng.cr[c[idx]]))
                side[idx[order[0]]] = True
                other[idx[order[0]]] = False
        fs_all.append([int(x) for x in c[to_f]])
        bs_all.append([int(x) for x in c[~to_f]])
    return fs_all, bs_all


def volunteer_scores(eng: Engine, server_groups, nbytes: float) -> np.ndarray:
    """U x K mean a + t/b from each volunteer to each group of reliable devices."""
    if eng.U == 0:
        return np.zeros((0, len(server_groups)))
    M = eng.cluster.delay_ur + nbytes / eng.cluster.bw_ur
    onehot = np.zeros((eng.R, len(server_groups)))
    for k, g in enumerate(server_groups):
        onehot[np.asarray(g, dtype=np.intp), k] = 1.0 / len(g)
    return M @ onehot


def assign_volunteers(eng: Engine, server_groups) -> list:
    us = [[] for _ in server_groups]
    if eng.U:
        best = np.argmin(volunteer_scores(eng, server_groups, eng.ma), axis=1)
        for u, k in enumerate(best):
            us[int(k)].append(u)
    return us


def layers_by_compute(eng: Engine, lay: Layout) -> np.ndarray:
    """Layers in proportion to each stage's compute, at least one each, largest remainder first
    (memory caps respected where they can be)."""
    K, L = lay.K, eng.L
    sig = np.array([eng.cr[f + b].sum() + eng.cu[u].sum() for f, b, u in zip(lay.fs, lay.bs, lay.us)])
    caps = np.array([eng.stage_terms(*lay.stage(k)).cap for k in range(K)])
    caps = np.maximum(caps, 1)
    share = 1 + (L - K) * sig / sig.sum()
    n = np.minimum(np.floor(share).astype(int), caps)
    left = L - int(n.sum())
    rem = share - np.floor(share)
    while left > 0:
        room = n < caps
        if not room.any():
            room = np.ones(K, dtype=bool)  # does not fit anyway: the plan will be infeasible
        k = int(np.argmax(np.where(room, rem + (share - n), -np.inf)))
        n[k] += 1
        rem[k] = -1.0
        left -= 1
    return n


def layout_for(eng: Engine, W: np.ndarray, clusters, rng, iterations=None, restarts=2) -> Layout:
    H = coarse_graph(W, clusters)
    path = anneal_open_path(H, rng, iterations, restarts)
    ordered = [clusters[i] for i in path]
    fs, bs = assign_roles(eng, ordered)
    return Layout(fs, bs, assign_volunteers(eng, [f + b for f, b in zip(fs, bs)]))


def paper_plan(eng: Engine, rng: np.random.Generator, deadline: float | None = None, all_levels: bool = False):
    """The paper's layout and layer split; with all_levels, also the layout of every level of
    the hierarchy (starting points for refined). Returns (layout, layers, levels)."""
    import time

    W = edge_weights(eng)
    max_p = max(1, min(eng.L, eng.R // 2))
    levels, prev_t, chosen = [], math.inf, None
    for clusters in divisive_levels(W, max_p):
        p = len(clusters)
        H = coarse_graph(W, clusters)
        path = anneal_open_path(H, rng, iterations=min(8000, 200 + 30 * p * p), restarts=1)
        t = eq2_time(eng, H, path)
        if chosen is None and t > prev_t:
            chosen = levels[-1][0]
            if not all_levels:
                break
        levels.append((clusters, path))
        prev_t = t
        if deadline is not None and time.monotonic() > deadline:
            break
    if chosen is None:
        chosen = levels[-1][0]
    lay = layout_for(eng, W, chosen, rng)
    extra = []
    if all_levels:
        for clusters, path in levels:
            ordered = [clusters[i] for i in path]
            fs, bs = assign_roles(eng, ordered)
            extra.append(Layout(fs, bs, assign_volunteers(eng, [f + b for f, b in zip(fs, bs)])))
    return lay, layers_by_compute(eng, lay), extra
