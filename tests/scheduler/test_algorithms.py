"""The planners: exact is never beaten, every algorithm returns a valid plan, the annealed open
path is optimal on small graphs, the paper's steps do what section 3.3.3 says, determinism."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    ALGORITHMS,
    PlanInputError,
    choose_stage_for_volunteer,
    load_cluster,
    load_model,
    make_plan,
    plan_cost,
    scenarios,
)
from scheduler.cost import engine_for
from scheduler.paper import assign_roles, diana_split, divisive_levels, edge_weights
from scheduler.tsp import anneal_open_path, brute_force_open_path, path_cost

FAST = 0.4  # seconds: every search is capped by its time limit


@pytest.mark.parametrize("seed", range(6))
def test_exact_is_never_beaten_on_small_clusters(seed):
    cluster = load_cluster(scenarios.small_random_cluster(seed))
    model = load_model(scenarios.small_model(seed))
    best = make_plan(cluster, model, "exact", time_limit=60)
    opt = plan_cost(cluster, model, best).total
    assert best.predicted_seconds_per_batch == opt
    for algorithm in ("refined", "paper", "random", "ga"):
        plan = make_plan(cluster, model, algorithm, seed=seed, time_limit=FAST)
        assert plan_cost(cluster, model, plan).total >= opt * (1 - 1e-9), algorithm


def test_exact_refuses_large_clusters():
    cluster = load_cluster(scenarios.hps_hybrid(0))
    with pytest.raises(PlanInputError, match="exact.*8 reliable and 8 unreliable.*limited to 6 reliable and 4"):
        make_plan(cluster, load_model(scenarios.EXAMPLE_MODEL), "exact")


def test_unknown_algorithm():
    cluster = load_cluster(scenarios.small_random_cluster(0))
    with pytest.raises(PlanInputError, match="algorithm: unknown 'magic'"):
        make_plan(cluster, load_model(scenarios.small_model(0)), "magic")


def _cluster_strategy():
    @st.composite
    def build(draw):
        R = draw(st.integers(2, 9))
        U = draw(st.integers(0, 6))
        seed = draw(st.integers(0, 2**31))
        rng = np.random.default_rng(seed)
        delay = rng.uniform(0.05, 200, (R, R))
        bw = np.exp(rng.uniform(np.log(5), np.log(50_000), (R, R)))
        rel = [{"id": f"r{i}", "tflops": float(rng.uniform(0.5, 40))} for i in range(R)]
        vol = [{"id": f"v{u}", "tflops": float(rng.uniform(0.5, 20))} for u in range(U)]
        model = {
            "layers": draw(st.integers(1, 16)),
            "hidden": draw(st.sampled_from([64, 512, 2048])),
            "bytes_per_value": 2,
            "batch_tokens": 65536,
            "micro_batches": draw(st.sampled_from([1, 8, 64])),
        }
        return {
            "reliable": rel,
            "unreliable": vol,
            "delay_ms": {"reliable": delay.tolist(), "unreliable": rng.uniform(1, 300, (U, R)).tolist()},
            "bandwidth_mbps": {
                "reliable": bw.tolist(),
                "unreliable": np.exp(rng.uniform(np.log(5), np.log(1000), (U, R))).tolist(),
            },
        }, model

    return build()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cluster_strategy(), st.sampled_from([a for a in ALGORITHMS if a != "exact"]), st.integers(0, 3))
def test_every_algorithm_returns_a_valid_plan(data, algorithm, seed):
    cluster_d, model_d = data
    cluster, model = load_cluster(cluster_d), load_model(model_d)
    plan = make_plan(cluster, model, algorithm, seed=seed, time_limit=0.3)
    cost = plan_cost(cluster, model, plan)
    assert cost.reason is None, cost.reason
    assert math.isfinite(cost.total) and cost.total > 0
    assert plan.predicted_seconds_per_batch == cost.total
    assert 1 <= len(plan.stages) <= min(model.layers, cluster.n_reliable // 2)


def test_exact_returns_a_valid_plan_on_a_tiny_cluster_with_one_layer():
    cluster = load_cluster(scenarios.random_cluster(3, 5, 2))
    model = load_model({**scenarios.small_model(3), "layers": 1})
    plan = make_plan(cluster, model, "exact")
    assert len(plan.stages) == 1 and plan_cost(cluster, model, plan).reason is None


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7, 8])
def test_annealed_open_path_equals_brute_force(n):
    for seed in range(5):
        rng = np.random.default_rng(100 * n + seed)
        pts = rng.random((n, 2))
        W = np.linalg.norm(pts[:, None] - pts[None], axis=-1) + rng.random((n, n)) * 0.1
        W = (W + W.T) / 2
        np.fill_diagonal(W, 0)
        got = anneal_open_path(W, np.random.default_rng(seed))
        want = brute_force_open_path(W)
        assert sorted(got) == list(range(n))
        assert path_cost(W, got) == pytest.approx(path_cost(W, want), rel=1e-12)


def test_divisive_clustering_finds_the_sites():
    cluster = load_cluster(scenarios.hps_hpc4(1))  # 4 HPCs of 4 V100: far apart, close inside
    eng = engine_for(cluster, load_model(scenarios.EXAMPLE_MODEL))
    levels = list(divisive_levels(edge_weights(eng), 8))
    assert [len(lv) for lv in levels] == list(range(1, 9))
    four = sorted(sorted(c.tolist()) for c in levels[3])
    assert four == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    a, b = diana_split(edge_weights(eng), np.arange(16))
    assert len(a) >= 2 and len(b) >= 2


def test_roles_have_at_least_one_of_each_side():
    cluster = load_cluster(scenarios.hps_datacenter(0))
    eng = engine_for(cluster, load_model(scenarios.EXAMPLE_MODEL))
    fs, bs = assign_roles(eng, [np.arange(0, 6), np.arange(6, 10), np.arange(10, 16)])
    assert all(f and b for f, b in zip(fs, bs))
    assert sorted(sum(fs, []) + sum(bs, [])) == list(range(16))
    fs1, bs1 = assign_roles(eng, [np.arange(16)])  # one stage: no neighbours, still both roles
    assert fs1[0] and bs1[0]


def test_choose_stage_for_volunteer():
    # stage 0: near but narrow; stage 1: far but wide. For small payloads delay wins, for large bandwidth
    delays = [[0.01, 0.01], [0.1, 0.1]]
    bws = [[1e6, 1e6], [1e8, 1e8]]
    assert choose_stage_for_volunteer(delays, bws, 1e3) == 0
    assert choose_stage_for_volunteer(delays, bws, 1e6) == 1
    assert choose_stage_for_volunteer([[0.02], [0.02]], [[1e6], [1e6]], 10) == 0  # a tie: the first
    with pytest.raises(ValueError):
        choose_stage_for_volunteer([], [], 1)


@pytest.mark.parametrize("algorithm", ["refined", "random", "ga", "paper"])
def test_same_seed_same_plan(algorithm):
    cluster = load_cluster(scenarios.hps_hybrid(2))
    model = load_model(scenarios.EXAMPLE_MODEL)
    a = make_plan(cluster, model, algorithm, seed=7, time_limit=5).to_dict()
    b = make_plan(cluster, model, algorithm, seed=7, time_limit=5).to_dict()
    assert a == b


def test_refined_is_never_worse_than_the_paper():
    model = load_model(scenarios.EXAMPLE_MODEL)
    for make in (scenarios.hps_hpc4, scenarios.hps_hybrid):
        cluster = load_cluster(make(0))
        paper = make_plan(cluster, model, "paper").predicted_seconds_per_batch
        refined = make_plan(cluster, model, "refined", time_limit=2).predicted_seconds_per_batch
        assert refined <= paper * (1 + 1e-12)


def test_the_time_limit_is_kept_on_a_large_cluster():
    import time

    cluster = load_cluster(scenarios.random_cluster(0, 200, 1000, as_arrays=True))
    model = load_model(scenarios.EXAMPLE_MODEL)
    t = time.monotonic()
    plan = make_plan(cluster, model, "refined", time_limit=2.0)
    assert time.monotonic() - t < 2.0 * 1.5 + 0.5
    assert plan_cost(cluster, model, plan).reason is None


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != "exact"])
def test_a_tiny_time_limit_still_gives_a_valid_plan(algorithm):
    cluster = load_cluster(scenarios.random_cluster(0, 60, 300, as_arrays=True))
    model = load_model(scenarios.EXAMPLE_MODEL)
    plan = make_plan(cluster, model, algorithm, time_limit=0.01)
    assert plan_cost(cluster, model, plan).reason is None


def test_exact_out_of_time_says_so():
    cluster = load_cluster(scenarios.random_cluster(0, 6, 4))
    with pytest.raises(PlanInputError, match="did not finish within the time limit"):
        make_plan(cluster, load_model(scenarios.small_model(0)), "exact", time_limit=0.001)
