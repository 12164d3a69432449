"""Parts of a volunteer's life: its tally (peer/host/tally.py), whose closing line says the share of
its time since its first task that its passes lasted, and its watch for a better stage
(peer/volunteer/stage_choice.py)."""

from peer.host.tally import Tally


def test_the_tally_adds_the_stages_and_says_the_busy_share_from_the_first_task():
    tally = Tally()
    assert tally.said(now=5.0) == (
        "0 forward and 0 backward tasks done on stage(s) none, 0 of the backward tasks on their kept forward pass"
    )
    tally.add(0, {"forward": 3, "backward": 2, "recompute_avoided": 1, "compute_seconds": 4.0, "param_seconds": 1.5})
    tally.add(1, {"forward": 1, "compute_seconds": 2.0, "param_seconds": 0.5, "first_task": 200.0, "delta_pulls": 7})
    assert tally.stages_worked == [0, 1] and tally.tasks() == "4 forward and 2 backward tasks"
    # the first task was seen on the second stage's worker (the first never got one)
    said = tally.said(now=230.0)
    assert said.endswith(
        "done on stage(s) 0 -> 1, 1 of the backward tasks on their kept forward pass; computing 6.0 s of the "
        "30.0 s since its first task (20%), 2.0 s waiting for parameters (7 shard versions pulled as differences)"
    ), said
    tally.add(0, {"first_task": 100.0})  # a later stage's first task does not move the start
    assert "of the 30.0 s since its first task" in tally.said(now=230.0)


def test_a_volunteer_moves_stage_only_when_fresh_records_say_so_twice():
    """`--stage auto` while it works (StagePicker.better_stage): a move is asked again after a random
    pause and taken only if the fresh records still say so; it looks again within seconds while a
    stage has no compute at all, else every period; leaving ends the watch."""
    import asyncio
    import random
    from types import SimpleNamespace as D

    from peer.volunteer.stage_choice import StagePicker

    def run(decisions, leave_after=None):
        picker = StagePicker.__new__(StagePicker)  # (no links to measure: decisions are scripted)
        script = iter(decisions)
        waits = []

        async def decide(current):
            return next(script)

        async def pause(seconds):
            waits.append(seconds)
            return leave_after is not None and len(waits) > leave_after

        picker.decide = decide
        return asyncio.run(picker.better_stage("v0", 0, 60.0, 7.0, random.Random(0), pause)), waits

    stay_empty = D(moves=False, stay=(1, 0.0))  # a stage with no compute: look again soon
    stay = D(moves=False, stay=(0, 1.0))
    move = D(moves=True, stay=(0, 1.0), stage=1, reason="stage 1 is slower")
    moved, waits = run([stay_empty, move, stay, move, move])
    assert moved == 1
    assert waits[0] == 7.0 and waits[1] == 5.0  # the first look, then soon: a stage had no compute
    assert waits[2] <= 10.0 and waits[3] == 60.0  # asked again after a random pause: it changed its mind
    assert len(waits) == 5  # the second move was confirmed
    assert run([stay, stay, stay], leave_after=2) == (None, [7.0, 60.0, 60.0])
    assert run([move], leave_after=1)[0] is None  # leaving during the pause before asking again
