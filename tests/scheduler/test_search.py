"""The search machinery: the exact layer split, incremental evaluation, boundary orders."""

import itertools

import numpy as np
import pytest

from scheduler import load_cluster, load_model, plan_cost, scenarios
from scheduler.cost import engine_for
from scheduler.refine import move_reliable, move_volunteer, random_layout
from scheduler.state import State, best_link


def _compositions(L, K):
    for cuts in itertools.combinations(range(1, L), K - 1):
        b = (0,) + cuts + (L,)
        yield [b[i + 1] - b[i] for i in range(K)]


@pytest.mark.parametrize("seed", range(8))
def test_split_is_the_min_max_over_every_split(seed):
    rng = np.random.default_rng(seed)
    K, L = int(rng.integers(1, 5)), int(rng.integers(4, 10))
    if K > L:
        K = L
    eng = engine_for(
        load_cluster(scenarios.random_cluster(seed, 8, 4)), load_model({**scenarios.small_model(seed), "layers": L})
    )
    # rows: increasing piecewise-linear functions like h_k, some with a memory cap
    H = np.maximum(
        rng.random((K, 1)) + rng.random((K, 1)) * np.arange(1, L + 1), rng.random((K, 1)) * 3 * np.arange(1, L + 1)
    )
    for k in range(K):
        if rng.random() < 0.3:
            H[k, int(rng.integers(2, L + 1)) :] = np.inf
    T, n = eng.split(H)
    best = min((max(H[k, c - 1] for k, c in enumerate(comp)) for comp in _compositions(L, K)), default=np.inf)
    assert T == pytest.approx(best)
    if np.isfinite(best):
        assert n.sum() == L and (n >= 1).all()
        assert max(H[k, n[k] - 1] for k in range(K)) == pytest.approx(T)


def test_state_cost_equals_plan_cost_of_its_plan():
    model = load_model(scenarios.EXAMPLE_MODEL)
    for seed in range(6):
        cluster = load_cluster(scenarios.random_cluster(seed, 10, 8))
        eng = engine_for(cluster, model)
        st = State(eng, random_layout(eng, np.random.default_rng(seed)))
        assert plan_cost(cluster, model, st.plan()).total == pytest.approx(st.pt, rel=1e-12)


def test_a_move_rescores_only_the_stages_it_touches():
    cluster = load_cluster(scenarios.random_cluster(1, 24, 30))
    model = load_model(scenarios.EXAMPLE_MODEL)
    eng = engine_for(cluster, model)
    st = State(eng, random_layout(eng, np.random.default_rng(1), K=6))
    calls = []
    real = eng.stage_terms
    eng.stage_terms = lambda *a: calls.append(a) or real(*a)
    try:
        u = 0 if st.u_stage[0] != 2 else 1
        c = st.propose(move_volunteer(st, u, 2))
        assert len(calls) == (2 if st.u_stage[u] >= 0 else 1)
        calls.clear()
        i = next(
            i
            for i in range(eng.R)
            if st.r_stage[i] != 4
            and len(st.lay.fs[st.r_stage[i]] if st.r_role[i] == 0 else st.lay.bs[st.r_stage[i]]) > 1
        )
        c = st.propose(move_reliable(st, i, 4, 1))
        assert len(calls) == 2
    finally:
        eng.stage_terms = real
    assert plan_cost(cluster, model, _plan_of(st, c)).total == pytest.approx(c.pt, rel=1e-12)


def _plan_of(st, c):
    st.commit(c)
    return st.plan()


def test_best_link_tries_every_order_of_a_small_boundary():
    cluster = load_cluster(scenarios.random_cluster(2, 8, 0, n_sites=4))
    eng = engine_for(cluster, load_model(scenarios.EXAMPLE_MODEL))
    bs, fs = [0, 1, 2], [3, 4, 5, 6]
    v, b2, f2 = best_link(eng, bs, fs)
    brute = min(eng.link(list(p), list(q)) for p in itertools.permutations(bs) for q in itertools.permutations(fs))
    assert v == pytest.approx(brute) and eng.link(b2, f2) == pytest.approx(brute)
    assert sorted(b2) == bs and sorted(f2) == fs
