"""When a worker fetches the next parameter version ahead (scheduler/prefetch.py), as a pure function."""

from __future__ import annotations

from scheduler.prefetch import version_to_fetch


def test_a_worker_that_worked_on_the_version_before_fetches_the_next():
    assert version_to_fetch({4}, 5, held={4, 5}, fetching=()) == (6, {4, 5})
    assert version_to_fetch({4, 5}, 5, held={4, 5}, fetching=()) == (6, {4, 5})


def test_a_worker_that_skipped_a_version_does_not_fetch_ahead():
    """(More workers than tasks a step: it would fetch versions it never uses.)"""
    assert version_to_fetch({3}, 5, held={5}, fetching=()) == (None, {5})
    assert version_to_fetch(set(), 0, held={0}, fetching=()) == (None, {0})


def test_one_fetch_ahead_at_a_time_and_none_of_a_version_held():
    assert version_to_fetch({4}, 5, held={5, 6}, fetching=()) == (None, {4, 5})
    assert version_to_fetch({4}, 5, held={5}, fetching={6}) == (None, {4, 5})


def test_only_the_last_two_versions_are_remembered():
    nxt, worked = version_to_fetch({1, 2, 3, 7}, 8, held={8}, fetching=())
    assert (nxt, worked) == (9, {7, 8})
