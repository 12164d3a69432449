"""make_plan: one entry for every algorithm, and the volunteer rule that `peer join --stage
auto` shares with the planner."""

from __future__ import annotations

import math
import time

import numpy as np

from scheduler.balance import link_score
from scheduler.cost import engine_for
from scheduler.files import Cluster, ModelSpec, Plan, PlanInputError
from scheduler.state import layout_to_plan

ALGORITHMS = ("refined", "paper", "exact", "random", "ga")


def choose_stage_for_volunteer(delays, bandwidths, nbytes: float) -> int:
    """The stage whose servers are closest on average: argmin_k mean_j (delay_kj + nbytes /
    bandwidth_kj), with delays[k] (seconds) and bandwidths[k] (bytes/s) this volunteer's links to
    the servers of stage k; the first such stage on a tie."""
    if not delays or len(delays) != len(bandwidths):
        raise ValueError("choose_stage_for_volunteer: one list of delays and one of bandwidths per stage are needed")
    best, best_k = math.inf, None
    for k, (dl, bw) in enumerate(zip(delays, bandwidths)):
        if not dl or len(dl) != len(bw):
            raise ValueError(f"choose_stage_for_volunteer: stage {k} needs as many bandwidths as delays, at least one")
        score = link_score(dl, bw, nbytes)
        if best_k is None or score < best:
            best, best_k = score, k
    return best_k


def make_plan(
    cluster: Cluster, model: ModelSpec, algorithm: str = "refined", seed: int = 0, time_limit: float = 30.0
) -> Plan:
    """A plan by `algorithm`; its predicted_seconds_per_batch is its cost by plan_cost (inf
    when no plan fits in memory). The time limit is a safety cap: each algorithm's work is
    fixed by the seed and the budget, so the same inputs give the same plan."""
    if algorithm not in ALGORITHMS:
        raise PlanInputError(f"algorithm: unknown {algorithm!r}, expected one of {', '.join(ALGORITHMS)}")
    if not time_limit > 0:
        raise PlanInputError(f"time_limit: must be positive, got {time_limit}")
    t0 = time.monotonic()
    eng = engine_for(cluster, model)
    if model.layers < 1:
        raise PlanInputError("model.layers: at least one layer is needed")
    rng = np.random.default_rng(seed)
    if algorithm == "paper":
        from scheduler.paper import paper_plan

        lay, n, _ = paper_plan(eng, rng)
        plan = layout_to_plan(eng, lay, n)
    else:
        if algorithm == "refined":
            from scheduler.refine import refined

            st = refined(eng, rng, time_limit, t0)
        elif algorithm == "exact":
            from scheduler.exact import exact

            st = exact(eng, t0 + time_limit)
        elif algorithm == "random":
            from scheduler.baselines import random_search

            st = random_search(eng, rng, time_limit, t0)
        else:
            from scheduler.baselines import genetic

            st = genetic(eng, rng, time_limit, t0)
        plan = st.plan()
        if st.n is None:  # nothing fits in memory: keep the layout, even layers
            plan = layout_to_plan(eng, st.lay, None)
    from scheduler.cost import plan_cost

    plan.predicted_seconds_per_batch = plan_cost(cluster, model, plan).total
    return plan
