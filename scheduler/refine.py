"""`refined`: the paper's plan and other starts, improved under the exact cost by local moves.

Moves (each keeps the plan valid): move a reliable device to another stage and/or role, swap
two reliable devices, move a volunteer to another stage or idle it, swap two volunteers, swap
two stages or move one elsewhere in the order, merge two neighbouring stages, split one.
Every move is scored by State.propose, which rescores only the stages and boundaries it
touches and re-solves the layer split exactly. Half of the moves focus on the bottleneck
stage (moving its worst worker out, splitting it, bringing compute in). Each search is
first-improvement on (PT, sum of the stages' times and their workers' mean aggregation), with
random kicks from the best layout when it stalls. Three quarters of the budget go to short
searches from many starts (the paper's plan, the levels of its hierarchy, random balanced
partitions over a spread of K; without and with volunteers), the rest to a longer search from
the best layout found. Deterministic for a seed and a budget, with the time limit only as a
safety cap.
"""

from __future__ import annotations

import math
import time

import numpy as np

from scheduler.cost import Engine
from scheduler.paper import assign_roles, assign_volunteers, diana_split, edge_weights, paper_plan, volunteer_scores
from scheduler.state import ORDER_ENUM_LIMIT, Layout, State, polish_link

# ---- moves: each returns the stage list for State.propose, or None where not valid ----


def _without(lst, x):
    return [y for y in lst if y != x]


def move_reliable(st: State, i: int, k2: int, role2: int):
    lay, k, role = st.lay, int(st.r_stage[i]), int(st.r_role[i])
    if (k, role) == (k2, role2) or len(lay.fs[k] if role == 0 else lay.bs[k]) < 2:
        return None
    stages = list(range(lay.K))
    f, b = _without(lay.fs[k], i), _without(lay.bs[k], i)
    if k == k2:
        stages[k] = (f + [i], b, lay.us[k]) if role2 == 0 else (f, b + [i], lay.us[k])
    else:
        stages[k] = (f, b, lay.us[k])
        f2, b2 = lay.fs[k2], lay.bs[k2]
        stages[k2] = (f2 + [i], b2, lay.us[k2]) if role2 == 0 else (f2, b2 + [i], lay.us[k2])
    return stages


def swap_reliable(st: State, i: int, j: int):
    lay = st.lay
    ki, kj = int(st.r_stage[i]), int(st.r_stage[j])
    if ki == kj and st.r_role[i] == st.r_role[j]:
        return None
    sub = {i: j, j: i}
    stages = list(range(lay.K))
    for k in {ki, kj}:
        stages[k] = ([sub.get(x, x) for x in lay.fs[k]], [sub.get(x, x) for x in lay.bs[k]], lay.us[k])
    return stages


def move_volunteer(st: State, u: int, k2: int):
    lay, k = st.lay, int(st.u_stage[u])
    if k == k2:
        return None
    stages = list(range(lay.K))
    if k >= 0:
        stages[k] = (lay.fs[k], lay.bs[k], _without(lay.us[k], u))
    if k2 >= 0:
        stages[k2] = (lay.fs[k2], lay.bs[k2], lay.us[k2] + [u])
    return stages


def swap_volunteers(st: State, u: int, v: int):
    lay, ku, kv = st.lay, int(st.u_stage[u]), int(st.u_stage[v])
    if ku == kv:
        return None
    stages = list(range(lay.K))
    for k, out, into in ((ku, u, v), (kv, v, u)):
        if k >= 0:
            stages[k] = (lay.fs[k], lay.bs[k], _without(lay.us[k], out) + [into])
    return stages


def swap_stages(st: State, a: int, b: int):
    if a == b:
        return None
    stages = list(range(st.lay.K))
    stages[a], stages[b] = b, a
    return stages


def move_stage(st: State, a: int, b: int):
    if a == b:
        return None
    stages = list(range(st.lay.K))
    stages.insert(b, stages.pop(a))
    return stages


def merge_stages(st: State, k: int):
    lay = st.lay
    if k < 0 or k + 1 >= lay.K:
        return None
    merged = (lay.fs[k] + lay.fs[k + 1], lay.bs[k] + lay.bs[k + 1], lay.us[k] + lay.us[k + 1])
    return list(range(k)) + [merged] + list(range(k + 2, lay.K))


def split_stage(st: State, k: int, rng: np.random.Generator):
    """Stage k becomes two neighbouring stages, each server keeping its role where it can: half
    the time split along the communication graph (DIANA, as the paper's clustering), half the
    time at random. Its clients go to the nearer half."""
    lay, eng = st.lay, st.eng
    role = {x: 0 for x in lay.fs[k]}
    role.update({x: 1 for x in lay.bs[k]})
    if len(role) < 4 or lay.K + 1 > eng.L:
        return None
    members = np.array(list(role), dtype=np.intp)
    if rng.random() < 0.5:
        W = eng.__dict__.get("_edge_weights")
        if W is None:
            W = eng.__dict__["_edge_weights"] = edge_weights(eng)
        halves = list(diana_split(W, members))
        if rng.random() < 0.5:
            halves.reverse()
    else:
        perm = rng.permutation(members)
        cut = int(rng.integers(2, len(members) - 1))
        halves = [np.sort(perm[:cut]), np.sort(perm[cut:])]
    parts = []
    for half in halves:
        grp = [(int(x), role[int(x)]) for x in half]
        roles = [r for _, r in grp]
        if 0 not in roles:
            grp[0] = (grp[0][0], 0)
        elif 1 not in roles:
            grp[-1] = (grp[-1][0], 1)
        parts.append(([x for x, r in grp if r == 0], [x for x, r in grp if r == 1]))
    us_a, us_b = [], []
    if lay.us[k]:
        sc = volunteer_scores(eng, [p[0] + p[1] for p in parts], eng.ma)[np.asarray(lay.us[k])]
        for u, s in zip(lay.us[k], sc):
            (us_a if s[0] <= s[1] else us_b).append(u)
    new = [(parts[0][0], parts[0][1], us_a), (parts[1][0], parts[1][1], us_b)]
    return list(range(k)) + new + list(range(k + 1, lay.K))


def prune_volunteers(st: State, k: int, rng: np.random.Generator):
    """Idle the j clients of stage k that cost it most (their comm or their aggregation at the
    stage's current layers), j at random: a bulk move that crosses the plateaus where idling
    one of many equally slow volunteers changes nothing."""
    lay, t = st.lay, st.terms[k]
    if not lay.us[k]:
        return None
    n = int(st.n[k]) if st.n is not None else 1
    fac = st.eng.d + lay.K - 1
    bad = np.maximum(fac * t.u_comm, t.u_ag[0] + t.u_ag[1] * n)
    order = np.argsort(-bad, kind="stable")
    j = int(rng.integers(1, len(order) + 1))
    drop = set(int(x) for x in np.asarray(lay.us[k])[order[:j]])
    stages = list(range(lay.K))
    stages[k] = (lay.fs[k], lay.bs[k], [u for u in lay.us[k] if u not in drop])
    return stages


# ---- choosing a move ----


def _random_move(st: State, rng: np.random.Generator):
    eng, lay = st.eng, st.lay
    K, R, U = lay.K, eng.R, eng.U
    x = rng.random()
    if x < 0.26:
        return move_reliable(st, int(rng.integers(R)), int(rng.integers(K)), int(rng.integers(2)))
    if x < 0.44:
        return swap_reliable(st, int(rng.integers(R)), int(rng.integers(R)))
    if x < 0.70:
        if U == 0:
            return None
        return move_volunteer(st, int(rng.integers(U)), int(rng.integers(-1, K)))
    if x < 0.80:
        if U < 2:
            return None
        return swap_volunteers(st, int(rng.integers(U)), int(rng.integers(U)))
    if x < 0.88:
        return swap_stages(st, int(rng.integers(K)), int(rng.integers(K)))
    if x < 0.92:
        return move_stage(st, int(rng.integers(K)), int(rng.integers(K)))
    if x < 0.96:
        return merge_stages(st, int(rng.integers(K)))
    return split_stage(st, int(rng.integers(K)), rng)


def _focused_move(st: State, rng: np.random.Generator):
    """A move that touches the bottleneck stage: its worst worker out, or compute in."""
    eng, lay = st.eng, st.lay
    K, U = lay.K, eng.U
    k = st.bottleneck()
    t = st.terms[k]
    x = rng.random()
    if x < 0.12:
        return prune_volunteers(st, k, rng)
    if x < 0.16:
        return split_stage(st, k, rng) if rng.random() < 0.7 else merge_stages(st, k - int(rng.integers(2)))
    if x < 0.4:  # the worker with the worst communication or aggregation leaves or swaps
        kind, i = t.comm_worst if rng.random() < 0.5 else t.ag_worst
        y = rng.random()
        if kind == "u":
            if y < 0.6:
                return move_volunteer(st, i, int(rng.integers(-1, K)))
            return swap_volunteers(st, i, int(rng.integers(U)))
        if y < 0.3:  # to the stage whose servers are nearest on average
            near = [float(eng.rt_d[i, lay.fs[q] + lay.bs[q]].mean()) if q != k else math.inf for q in range(K)]
            return move_reliable(st, i, int(np.argmin(near)), int(rng.integers(2))) if K > 1 else None
        if y < 0.6:
            return move_reliable(st, i, int(rng.integers(K)), int(rng.integers(2)))
        return swap_reliable(st, i, int(rng.integers(eng.R)))
    if x < 0.75 and U:  # a volunteer joins the bottleneck (an idle one first)
        idle = np.flatnonzero(st.u_stage < 0)
        if len(idle) and rng.random() < 0.6:
            return move_volunteer(st, int(idle[rng.integers(len(idle))]), k)
        return move_volunteer(st, int(rng.integers(U)), k)
    if x < 0.9:  # a reliable device joins it
        return move_reliable(st, int(rng.integers(eng.R)), k, int(rng.integers(2)))
    members = lay.fs[k] + lay.bs[k]
    return swap_reliable(st, members[int(rng.integers(len(members)))], int(rng.integers(eng.R)))


def propose_move(st: State, rng: np.random.Generator):
    return _focused_move(st, rng) if rng.random() < 0.5 else _random_move(st, rng)


def local_search(
    st: State, rng: np.random.Generator, proposals: int, patience: int, kicks: int, deadline: float
) -> State:
    """First-improvement search from st's layout; returns the state at the best layout seen."""
    best = st.cand
    fails = 0
    for it in range(proposals):
        if it % 32 == 0 and time.monotonic() > deadline:
            break
        stages = propose_move(st, rng)
        if stages is None:
            fails += 1
        else:
            c = st.propose(stages)
            if c.better_than(st.pt, st.sec):
                st.commit(c)
                fails = 0
                if c.better_than(best.pt, best.sec):
                    best = c
            else:
                fails += 1
        if fails >= patience:
            if kicks <= 0:
                break
            kicks -= 1
            fails = 0
            st.commit(best)
            done = 0
            for _ in range(20):  # a kick: a few random moves, taken whatever they cost
                stages = _random_move(st, rng)
                if stages is not None:
                    c = st.propose(stages)
                    if math.isfinite(c.pt):
                        st.commit(c)
                        done += 1
                if done == 3:
                    break
    st.commit(best)
    return st


def polish_orders(st: State, deadline: float | None = None) -> State:
    """Swap servers inside the boundaries too large to enumerate, where that lowers a link."""
    eng, lay = st.eng, st.lay
    for k in range(lay.K - 1):
        p, q = len(lay.bs[k]), len(lay.fs[k + 1])
        if p > 1 and q > 1 and math.factorial(min(p, 8)) * math.factorial(min(q, 8)) > ORDER_ENUM_LIMIT:
            v, b, f = polish_link(eng, lay.bs[k], lay.fs[k + 1], deadline=deadline)
            if v < st.links[k]:
                stages = list(range(lay.K))
                stages[k] = (lay.fs[k], b, lay.us[k])
                stages[k + 1] = (f, lay.bs[k + 1], lay.us[k + 1])
                c = st.propose(stages)
                if c.better_than(st.pt, st.sec) or c.pt <= st.pt:
                    st.commit(c)
    return st


def random_layout(eng: Engine, rng: np.random.Generator, K: int | None = None, idle_p: float | None = None) -> Layout:
    """A random valid layout: K stages, each with a frontal and a backward server, the other
    reliable devices anywhere, each volunteer in a random stage or idle."""
    kmax = max(1, min(eng.L, eng.R // 2))
    K = int(rng.integers(1, kmax + 1)) if K is None else K
    perm = rng.permutation(eng.R)
    fs = [[int(perm[2 * k])] for k in range(K)]
    bs = [[int(perm[2 * k + 1])] for k in range(K)]
    for i in perm[2 * K :]:
        k = int(rng.integers(K))
        (fs if rng.random() < 0.5 else bs)[k].append(int(i))
    us = [[] for _ in range(K)]
    p_idle = 1.0 / (K + 1) if idle_p is None else idle_p
    for u in range(eng.U):
        if rng.random() >= p_idle:
            us[int(rng.integers(K))].append(u)
    return Layout(fs, bs, us)


def budget(eng: Engine, time_limit: float) -> int:
    """Proposals for a time budget: a fixed count per second of budget (so the same budget
    gives the same plan), calibrated to finish well inside it."""
    return int(max(3000, 600 * time_limit))


def _starts(eng: Engine, rng: np.random.Generator, base: Layout, levels: list):
    """Starting layouts, lazily, in the order they are searched: the paper's plan (first without
    its volunteers, then with them), then by turns
    a level of the paper's hierarchy and a random balanced partition (over a spread of K), each
    first without volunteers and later with the paper's volunteers. The searches from different
    starts end far apart (the landscape has many local optima), so many short searches beat a
    few long ones."""
    kmax = max(1, min(eng.L, eng.R // 2))
    ks = sorted({int(round(x)) for x in np.geomspace(1, kmax, min(kmax, 8))})

    def balanced(K):
        g = np.arange(eng.R) % K
        rng.shuffle(g)
        fs, bs = assign_roles(eng, [np.flatnonzero(g == q) for q in range(K)])
        return Layout(fs, bs, assign_volunteers(eng, [f + b for f, b in zip(fs, bs)]))

    def idle(lay):
        return Layout(lay.fs, lay.bs, [[] for _ in lay.us])

    if eng.U:  # without volunteers first: under the aggregation term that is often far better
        yield idle(base)
    yield base
    with_volunteers = []
    i = 0
    while True:
        lay = levels[i] if i < len(levels) else None
        rnd = balanced(ks[i % len(ks)])
        for x in (lay, rnd):
            if x is not None:
                if eng.U:
                    with_volunteers.append(x)
                    yield idle(x)
                else:
                    yield x
        if i >= len(levels) and with_volunteers and i % 2:
            yield with_volunteers.pop(0)
        i += 1


def refined(eng: Engine, rng: np.random.Generator, time_limit: float, t0: float | None = None) -> State:
    t0 = time.monotonic() if t0 is None else t0
    deadline = t0 + 0.92 * time_limit
    total = budget(eng, time_limit)
    base, _, levels = paper_plan(eng, rng, deadline=t0 + 0.5 * time_limit, all_levels=True)
    # phase 1: short searches from many starts, three quarters of the budget
    patience = int(min(1000, 150 + (eng.R + eng.U) // 2))
    per_start = max(4 * patience, 1500)
    left = int(0.75 * total)
    best = None
    must = 2 if eng.U else 1  # the paper's plan is always searched: refined is never worse than paper
    for n_started, lay in enumerate(_starts(eng, rng, base, levels)):
        if n_started >= must and (left <= 0 or time.monotonic() > deadline):
            break
        s = State(eng, lay)
        before = s.proposals
        local_search(s, rng, min(per_start, left), patience, kicks=1, deadline=deadline)
        left -= max(1, s.proposals - before)
        if best is None or s.cand.better_than(best.pt, best.sec):
            best = s
    # phase 2: the best layout searched on with kicks, the rest of the budget
    best.commit(best.cand)
    local_search(best, rng, max(0, total - int(0.75 * total) + max(left, 0)), 2 * patience, kicks=8, deadline=deadline)
    return polish_orders(best, t0 + 0.97 * time_limit)
