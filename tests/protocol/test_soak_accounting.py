"""scripts/soak.py's accounting from the servers' logs: the windows in which a stage had no volunteer
registered, and how long the servers took to drop a SIGKILLed volunteer, both from one read of the
logs (`client_lines`)."""

from __future__ import annotations

import importlib.util
import sys
from datetime import datetime
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
T0 = datetime(2026, 1, 1, 12, 0, 0).timestamp()


def soak():
    sys.path.insert(0, str(SCRIPTS))  # (soak.py imports its neighbour _bench_common)
    try:
        spec = importlib.util.spec_from_file_location("soak_under_test", SCRIPTS / "soak.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def stamp(seconds: float) -> str:
    return datetime.fromtimestamp(T0 + seconds).strftime("%Y-%m-%d %H:%M:%S,%f")[:23]


def test_a_stage_without_a_volunteer_and_the_drops_after_kills_are_read_from_the_server_logs(tmp_path):
    lines = {
        # stage 0: v0 from 1 s to 10 s, v2 from 14 s on (so no volunteer from 10 s to 14 s)
        "s0f0.log": [
            (1.0, "s0f0: client AAAA (v0) registered, compute 100"),
            (10.0, "s0f0: client AAAA left (its connection closed); 2 tasks re-queued"),
            (14.0, "s0f0: client CCCC (v2) registered, compute 100"),
        ],
        "s0b0.log": [
            (1.5, "s0b0: client AAAA (v0) registered, compute 100"),
            (11.0, "s0b0: client AAAA left (its connection closed); 0 tasks re-queued"),
        ],
        # stage 1: v1 all along; a line of another kind, and one without a stamp, are skipped
        "s1f0.log": [
            (2.0, "s1f0: client BBBB (v1) registered, compute 100"),
            (3.0, "s1f0: applied batch 0 -> version 1 (slot 0)"),
        ],
    }
    for name, rows in lines.items():
        text = "".join(f"{stamp(t)} WARN hivepipe.server: {msg}\n" for t, msg in rows)
        (tmp_path / name).write_text(text + "no stamp: client DDDD (v9) registered\n")
    s = soak()
    read = s.client_lines(str(tmp_path))
    assert len(read) == 6
    windows = s.starved_windows(read, T0, end=20.0)
    assert windows == {0: [(0.0, 1.0), (10.0, 14.0)], 1: [(0.0, 2.0)]}
    assert s.overlap(8.0, 16.0, windows[0]) == 4.0
    # v0 was killed at 9 s: s0f0 dropped it 1 s later, s0b0 2 s later (one drop re-queued tasks)
    drops = s.departures(read, T0, [(9.0, "kill v0"), (30.0, "kill v7")])
    assert drops["drops"] == 2 and drops["max_s"] == 2.0 and drops["drops_that_requeued"] == 1
    assert drops["requeued_median_s"] == 1.0


def test_the_stalls_over_three_medians_are_counted_and_those_left_without_a_stage_s_empty_time_listed():
    stalls = soak().stalls_over
    steps = [(10.0, 1.0, 0.0), (20.0, 5.0, 4.0), (30.0, 7.0, 1.0), (40.0, 3.5, 0.0), (50.0, 2.0, 2.0)]
    assert stalls(steps, median=1.0) == {
        "count": 3,  # 5.0, 7.0, 3.5 s
        "with_a_stage_without_volunteer": 2,
        "over_less_that_time": [[30, 7.0, 1.0], [40, 3.5, 0.0]],  # 6.0 and 3.5 s left; 1.0 left at 20 s
    }
    assert stalls([], median=1.0) == {"count": 0, "with_a_stage_without_volunteer": 0, "over_less_that_time": []}


def test_the_volunteers_join_steps_are_read_from_their_logs(tmp_path):
    said = "INFO hivepipe.join: {v}: joined in {t} s: DHT node {d} s, run record 0.10 s, first task {f} s\n"
    (tmp_path / "v0.log").write_text(
        "v0: starting: joining run soak@abc\n"
        + stamp(1.0)
        + " "
        + said.format(v="v0", t="3.10", d="2.00", f="1.00")
        + stamp(9.0)
        + " "
        + said.format(v="v0", t="1.10", d="0.50", f="0.50")  # the process that replaced it
    )
    (tmp_path / "v1.log").write_text(stamp(2.0) + " " + said.format(v="v1", t="5.10", d="4.00", f="1.00"))
    (tmp_path / "s0f0.log").write_text(stamp(2.0) + " " + said.format(v="s0f0", t="9.0", d="9.0", f="0.0"))
    steps = soak().join_steps(str(tmp_path))
    assert steps == {
        "joins": 3,
        "total": [3.1, 3.1],
        "DHT node": [2.0, 2.0],
        "run record": [0.1, 0.1],
        "first task": [1.0, 1.0],
    }
    assert soak().join_steps(str(tmp_path / "none")) is None
