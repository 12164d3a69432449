"""Checked work (parameter_server/verify.py) on a live swarm of real processes: volunteers that lie
(`peer join --cheat`) are caught by the servers' re-runs and banned, their work is undone by a
rollback epoch, and the run ends equal to `peer reference --delay 1` as if they had never joined."""

from __future__ import annotations

import re

from tests.swarm.harness import reference_state, rel_diff, swarm_cli

STEPS = 10
# the servers do not compute and the volunteers are slowed down, so that every volunteer, the liars
# too, takes work from the first steps on
COMMON = (
    "--model",
    "tiny",
    "--steps",
    str(STEPS),
    "--servers-compute",
    "no",
    "--volunteer-slowdown",
    "8",
    "--client-timeout",
    "3",
    "--announce-period",
    "0.5",
)


def _banned_lines(tmp_path) -> dict[str, str]:
    out = {}
    for log in (tmp_path / "work").glob("cheat*.log"):
        text = log.read_text()
        match = re.search(r"banned from run .*$", text, re.M)
        out[log.stem] = match.group(0) if match else text[-2000:]
    return out


def test_liars_of_every_kind_are_banned_and_the_run_equals_the_clean_one(tmp_path):
    """One liar of each kind from its first task, and one that lies only after 6 honest tasks, past a
    probation of 1 passed check per server (then half of its work is checked): all banned, each with
    the check it failed, and the run ends equal to `peer reference` as if they had never joined (one
    swarm for all five: CI time)."""
    summary, state, _ = swarm_cli(
        tmp_path,
        "cheats",
        *COMMON,
        "--volunteers",
        "2",
        "--probation",
        "1",
        "--verify-rate",
        "0.5",
        "--cheater",
        "scale",
        "--cheater",
        "signflip",
        "--cheater",
        "noise",
        "--cheater",
        "zeros",
        "--cheater",
        "scale@6",
    )
    lines = _banned_lines(tmp_path)
    # each liar is refused with the check it failed, named
    assert len(lines) == 5 and all("banned from run" in line and "relative L2" in line for line in lines.values()), (
        lines
    )
    late = re.search(r"after (\d+) forward and (\d+) backward tasks", lines["cheat4"])
    assert late and int(late.group(1)) + int(late.group(2)) >= 6, lines["cheat4"]  # honest until then
    assert len(summary["banned"]) == 5, summary["banned"]
    assert summary["checks"]["caught"] >= 5 and summary["checks"]["passed"] > 0, summary["checks"]
    # honest re-runs agree far inside the tolerance
    assert summary["max_honest_distance"] < 1e-4
    assert summary["layout_epoch"] >= 1  # the rollbacks travel as layout epochs
    assert summary["microbatches_applied"] == summary["microbatches_expected"]
    # equal to the reference, unless the late liar (past probation, half its work checked) lied on work
    # the sample skipped that is older than the kept versions by the time a lie was caught: then the
    # coordinator says which of its work stays applied (README, "Not handled yet"), never in silence
    stays = [
        line
        for log in (tmp_path / "work").glob("s*.log")
        for line in log.read_text(errors="replace").splitlines()
        if "stays applied" in line
    ]
    diff = rel_diff(state, reference_state("tiny", STEPS))
    assert diff < 1e-5 or stays, diff
