"""Layouts by device index, their conversion to plans, and the incremental evaluator the
searches share: per-stage terms and links are cached, a move rescores only the stages and
boundaries it touches, and the layer split is re-solved from the cached rows."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from scheduler.cost import Engine, segmentation
from scheduler.files import Plan, Stage


@dataclass
class Layout:
    """Stages in pipeline order; fs/bs hold reliable indices (ordered: the order is the
    segmentation order), us unreliable indices. Unreliable devices in no stage are idle."""

    fs: list
    bs: list
    us: list

    @property
    def K(self) -> int:
        return len(self.fs)

    def copy(self) -> "Layout":
        return Layout([list(x) for x in self.fs], [list(x) for x in self.bs], [list(x) for x in self.us])

    def stage(self, k: int) -> tuple:
        return (self.fs[k], self.bs[k], self.us[k])


def layout_to_plan(eng: Engine, lay: Layout, n, predicted: float | None = None) -> Plan:
    c = eng.cluster
    stages, end = [], 0
    placed = set()
    for k in range(lay.K):
        nk = int(n[k]) if n is not None else (eng.L // lay.K + (1 if k < eng.L % lay.K else 0))
        stages.append(
            Stage(
                [c.reliable_ids[i] for i in lay.fs[k]],
                [c.reliable_ids[i] for i in lay.bs[k]],
                [c.unreliable_ids[u] for u in sorted(lay.us[k])],
                (end, end + nk),
            )
        )
        end += nk
        placed.update(lay.us[k])
    idle = [c.unreliable_ids[u] for u in range(eng.U) if u not in placed]
    return Plan(stages, idle, predicted)


def plan_to_layout(cluster, plan: Plan) -> Layout:
    return Layout(
        [[cluster.index(d) for d in s.frontal] for s in plan.stages],
        [[cluster.index(d) for d in s.backward] for s in plan.stages],
        [[cluster.index(d) for d in s.clients] for s in plan.stages],
    )


ORDER_ENUM_LIMIT = 720  # p! * q! up to which a boundary's server orders are all tried


@lru_cache(maxsize=16)
def _perms(p: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(p))), dtype=np.intp)


def best_link(eng: Engine, bs, fs, enum_limit: int = ORDER_ENUM_LIMIT):
    """(link, bs order, fs order): the orders of BS_k and FS_{k+1} only matter to link_k, so
    each boundary's orders are chosen on their own; all orders are tried where p! q! is at
    most enum_limit, otherwise the given orders are kept (see polish_link)."""
    p, q = len(bs), len(fs)
    base = eng.link(bs, fs)
    if p == 1 or q == 1 or math.factorial(p) * math.factorial(q) > enum_limit:
        return base, list(bs), list(fs)
    i, j, frac = segmentation(p, q)
    B = np.asarray(bs, dtype=np.intp)[_perms(p)[:, i]][:, None, :]
    F = np.asarray(fs, dtype=np.intp)[_perms(q)[:, j]][None, :, :]
    n = frac * eng.ma
    tot = (eng.delay_rr[B, F] + n * eng.inv_rr[B, F]).max(axis=-1) + (eng.delay_rr[F, B] + n * eng.inv_rr[F, B]).max(
        axis=-1
    )
    a, b = np.unravel_index(int(np.argmin(tot)), tot.shape)
    if not tot[a, b] < base:
        return base, list(bs), list(fs)
    bs2 = [bs[x] for x in _perms(p)[a]]
    fs2 = [fs[x] for x in _perms(q)[b]]
    return eng.link(bs2, fs2), bs2, fs2


def polish_link(eng: Engine, bs, fs, max_steps: int = 200, deadline: float | None = None):
    """For boundaries too large to enumerate: repeatedly swap the sender or the receiver of the
    slowest pair (forward or backward) with whichever server of its side lowers link_k most,
    all candidate swaps scored at once; stops when no swap helps."""
    import time

    bs, fs = np.array(bs, dtype=np.intp), np.array(fs, dtype=np.intp)
    p, q = len(bs), len(fs)
    i, j, frac = segmentation(p, q)
    n = frac * eng.ma
    D, inv = eng.delay_rr, eng.inv_rr

    def score(Bi, Fj):  # rows of sender and receiver ids per pair -> link per row
        return (D[Bi, Fj] + n * inv[Bi, Fj]).max(axis=-1) + (D[Fj, Bi] + n * inv[Fj, Bi]).max(axis=-1)

    cur = float(score(bs[i], fs[j]))
    for step in range(max_steps):
        if deadline is not None and time.monotonic() > deadline:
            break
        fw = D[bs[i], fs[j]] + n * inv[bs[i], fs[j]]
        bw = D[fs[j], bs[i]] + n * inv[fs[j], bs[i]]
        a = int(np.argmax(fw)) if step % 2 == 0 else int(np.argmax(bw))
        best = (cur, None, None)
        for side, lst, pos in ((0, bs, i[a]), (1, fs, j[a])):
            m = len(lst)
            if m < 2:
                continue
            V = np.tile(lst, (m, 1))
            V[np.arange(m), pos] = lst
            V[np.arange(m), np.arange(m)] = lst[pos]
            tot = score(V[:, i], fs[j][None, :]) if side == 0 else score(bs[i][None, :], V[:, j])
            x = int(np.argmin(tot))
            if tot[x] < best[0] * (1 - 1e-12):
                best = (float(tot[x]), side, V[x].copy())
        if best[1] is None:
            if step % 2 == 0:
                continue
            break
        cur = best[0]
        if best[1] == 0:
            bs = best[2]
        else:
            fs = best[2]
    return float(eng.link(bs, fs)), [int(x) for x in bs], [int(x) for x in fs]


class Candidate:
    """A proposed layout with its cached parts, ready to become the state."""

    __slots__ = ("lay", "terms", "links", "rows", "pt", "n", "sec")

    def better_than(self, pt: float, sec: float) -> bool:
        if self.pt < pt * (1 - 1e-12):
            return True
        return self.pt <= pt * (1 + 1e-12) and self.sec < sec * (1 - 1e-12)


class State:
    """A layout with per-stage terms, per-boundary links and rows h_k(n) cached.

    propose(stages) takes the new stage list, where an int means "old stage i unchanged" and a
    tuple (fs, bs, us) a changed stage; only changed stages and the boundaries next to them are
    rescored. The objective is (PT, sum of the stages' h_k(n_k) and of their workers' mean
    AG): the second term breaks the plateaus of a max, so that relieving one of several
    bottlenecks, or a worker below the bottleneck, counts."""

    def __init__(self, eng: Engine, lay: Layout, enum_limit: int = ORDER_ENUM_LIMIT):
        self.eng, self.enum_limit = eng, enum_limit
        self.proposals = 0
        self._tcache: dict = {}
        self._tcache_size = 0
        c = self.propose(list(range(lay.K)), _fresh=lay)
        self.commit(c)

    def _terms(self, f, b, u):
        """Stage terms, memoized by the stage's device sets: searches come back to the same
        stages often (a rejected move is proposed again, a kick is undone)."""
        key = (tuple(sorted(f)), tuple(sorted(b)), tuple(sorted(u)))
        t = self._tcache.get(key)
        if t is None:
            size = len(key[0]) + len(key[1]) + 2 * len(key[2]) + 8
            if self._tcache_size + size > 2_000_000:  # a bound on memory: about 100 MB of arrays
                self._tcache.clear()
                self._tcache_size = 0
            t = self._tcache[key] = self.eng.stage_terms(f, b, u)
            self._tcache_size += size
        return t

    def _link(self, bs, fs):
        return best_link(self.eng, bs, fs, self.enum_limit)

    def propose(self, stages: list, _fresh: Layout | None = None) -> Candidate:
        eng = self.eng
        self.proposals += 1
        K = len(stages)
        old = None if _fresh is not None else self
        fs, bs, us, terms, rows = [], [], [], [], []
        for k, st in enumerate(stages):
            if old is not None and isinstance(st, int):
                fs.append(old.lay.fs[st])
                bs.append(old.lay.bs[st])
                us.append(old.lay.us[st])
                terms.append(old.terms[st])
            else:
                f, b, u = _fresh.stage(st) if _fresh is not None else st
                fs.append(list(f))
                bs.append(list(b))
                us.append(list(u))
                terms.append(self._terms(f, b, u))
        links = []
        for k in range(K):
            st = stages[k]
            if k + 1 == K:
                links.append(0.0)
                continue
            nxt = stages[k + 1]
            if old is not None and isinstance(st, int) and isinstance(nxt, int) and nxt == st + 1:
                links.append(old.links[st])
            else:
                v, bs[k], fs[k + 1] = self._link(bs[k], fs[k + 1])
                links.append(v)
        same_k = old is not None and K == old.lay.K
        for k in range(K):
            st = stages[k]
            if same_k and isinstance(st, int) and links[k] == old.links[st]:
                rows.append(old.rows[st])
            else:
                rows.append(eng.row(terms[k], links[k], K))
        c = Candidate()
        c.lay = Layout(fs, bs, us)
        c.terms, c.links = terms, links
        c.rows = np.stack(rows)
        c.pt, c.n = eng.split(c.rows)
        if c.n is None:
            c.sec = math.inf
        else:  # the stages' times, plus their workers' mean aggregation: progress below the max counts
            c.sec = float(c.rows[np.arange(K), c.n - 1].sum()) + sum(
                t.ag_mean[0] + t.ag_mean[1] * int(n) for t, n in zip(terms, c.n)
            )
        return c

    def commit(self, c: Candidate) -> None:
        self.cand = c
        self.lay, self.terms, self.links, self.rows = c.lay, c.terms, c.links, c.rows
        self.pt, self.n, self.sec = c.pt, c.n, c.sec
        eng = self.eng
        self.r_stage = np.empty(eng.R, dtype=np.intp)
        self.r_role = np.empty(eng.R, dtype=np.intp)
        self.u_stage = np.full(eng.U, -1, dtype=np.intp)
        for k in range(self.lay.K):
            self.r_stage[self.lay.fs[k]] = k
            self.r_role[self.lay.fs[k]] = 0
            self.r_stage[self.lay.bs[k]] = k
            self.r_role[self.lay.bs[k]] = 1
            if self.lay.us[k]:
                self.u_stage[self.lay.us[k]] = k

    def bottleneck(self) -> int:
        """The stage whose h_k(n_k) is PT (the first of them)."""
        if self.n is None:
            return int(np.argmax(self.rows[:, 0]))
        return int(np.argmax(self.rows[np.arange(self.lay.K), self.n - 1]))

    def plan(self) -> Plan:
        return layout_to_plan(self.eng, self.lay, self.n, self.pt)


def evaluate(eng: Engine, lay: Layout, enum_limit: int = ORDER_ENUM_LIMIT):
    """(PT, layers per stage, layout with its best boundary orders) of a layout."""
    s = State(eng, lay, enum_limit)
    return s.pt, s.n, s.lay
