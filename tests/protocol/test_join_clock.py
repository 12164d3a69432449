"""A volunteer's join, step by step (peer/host/join_clock.py), on an injected clock."""

import pytest

from peer.host.join_clock import STEPS, JoinClock


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_each_step_counts_from_the_mark_before_it():
    clock = Clock()
    join = JoinClock(clock)
    for step, seconds in (("dht", 1.5), ("run", 0.25), ("servers", 0.5), ("stage", 2.0), ("compute", 0.125)):
        clock.now += seconds
        join.mark(step)
    assert join.total() is None  # no first task yet
    assert join.said().startswith("joining: DHT node 1.50 s, run record 0.25 s")
    clock.now += 0.5
    join.mark("registered")
    clock.now += 0.25
    join.mark("first_task")  # no warm-up (the servers told no version): the step is left out
    assert join.seconds() == {
        "dht": 1.5,
        "run": 0.25,
        "servers": 0.5,
        "stage": 2.0,
        "compute": 0.125,
        "registered": 0.5,
        "first_task": 0.25,
    }
    assert join.total() == pytest.approx(5.125)
    assert join.said() == (
        "joined in 5.13 s: DHT node 1.50 s, run record 0.25 s, servers' records 0.50 s, stage choice 2.00 s, "
        "compute measured 0.13 s, registered 0.50 s, first task 0.25 s"
    )


def test_a_second_stage_does_not_move_the_marks():
    clock = Clock()
    join = JoinClock(clock)
    clock.now += 1.0
    join.mark("compute")
    clock.now += 9.0
    join.mark("compute")  # a volunteer that moved stage measures again: its join ended long before
    assert join.seconds() == {"compute": 1.0}


def test_an_unknown_step_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown join step 'joined'"):
        JoinClock().mark("joined")
    assert list(STEPS)[0] == "dht" and list(STEPS)[-1] == "first_task"


def test_the_steps_said_add_up_to_the_total_said():
    # eight steps of 4.4 ms: each rounded alone would say 0.00 s eight times beside a total of 0.04 s
    clock = Clock()
    join = JoinClock(clock)
    for step in STEPS:
        clock.now += 0.0044
        join.mark(step)
    said = join.said()
    head, steps = said.split(": ", 1)
    hundredths = [round(float(part.rsplit(" ", 2)[1]) * 100) for part in steps.split(", ")]
    assert head == "joined in 0.04 s"
    assert len(hundredths) == len(STEPS) and sum(hundredths) == 4
