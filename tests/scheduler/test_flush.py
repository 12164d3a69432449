"""The worker's gradient-flush policy (scheduler/flush.py) driven as a pure function."""

from __future__ import annotations

from scheduler.flush import awaiting_after, batches_to_push, hold_ends, owed_after

LEASE = (100.0, 60.0)  # deadline 100 s, a 60 s lease: its last third starts at 80 s


def test_idle_pushes_everything():
    assert batches_to_push({3: [LEASE], 1: [LEASE]}, None, now=0.0, max_pending=9, last_stage=False) == [1, 3]


def test_too_many_leases_push_everything():
    pending = {2: [LEASE] * 4, 3: [LEASE] * 4}
    task = {"batch": 3, "kind": "forward"}
    assert batches_to_push(pending, task, 0.0, max_pending=8, last_stage=False) == [2, 3]
    assert batches_to_push(pending, task, 0.0, max_pending=9, last_stage=False) == []


def test_a_forward_task_waits_only_on_batches_two_behind():
    pending = {1: [LEASE], 2: [LEASE], 3: [LEASE]}
    assert batches_to_push(pending, {"batch": 3, "kind": "forward"}, 0.0, 99, last_stage=False) == [1]


def test_a_task_that_carries_gradients_pushes_every_older_batch():
    pending = {1: [LEASE], 2: [LEASE], 3: [LEASE]}
    assert batches_to_push(pending, {"batch": 3, "kind": "backward"}, 0.0, 99, last_stage=False) == [1, 2]
    assert batches_to_push(pending, {"batch": 3, "kind": "forward"}, 0.0, 99, last_stage=True) == [1, 2]


def test_a_lease_in_its_last_third_is_pushed():
    pending = {5: [(100.0, 60.0)], 6: [(200.0, 60.0)]}
    task = {"batch": 6, "kind": "forward"}
    assert batches_to_push(pending, task, now=79.0, max_pending=99, last_stage=False) == []
    assert batches_to_push(pending, task, now=81.0, max_pending=99, last_stage=False) == [5]


def test_an_idle_worker_holds_a_batch_it_is_owed_backward_tasks_of_for_a_while():
    pending = {4: [LEASE], 5: [LEASE]}
    awaiting = {5: 10.0}  # idle since 10 s holding batch 5, whose backward tasks it is owed
    assert batches_to_push(pending, None, 10.5, 99, False, awaiting, hold=1.0) == [4]
    assert batches_to_push(pending, None, 11.0, 99, False, awaiting, hold=1.0) == [4, 5]  # held long enough
    assert batches_to_push(pending, None, 85.0, 99, False, {5: 84.9}, hold=1.0) == [4, 5]  # its lease runs out
    assert batches_to_push(pending, None, 10.5, 2, False, awaiting, hold=1.0) == [4, 5]  # holds too many leases
    assert batches_to_push(pending, None, 10.5, 99, False, awaiting, hold=0.0) == [4, 5]  # no hold: as before
    since = 7.232753387141089  # (since + 1.0) - since < 1.0 in floating point: the step model hung on it
    assert batches_to_push(pending, None, since + 1.0, 99, False, {5: since}, hold=1.0) == [4, 5]


def test_a_worker_is_owed_the_batches_its_server_said_it_cuts_more_of_two_behind_at_most():
    owed = owed_after(set(), 5, more=True)
    assert owed == {5}
    owed = owed_after(owed, 6, more=True)
    assert owed == {5, 6}
    assert owed_after(owed, 6, more=False) == {5}  # the last micro-batch of 6 came
    assert owed_after(owed, 8, more=False) == set()  # 5 and 6 are too old to wait for
    assert awaiting_after({5: 1.0, 4: 0.5}, {5, 6}, now=2.0) == {5: 1.0, 6: 2.0}


def test_a_hold_ends_where_batches_to_push_finds_it_over():
    pending = {5: [LEASE], 6: [LEASE]}
    since = 7.232753387141089  # (since + 1.0) - since < 1.0 in floating point
    assert hold_ends({}, pending) is None and hold_ends({4: 0.0}, pending) is None  # 4 is pushed already
    end = hold_ends({5: since, 6: since + 0.5}, pending, hold=1.0)
    assert end == since + 1.0
    assert batches_to_push(pending, None, end, 99, False, {5: since, 6: since + 0.5}, hold=1.0) == [5]
