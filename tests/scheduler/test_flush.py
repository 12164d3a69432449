"""The worker's gradient-flush policy (scheduler/flush.py) driven as a pure function."""
from __future__ import annotations

from scheduler.flush import batches_to_push

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
