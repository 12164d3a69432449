"""The drift test (parameter_server/drift.py): honest rounding differences, whatever their size, never
add up to a ban; a liar that biases its results the same way under the L2 tolerance is banned within
a few checks."""

from __future__ import annotations

import torch

from parameter_server.drift import ALPHA, DIRECTIONS, DriftTest, bound, chi2_quantile, chi2_survival


def _result(gen, n=1024):
    return torch.randn(n, generator=gen)


def test_the_chi_squared_tail_and_the_bound():
    assert abs(chi2_survival(2 * 2.995732, 2) - 0.05) < 1e-6  # k=2: exp(-x/2)
    assert abs(chi2_quantile(0.05, 2) - 5.991465) < 1e-4
    assert abs(chi2_survival(15.507313, 8) - 0.05) < 1e-5
    assert bound(1) < bound(10) < bound(100)  # the union bound widens it as checks add up


def test_honest_differences_of_any_size_never_ban():
    """80 volunteers x 40 checks each, relative differences from 0 to 1e-4 (one re-run is bit-exact,
    another device rounds otherwise): no ban (the test allows ALPHA = 1e-6 per volunteer)."""
    gen = torch.Generator().manual_seed(0)
    test = DriftTest(secret=b"honest")
    worst = 0.0
    for v in range(80):
        size = [0.0, 1e-7, 1e-5, 1e-4][v % 4]
        for _ in range(40):
            want = _result(gen)
            got = want + size * float(want.norm()) / 64 * torch.randn(want.shape, generator=gen)
            assert test.add(f"v{v}", "outputs", got, want) is None
        s, n = test.sums[(f"v{v}", "outputs")]
        worst = max(worst, test.q(s, n) / bound(n))
    assert ALPHA <= 1e-6 and worst < 1.0


def test_a_consistent_small_bias_is_banned_within_twenty_checks():
    """The issue's liar: one coordinate biased by 3e-4 of the result's norm on every task (under the
    1e-3 tolerance of each check), with honest rounding on top."""
    from peer.volunteer.cheat import Cheat

    gen = torch.Generator().manual_seed(1)
    liar = Cheat("bias")
    test = DriftTest(secret=b"server")
    caught_at = None
    for i in range(1, 21):
        want = _result(gen)
        got = liar.tensor(want + 1e-7 * torch.randn(want.shape, generator=gen))
        assert float((got - want).norm() / want.norm()) < 1e-3  # every L2 check passes
        if test.add("liar", "outputs", got, want) is not None:
            caught_at = i
            break
    assert caught_at is not None and caught_at <= 20, caught_at
    test.add("honest", "outputs", want + 1e-7 * torch.randn(want.shape, generator=gen), want)
    assert test.suspicious("liar") and not test.suspicious("honest") and test.suspects() == {"liar"}
    test.forget("liar")
    test.forget("honest")
    assert not test.sums


def test_a_result_scaled_under_the_tolerance_is_banned_within_twenty_checks():
    """Every result scaled by 1 + 1e-4 (each check passes: 1e-4 < 1e-3): its difference is the result
    itself, a new vector every check, which the random directions do not see; along the result it
    points the same way every time."""
    gen = torch.Generator().manual_seed(2)
    test, caught_at = DriftTest(secret=b"server"), None
    for i in range(1, 21):
        want = _result(gen)
        got = want * (1 + 1e-4) + 1e-7 * torch.randn(want.shape, generator=gen)
        if test.add("liar", "gradients", got, want) is not None:
            caught_at = i
            break
    assert caught_at is not None and caught_at <= 20, caught_at
    s, n = test.sums[("liar", "gradients")]
    assert float((s[:DIRECTIONS] ** 2).sum()) / n < 2 * DIRECTIONS  # (the directions alone: no drift)


def test_rounding_in_proportion_to_each_value_never_bans():
    """Honest rounding is relative to each value (a float's error scales with it) but has no sign:
    differences of 1e-7 to 1e-4 of each coordinate, times a random sign, over 40 checks of 40
    volunteers, stay far under the bound along the result as along the directions."""
    gen = torch.Generator().manual_seed(3)
    test, worst = DriftTest(secret=b"honest"), 0.0
    for v in range(40):
        size = [1e-7, 1e-6, 1e-5, 1e-4][v % 4]
        for _ in range(40):
            want = _result(gen)
            got = want * (1 + size * torch.randn(want.shape, generator=gen))
            assert test.add(f"v{v}", "outputs", got, want) is None
        s, n = test.sums[(f"v{v}", "outputs")]
        worst = max(worst, test.q(s, n) / bound(n))
    assert worst < 0.5, worst


def test_the_directions_are_the_servers_own():
    a, b = DriftTest(secret=b"a"), DriftTest(secret=b"b")
    d = torch.randn(1000)
    assert not torch.allclose(a.project(d), b.project(d))
    assert torch.allclose(a.project(d), DriftTest(secret=b"a").project(d))
    w = torch.randn(1000)
    assert not torch.allclose(a.along(d, w), b.along(d, w))  # (the blocks along the result too)
    assert DriftTest().secret != DriftTest().secret and DIRECTIONS % 2 == 0
