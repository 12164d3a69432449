"""`exact`: every plan of a small cluster (up to 6 reliable and 4 unreliable devices).

Enumerated: the number of stages K, every assignment of the reliable devices to (stage, role)
with each role of each stage non-empty, and every placement of the volunteers (a stage or
idle). Not enumerated, because they are solved exactly on their own: the layer split (the
min-max split of cost.Engine.split) and the server orders inside a boundary (they change only
that boundary's link, so state.best_link tries them all per boundary). The placements of the
volunteers are scored in one batch per reliable assignment, from per-stage rows cached by
(frontal set, backward set, volunteer subset).
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from scheduler.cost import Engine
from scheduler.files import PlanInputError
from scheduler.state import Layout, State, best_link

MAX_RELIABLE, MAX_UNRELIABLE = 6, 4


def check_size(eng: Engine) -> None:
    if eng.R > MAX_RELIABLE or eng.U > MAX_UNRELIABLE:
        raise PlanInputError(
            f"algorithm exact: the cluster has {eng.R} reliable and {eng.U} unreliable devices; exhaustive "
            f"search is limited to {MAX_RELIABLE} reliable and {MAX_UNRELIABLE} unreliable devices "
            "(use --algorithm refined)"
        )


def _batched_split(H: np.ndarray) -> np.ndarray:
    """PT of each of a batch of split problems H (A x K x L); see Engine.split."""
    A, K, L = H.shape
    first = H[:, :, 0].max(axis=1)
    r = L - K
    if r == 0:
        return first
    rest = H[:, :, 1:].reshape(A, -1)
    return np.maximum(first, np.partition(rest, r - 1, axis=1)[:, r - 1])


def exact(eng: Engine, deadline: float) -> State:
    check_size(eng)
    R, U, L = eng.R, eng.U, eng.L
    n_masks = 1 << U
    subsets = [[u for u in range(U) if m >> u & 1] for m in range(n_masks)]
    stage_cache: dict = {}
    link_cache: dict = {}

    def stage_arrays(fs, bs):
        key = (fs, bs)
        v = stage_cache.get(key)
        if v is None:
            ts = [eng.stage_terms(list(fs), list(bs), us) for us in subsets]
            comm = np.array([t.comm for t in ts])[:, None]
            per = np.array([t.per_layer for t in ts])[:, None]
            ag = np.stack([t.ag_row for t in ts])
            over = np.stack([eng.nvec > t.cap for t in ts])
            v = stage_cache[key] = (comm, per, ag, over)
        return v

    def link(bs, fs):
        key = (bs, fs)
        v = link_cache.get(key)
        if v is None:
            v = link_cache[key] = best_link(eng, list(bs), list(fs), enum_limit=10**9)
        return v

    best = (math.inf, None)
    for K in range(1, max(1, min(L, R // 2)) + 1):
        fac = eng.d + K - 1
        combos = list(itertools.product(range(K + 1), repeat=U))
        place = np.array(combos, dtype=np.intp).reshape(len(combos), U)
        masks = np.stack([((place == k) * (1 << np.arange(U))).sum(axis=1) for k in range(K)], axis=1)
        for slots in itertools.product(range(2 * K), repeat=R):
            if len(set(slots)) < 2 * K:
                continue
            fs = [tuple(i for i in range(R) if slots[i] == 2 * k) for k in range(K)]
            bs = [tuple(i for i in range(R) if slots[i] == 2 * k + 1) for k in range(K)]
            links = [link(bs[k], fs[k + 1])[0] for k in range(K - 1)] + [0.0]
            tables = []
            for k in range(K):
                comm, per, ag, over = stage_arrays(fs[k], bs[k])
                rows = np.maximum(fac * (comm + links[k] + per * eng.nvec), ag)
                rows[over] = math.inf
                tables.append(rows)
            H = np.stack([tables[k][masks[:, k]] for k in range(K)], axis=1)
            pts = _batched_split(H)
            a = int(np.argmin(pts))
            if pts[a] < best[0] * (1 - 1e-12):
                us = [[u for u in range(U) if place[a, u] == k] for k in range(K)]
                best = (float(pts[a]), (fs, bs, us))
            if time.monotonic() > deadline:
                raise PlanInputError(
                    f"algorithm exact: the search did not finish within the time limit "
                    f"(it stopped at {K} stages); give it more time with --time-limit"
                )
    if best[1] is None:  # nothing fits: return any plan, infeasible
        best = (math.inf, ([tuple(range(0, R, 2))], [tuple(range(1, R, 2))], [[]]))
    fs, bs, us = best[1]
    fs, bs = [list(x) for x in fs], [list(x) for x in bs]
    for k in range(len(fs) - 1):
        _, bs[k], fs[k + 1] = link(tuple(bs[k]), tuple(fs[k + 1]))
    return State(eng, Layout([list(x) for x in fs], [list(x) for x in bs], us), enum_limit=0)
