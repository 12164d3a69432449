"""The worker's book of finished tasks not yet handed in (peer/volunteer/handins.py), alone: what a
call carries, what a call in flight keeps to itself, and what an answer clears."""

from __future__ import annotations

from core.protocol.leases import MAX_COMPLETE
from peer.volunteer.handins import HandIns


def test_a_call_carries_what_no_call_in_flight_carries_and_an_answer_clears_it():
    h = HandIns()
    for i in range(3):
        h.add("s0f0", f"F1.0.0.{i}-1")
    h.add("s0b0", "B1.0.0.0-1")
    first = h.take("s0f0")
    assert first == ["F1.0.0.0-1", "F1.0.0.1-1", "F1.0.0.2-1"]
    assert h.take("s0f0") == []  # a second call while the first is in flight carries none of them
    h.add("s0f0", "F2.0.0.0-1")
    assert h.take("s0f0") == ["F2.0.0.0-1"]  # only what the first call does not carry
    h.release("s0f0", first)  # the first call failed: its tasks are still finished and held
    assert h.listed("s0f0") == ["F1.0.0.0-1", "F1.0.0.1-1", "F1.0.0.2-1", "F2.0.0.0-1"]
    again = h.take("s0f0")
    assert again == ["F1.0.0.0-1", "F1.0.0.1-1", "F1.0.0.2-1"]
    h.release("s0f0", again)
    h.arrived("s0f0", again)  # answered: the server has them
    assert h.listed("s0f0") == ["F2.0.0.0-1"] and sorted(h.devices()) == ["s0b0", "s0f0"]
    h.release("s0f0", ["F2.0.0.0-1"])
    h.arrived("s0f0", ["F2.0.0.0-1"])
    assert h.devices() == ["s0b0"] and h.listed("s0f0") == []
    h.clear()  # a new layout epoch
    assert h.devices() == [] and h.take("s0b0") == []


def test_a_call_carries_at_most_max_complete_tasks():
    h = HandIns()
    for i in range(MAX_COMPLETE + 5):
        h.add("s0f0", f"F1.0.{i}.0-1")
    first, second = h.take("s0f0"), h.take("s0f0")
    assert len(first) == MAX_COMPLETE and len(second) == 5 and not set(first) & set(second)
