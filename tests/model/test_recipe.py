"""The training recipe (core.protocol.recipe): the schedules as pure functions of the update, the checks
that name the flag, and the config record's form."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.protocol.recipe import SCHEDULES, Recipe, parse_betas


def lrs(recipe: Recipe, steps: int) -> list[float]:
    return [recipe.lr_at(u, steps) for u in range(steps)]


def test_warm_up_is_linear_and_reaches_the_peak_at_its_last_update():
    r = Recipe(lr=1.0, warmup_steps=4)
    assert lrs(r, 6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_and_linear_decay_from_the_peak_after_the_warm_up_to_min_lr():
    cos = Recipe(lr=1.0, schedule="cosine", warmup_steps=2, min_lr=0.1)
    values = lrs(cos, 12)  # decay over the 10 updates after the warm-up
    assert values[:3] == [0.5, 1.0, 1.0]
    assert values[2 + 5] == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert values[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    lin = Recipe(lr=1.0, schedule="linear", min_lr=0.0, decay_steps=4)
    assert lrs(lin, 7) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0])  # then it stays at min_lr


def test_wsd_is_stable_until_its_last_decay_steps_then_decays_as_a_square_root():
    r = Recipe(lr=1.0, schedule="wsd", warmup_steps=1, decay_steps=4)
    assert lrs(r, 10) == pytest.approx([1.0] * 6 + [1 - math.sqrt(p) for p in (0.0, 0.25, 0.5, 0.75)])
    assert Recipe(schedule="wsd").decay_length(100) == 20  # 20% of the run by default


@given(
    schedule=st.sampled_from(SCHEDULES),
    steps=st.integers(1, 300),
    warmup=st.integers(0, 300),
    decay=st.one_of(st.none(), st.integers(1, 400)),
    min_frac=st.floats(0, 1),
)
def test_every_schedule_stays_between_min_lr_and_lr_and_never_rises_after_its_warm_up(
    schedule, steps, warmup, decay, min_frac
):
    warmup = min(warmup, steps)
    r = Recipe(lr=3e-3, schedule=schedule, warmup_steps=warmup, min_lr=3e-3 * min_frac, decay_steps=decay)
    r.check(steps)
    values = lrs(r, steps)
    assert all(0 < v <= r.lr * (1 + 1e-12) for v in values[:warmup])
    after = values[warmup:]
    assert all(r.min_lr - 1e-15 <= v <= r.lr + 1e-15 for v in after)
    assert all(b <= a + 1e-15 for a, b in zip(after, after[1:]))


@pytest.mark.parametrize(
    "kw,steps,flag",
    [
        (dict(lr=0.0), 10, "--lr"),
        (dict(schedule="step"), 10, "--lr-schedule"),
        (dict(warmup_steps=-1), 10, "--warmup-steps"),
        (dict(warmup_steps=11), 10, "--warmup-steps 11 is more than the run's 10 steps"),
        (dict(min_lr=1.0), 10, "--min-lr"),
        (dict(min_lr=float("nan")), 10, "--min-lr"),
        (dict(decay_steps=0), 10, "--decay-steps"),
        (dict(betas=(0.9, 1.0)), 10, "--betas"),
        (dict(betas=(0.9,)), 10, "--betas"),
        (dict(eps=0.0), 10, "--eps"),
        (dict(weight_decay=-0.1), 10, "--weight-decay"),
        (dict(clip_grad_norm=0.0), 10, "--clip-grad-norm"),
        (dict(clip_grad_norm=float("inf")), 10, "--clip-grad-norm"),
    ],
)
def test_a_setting_no_run_can_use_is_refused_naming_its_flag(kw, steps, flag):
    with pytest.raises(ValueError, match=flag.replace("+", r"\+")):
        Recipe(**kw).check(steps)


def test_betas_are_read_as_two_numbers():
    assert parse_betas("0.8,0.99") == (0.8, 0.99)
    for bad in ("0.9", "0.9,0.95,0.99", "a,b", ""):
        with pytest.raises(ValueError, match="--betas must be two numbers"):
            parse_betas(bad)


def test_the_record_form_round_trips_and_a_bad_record_names_its_field():
    r = Recipe(lr=1e-3, schedule="cosine", warmup_steps=3, min_lr=1e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    assert Recipe.from_record(1e-3, r.record()) == r
    assert Recipe.from_record(1e-3, None) == Recipe(lr=1e-3)
    with pytest.raises(ValueError, match="unknown field 'momentum'"):
        Recipe.from_record(1e-3, dict(r.record(), momentum=0.9))
    with pytest.raises(ValueError, match="'betas' must be a pair"):
        Recipe.from_record(1e-3, dict(r.record(), betas=0.9))
    with pytest.raises(ValueError, match="expected a map"):
        Recipe.from_record(1e-3, [1, 2])


def test_the_run_config_record_carries_the_recipe_and_refuses_a_bad_one():
    from core.protocol.records import RunConfig

    r = Recipe(lr=1e-3, schedule="wsd", decay_steps=5)
    run = RunConfig("x", "tiny", 0, 20, 16, 4, 1e-3, {}, recipe=r.record())
    assert RunConfig.from_dict(run.to_dict()).training_recipe() == r
    old = run.to_dict()
    del old["recipe"]  # a record without the field: the default recipe
    assert RunConfig.from_dict(old).training_recipe() == Recipe(lr=1e-3)
    bad = dict(run.to_dict(), recipe=dict(r.record(), warmup_steps=50))
    with pytest.raises(ValueError, match="field 'recipe': --warmup-steps 50 is more than the run's 20 steps"):
        RunConfig.from_dict(bad)


def test_peer_reference_refuses_a_bad_recipe_flag_with_exit_2():
    out = subprocess.run(
        [sys.executable, "-m", "peer.cli", "reference", "--model", "tiny", "--steps", "2", "--betas", "0.9"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "--betas must be two numbers" in out.stderr, out.stderr


def test_the_clip_scale_is_clip_grad_norms_coefficient():
    import torch

    from core.protocol.recipe import clip_scale

    g = torch.tensor([3.0, 4.0])  # norm 5
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([p], 2.0)
    assert torch.allclose(p.grad, g * clip_scale(2.0, 25.0), rtol=1e-7)
    assert clip_scale(10.0, 25.0) == 1.0  # under the bound: not scaled


def test_a_negative_eval_every_is_refused_with_exit_2_by_every_command_that_trains():
    for cmd in (["reference", "--model", "tiny", "--steps", "2"], ["swarm", "--steps", "2"]):
        out = subprocess.run(
            [sys.executable, "-m", "peer.cli", *cmd, "--eval-every", "-1"], capture_output=True, text=True
        )
        assert out.returncode == 2 and "--eval-every: must be an integer >= 0, got -1" in out.stderr, out.stderr
