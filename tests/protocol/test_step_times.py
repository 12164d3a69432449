"""peer.launcher.monitor.StepTimes: when each version was reached, from the servers' step_times as
a reader that misses records sees them."""

from __future__ import annotations

from peer.launcher.monitor import StepTimes


def test_a_version_is_reached_when_its_last_server_reached_it():
    st = StepTimes()
    st.note("a", {"1": 10.0, "2": 12.0})
    st.note("b", {"1": 10.5, "2": 11.0})
    assert st.completed() == {1: 10.5, 2: 12.0}


def test_records_missed_for_a_while_lose_no_version():
    """A reader that missed the records announced while versions 2-4 were reached still learns
    their times from a later record (it carries the last 16): no pause-then-jump."""
    st = StepTimes()
    st.note("a", {"1": 10.0})
    st.note("a", {str(v): 10.0 + 2 * (v - 1) for v in range(1, 6)})
    assert st.completed() == {1: 10.0, 2: 12.0, 3: 14.0, 4: 16.0, 5: 18.0}


def test_a_version_applied_again_keeps_its_first_time_and_junk_is_skipped():
    st = StepTimes()
    st.note("a", {"7": 70.0})
    st.note("a", {"7": 75.0, "8": 80.0})  # replayed after a restart: the first time stands
    st.note("a", {"x": 1.0, "9": "soon"})
    st.note("a", None)
    assert st.completed() == {7: 70.0, 8: 80.0}
