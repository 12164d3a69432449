"""`--stage auto`'s arithmetic (scheduler/balance.py): a stage without compute is filled first,
predicted step times decide, measured links break near-ties, and a volunteer moves only for a 20%
shorter predicted step."""

from __future__ import annotations

import math

import pytest

from scheduler.balance import StageNow, better, choose, predict
from scheduler.files import ModelSpec

MODEL = ModelSpec(
    layers=4,
    hidden=128,
    bytes_per_value=4,
    batch_tokens=16 * 128,
    micro_batches=4,
    flops_per_token_per_layer=72.0 * 128**2,
)
NBYTES = 2 * 4 * 128 * 128 * 4
EQUAL = ([[0.01, 0.01], [0.01, 0.01]], [[6.25e6, 6.25e6], [6.25e6, 6.25e6]])  # 10 ms, 50 Mbit/s to all


def stages(v0=(), v1=(), server=0.0):
    return [
        StageNow(["s0f0"], ["s0b0"], (0, 2), {"s0f0": server, "s0b0": server}, list(v0)),
        StageNow(["s1f0"], ["s1b0"], (2, 4), {"s1f0": server, "s1b0": server}, list(v1)),
    ]


def test_a_stage_without_compute_is_filled_first():
    d = choose(stages(v0=[1e9]), MODEL, 1e9, *EQUAL, NBYTES)
    assert d.stage == 1
    assert d.predicted[0] == (1, math.inf) and d.predicted[1][0] == 0


def test_volunteers_with_equal_links_joining_one_by_one_cover_both_stages_and_balance():
    placed = {0: [], 1: []}
    for _ in range(4):
        d = choose(stages(placed[0], placed[1]), MODEL, 1e9, *EQUAL, NBYTES)
        placed[d.stage].append(1e9)
    assert len(placed[0]) == len(placed[1]) == 2


def test_two_volunteers_that_raced_onto_one_stage_split_at_the_recheck():
    # both joined stage 0 at once; each, seeing the other there, should move to the empty stage 1
    d = choose(stages(v0=[1e9]), MODEL, 1e9, *EQUAL, NBYTES, current=0)
    assert d.moves and d.stage == 1
    # once one moved, the other stays
    d = choose(stages(v1=[1e9]), MODEL, 1e9, *EQUAL, NBYTES, current=0)
    assert not d.moves and d.stage == 0


def test_links_decide_between_stages_within_ten_percent():
    near0 = ([[0.004, 0.004], [0.12, 0.12]], [[1.25e8, 1.25e8], [2.5e6, 2.5e6]])
    near1 = ([[0.12, 0.12], [0.004, 0.004]], [[2.5e6, 2.5e6], [1.25e8, 1.25e8]])
    s = stages(server=5e9)  # the servers compute: every placement is within a few percent
    assert choose(s, MODEL, 1e8, *near0, NBYTES).stage == 0
    assert choose(s, MODEL, 1e8, *near1, NBYTES).stage == 1


def test_compute_decides_over_links_beyond_ten_percent():
    near0 = ([[0.004, 0.004], [0.03, 0.03]], [[1.25e8, 1.25e8], [1.25e7, 1.25e7]])
    s = stages(v0=[4e9, 4e9], v1=[1e8])  # stage 1 is the bottleneck by far
    d = choose(s, MODEL, 4e9, *near0, NBYTES)
    assert d.stage == 1, d.reason
    assert d.predicted[1][1] < 0.9 * d.predicted[0][1]


def test_hysteresis_a_small_gain_does_not_move():
    # stage 0: us + one; stage 1: one a bit slower. Moving helps, but by less than 20%
    s = stages(v0=[1e9], v1=[0.9e9])
    d = choose(s, MODEL, 1e9, *EQUAL, NBYTES, current=0)
    assert not d.moves
    assert d.stay[1] <= d.predicted[1][1] / 0.8


def test_better_orders_empty_stages_before_time():
    assert better((0, 100.0), (1, math.inf), 0.2)
    assert not better((1, 1.0), (0, 100.0), 0.2)
    assert better((0, 7.9), (0, 10.0), 0.2) and not better((0, 8.1), (0, 10.0), 0.2)


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="one StageNow"):
        choose(stages(), MODEL, 1e9, [[0.01, 0.01]], [[1e6, 1e6]], NBYTES)


def test_predict_counts_the_joining_volunteer():
    empty, t = predict(stages(v1=[1e9]), MODEL, 1e9, *EQUAL, where=0)
    assert empty == 0 and math.isfinite(t)
    assert predict(stages(v1=[1e9]), MODEL, 1e9, *EQUAL, where=None) == (1, math.inf)
