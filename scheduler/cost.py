"""The cost of a plan (docs/cost-model.md, "Cost of a plan"), vectorized with numpy.

`plan_cost` is the one scoring function. The planners use the same pieces through `Engine`:
per-stage terms (`stage_terms`), the link between two stages (`link`), and the exact layer split
(`split`), so that a planner's prediction and `plan_cost` agree to the last bit.

For a stage with fixed devices, every term that depends on its number of layers n grows
linearly in n: tau_k(n) = A_k + B_k n with A_k = max comm + link_k and B_k = m F / Sigma_k, and
AG_w(n) = alpha_w + gamma_w n. A stage's share of PT is therefore h_k(n) =
max((d + K - 1) tau_k(n), max_w AG_w(n)), non-decreasing in n, and the best split is the
min-max split computed in `split`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from scheduler.files import Cluster, ModelSpec, Plan


@dataclass
class CostBreakdown:
    total: float  # PT, seconds per batch; inf if the plan is infeasible or invalid
    pipe: float = math.inf  # (d + K - 1) * max tau_k
    stage_tau: list = field(default_factory=list)
    stage_dt: list = field(default_factory=list)
    stage_link: list = field(default_factory=list)
    stage_comp: list = field(default_factory=list)
    stage_comm: list = field(default_factory=list)  # max_w comm_w per stage
    stage_ag: list = field(default_factory=list)  # max_w AG_w per stage
    aggregation: float = math.inf  # max over stages of stage_ag
    reason: str | None = None  # why the plan is invalid or infeasible

    @property
    def valid(self) -> bool:
        return self.reason is None


@dataclass
class StageTerms:
    """What one stage's devices cost, independent of its number of layers and of K."""

    comm: float  # max_w comm_w
    comm_worst: tuple  # ("r"|"u", index) of the worker with that comm
    per_layer: float  # B = m F / Sigma: compute seconds per layer
    ag_row: np.ndarray  # max_w AG_w(n) for n = 1..L
    ag_worst: tuple  # worker with the largest AG at n = 1
    cap: int  # most layers the stage's smallest memory holds (<= L)
    cap_worst: tuple | None
    sigma: float
    u_comm: np.ndarray | None = None  # per client (in the order given): comm_u
    u_ag: tuple | None = None  # per client: (alpha_u, gamma_u) with AG_u(n) = alpha_u + gamma_u n
    ag_mean: tuple = (0.0, 0.0)  # the workers' mean AG(n) = ag_mean[0] + ag_mean[1] n


@lru_cache(maxsize=4096)
def segmentation(p: int, q: int):
    """Pairs (i, j) of sender i of p and receiver j of q whose row ranges [i/p, (i+1)/p) and
    [j/q, (j+1)/q) overlap, with the overlap as a fraction of the rows (exact integer arithmetic)."""
    ii, jj, ff = [], [], []
    i = j = 0
    while i < p and j < q:
        lo, hi = max(i * q, j * p), min((i + 1) * q, (j + 1) * p)
        if hi > lo:
            ii.append(i)
            jj.append(j)
            ff.append((hi - lo) / (p * q))
        if (i + 1) * q <= (j + 1) * p:
            i += 1
        else:
            j += 1
    return np.array(ii, dtype=np.intp), np.array(jj, dtype=np.intp), np.array(ff)


class Engine:
    """A cluster and a model turned into the arrays the cost needs."""

    def __init__(self, cluster: Cluster, model: ModelSpec):
        self.cluster, self.model = cluster, model
        self.R, self.U = cluster.n_reliable, cluster.n_unreliable
        self.L, self.d = model.layers, model.micro_batches
        self.cr, self.cu = cluster.reliable_flops, cluster.unreliable_flops
        m, a = model.tokens_per_micro_batch, model.act_bytes_per_token
        self.ma = m * a  # bytes of one micro-batch's activations at a stage boundary
        self.mF = m * model.flops_per_token_per_layer
        self.shard_bytes = model.params_per_layer * model.bytes_per_value  # per layer, split over |S_k|
        self.layer_mem = 2.0 * model.params_per_layer * model.bytes_per_value
        self.delay_rr, self.bw_rr = cluster.delay_rr, cluster.bw_rr
        with np.errstate(divide="ignore"):
            inv = 1.0 / cluster.bw_rr
        np.fill_diagonal(inv, 0.0)
        self.inv_rr = inv
        self.rt_d = cluster.delay_rr + cluster.delay_rr.T  # T(x->y) + T(y->x) = rt_d + n * rt_ib
        np.fill_diagonal(self.rt_d, 0.0)
        self.rt_ib = inv + inv.T
        self.u_d2 = 2.0 * cluster.delay_ur
        self.u_ib2 = 2.0 / cluster.bw_ur if self.U else np.zeros((0, self.R))
        self.mem_r = np.array([math.inf if x is None else x for x in cluster.reliable_memory], dtype=float)
        self.mem_u = np.array([math.inf if x is None else x for x in cluster.unreliable_memory], dtype=float)
        self.nvec = np.arange(1, self.L + 1, dtype=float)

    # ---- one stage ----
    def stage_terms(self, fs, bs, us) -> StageTerms:
        fs = np.asarray(fs, dtype=np.intp)
        bs = np.asarray(bs, dtype=np.intp)
        us = np.asarray(us, dtype=np.intp)
        srv = np.concatenate([fs, bs])
        nf = len(fs)
        sigma = float(self.cr[srv].sum() + self.cu[us].sum())
        k = self.ma / sigma  # x_w * a = k * c_w
        Dss = self.rt_d[srv][:, srv]
        Iss = self.rt_ib[srv][:, srv]
        # comm of frontal and backward servers: the best partner on the other side, both ways
        x = (self.cr[srv] * k)[:, None]
        comm_s = np.concatenate(
            [(Dss[:nf, nf:] + x[:nf] * Iss[:nf, nf:]).min(axis=1), (Dss[nf:, :nf] + x[nf:] * Iss[nf:, :nf]).min(axis=1)]
        )
        i = int(np.argmax(comm_s))
        comm, worst = float(comm_s[i]), ("r", int(srv[i]))
        comm_u = u_ag = None
        shard = self.shard_bytes / len(srv)
        ag_a = Dss.sum(axis=1)
        ag_g = shard * Iss.sum(axis=1)
        if us.size:
            xu = (self.cu[us] * k)[:, None]
            d2, ib2 = self.u_d2[us][:, srv], self.u_ib2[us][:, srv]
            t = d2 + xu * ib2
            comm_u = t[:, :nf].min(axis=1) + t[:, nf:].min(axis=1)
            j = int(np.argmax(comm_u))
            if comm_u[j] > comm:
                comm, worst = float(comm_u[j]), ("u", int(us[j]))
            u_ag = (d2.sum(axis=1), shard * ib2.sum(axis=1))
            ag_a = np.concatenate([ag_a, u_ag[0]])
            ag_g = np.concatenate([ag_g, u_ag[1]])
        ag_rows = ag_a[:, None] + ag_g[:, None] * self.nvec[None, :]
        ag_row = ag_rows.max(axis=0)
        w = int(np.argmax(ag_rows[:, 0]))
        ag_worst = ("r", int(srv[w])) if w < len(srv) else ("u", int(us[w - len(srv)]))
        mem = np.concatenate([self.mem_r[srv], self.mem_u[us]])
        m_i = int(np.argmin(mem))
        cap = self.L if not math.isfinite(mem[m_i]) else int(min(self.L, mem[m_i] // self.layer_mem))
        cap_worst = (
            None
            if not math.isfinite(mem[m_i])
            else (("r", int(srv[m_i])) if m_i < len(srv) else ("u", int(us[m_i - len(srv)])))
        )
        return StageTerms(
            comm,
            worst,
            self.mF / sigma,
            ag_row,
            ag_worst,
            cap,
            cap_worst,
            sigma,
            comm_u,
            u_ag,
            (float(ag_a.mean()), float(ag_g.mean())),
        )

    # ---- between stages ----
    def link(self, bs, fs_next) -> float:
        """link_k: activations from BS_k to FS_{k+1} by the even segmentation, gradients back."""
        i, j, frac = segmentation(len(bs), len(fs_next))
        b = np.asarray(bs, dtype=np.intp)[i]
        f = np.asarray(fs_next, dtype=np.intp)[j]
        n = frac * self.ma
        return float(
            (self.delay_rr[b, f] + n * self.inv_rr[b, f]).max() + (self.delay_rr[f, b] + n * self.inv_rr[f, b]).max()
        )

    def row(self, t: StageTerms, link: float, K: int) -> np.ndarray:
        """h_k(n) for n = 1..L: the stage's share of PT with n layers (inf beyond its memory)."""
        h = np.maximum((self.d + K - 1) * (t.comm + link + t.per_layer * self.nvec), t.ag_row)
        if t.cap < self.L:
            h[t.cap :] = math.inf
        return h

    # ---- the layer split ----
    def split(self, H: np.ndarray):
        """The exact min-max split of L layers over the K rows of H (H[k, n-1] = h_k(n),
        non-decreasing in n), each stage at least one layer. Returns (PT, layers per stage)."""
        K, L = H.shape
        if K > L:
            return math.inf, None
        first = H[:, 0]
        r = L - K
        if r == 0:
            T = float(first.max())
            return T, np.ones(K, dtype=int)
        rest = H[:, 1:]
        t_r = float(np.partition(rest, r - 1, axis=None)[r - 1])
        T = max(float(first.max()), t_r)
        if not math.isfinite(T):
            return math.inf, None
        less = (rest < t_r).sum(axis=1)
        need = r - int(less.sum())
        eq = (rest == t_r).sum(axis=1)
        take = np.minimum(eq, np.maximum(need - (np.cumsum(eq) - eq), 0))
        return T, 1 + less + take

    def cost_of_rows(self, H: np.ndarray, n) -> float:
        """max_k h_k(n_k) for a given split."""
        return float(H[np.arange(len(n)), np.asarray(n) - 1].max())


def engine_for(cluster: Cluster, model: ModelSpec) -> Engine:
    cache = cluster.__dict__.setdefault("_engines", {})
    eng = cache.get(model)
    if eng is None:
        eng = cache[model] = Engine(cluster, model)
    return eng


def _ids(cluster: Cluster, device):
    kind, i = device
    return cluster.reliable_ids[i] if kind == "r" else cluster.unreliable_ids[i]


def check_plan(cluster: Cluster, model: ModelSpec, plan: Plan):
    """None and the index lists (fs, bs, us, layer counts), or the reason the plan breaks a rule."""
    where: dict = {}
    fs_all, bs_all, us_all, n_all = [], [], [], []
    if not plan.stages:
        return "the plan has no stages", None
    for k, st in enumerate(plan.stages):
        if not st.frontal:
            return f"stage {k} has no frontal server", None
        if not st.backward:
            return f"stage {k} has no backward server", None
        for role, ids, want in (
            ("frontal", st.frontal, "reliable"),
            ("backward", st.backward, "reliable"),
            ("clients", st.clients, "unreliable"),
        ):
            for d in ids:
                try:
                    kind = cluster.kind(d)
                except KeyError:
                    return f"stage {k} {role}: unknown device {d!r}", None
                if kind != want:
                    return f"stage {k} {role}: {d} is a {kind} device; {role} must be {want}", None
                if d in where:
                    return f"{d} is placed twice: {where[d]} and stage {k} {role}", None
                where[d] = f"stage {k} {role}"
        fs_all.append([cluster.index(d) for d in st.frontal])
        bs_all.append([cluster.index(d) for d in st.backward])
        us_all.append([cluster.index(d) for d in st.clients])
    for d in plan.idle:
        try:
            kind = cluster.kind(d)
        except KeyError:
            return f"idle: unknown device {d!r}", None
        if kind != "unreliable":
            return f"idle: {d} is a reliable device; every reliable device must serve a stage", None
        if d in where:
            return f"{d} is placed twice: {where[d]} and idle", None
        where[d] = "idle"
    for d in cluster.reliable_ids:
        if d not in where:
            return f"reliable device {d} is not a server of any stage", None
    for d in cluster.unreliable_ids:
        if d not in where:
            return f"unreliable device {d} is neither a client nor idle", None
    end = 0
    for k, st in enumerate(plan.stages):
        lo, hi = st.layers
        if lo != end:
            return (
                f"stage {k} layers [{lo}, {hi}) should start at {end}: layers must tile [0, {model.layers}) in stage order",
                None,
            )
        if hi <= lo:
            return f"stage {k} layers [{lo}, {hi}) are empty", None
        n_all.append(hi - lo)
        end = hi
    if end != model.layers:
        return f"the stages' layers end at {end}, the model has {model.layers}", None
    return None, (fs_all, bs_all, us_all, n_all)


def plan_cost(cluster: Cluster, model: ModelSpec, plan: Plan) -> CostBreakdown:
    """PT of a plan by docs/cost-model.md (seconds per batch), with its parts; total is
    inf and reason says why when the plan is invalid or does not fit in memory."""
    reason, parts = check_plan(cluster, model, plan)
    if reason is not None:
        return CostBreakdown(math.inf, reason=reason)
    eng = engine_for(cluster, model)
    fs_all, bs_all, us_all, n_all = parts
    K = len(fs_all)
    out = CostBreakdown(math.inf)
    for k in range(K):
        t = eng.stage_terms(fs_all[k], bs_all[k], us_all[k])
        n = n_all[k]
        if n > t.cap:
            dev = _ids(cluster, t.cap_worst)
            mem = eng.mem_r[t.cap_worst[1]] if t.cap_worst[0] == "r" else eng.mem_u[t.cap_worst[1]]
            out.reason = (
                f"stage {k} holds {n} layers ({n * eng.layer_mem / 1e9:.3g} GB of weights and gradients) "
                f"but {dev} has {mem / 1e9:.3g} GB"
            )
        link = eng.link(bs_all[k], fs_all[k + 1]) if k + 1 < K else 0.0
        comp = t.per_layer * n
        out.stage_comp.append(comp)
        out.stage_comm.append(t.comm)
        out.stage_dt.append(comp + t.comm)
        out.stage_link.append(link)
        out.stage_tau.append(t.comm + link + t.per_layer * n)
        out.stage_ag.append(float(t.ag_row[n - 1]))
    out.pipe = (model.micro_batches + K - 1) * max(out.stage_tau)
    out.aggregation = max(out.stage_ag)
    out.total = math.inf if out.reason else max(out.pipe, out.aggregation)
    return out
