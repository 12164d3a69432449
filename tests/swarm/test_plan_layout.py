"""`peer swarm --cluster CLUSTER.json --plan PLAN.json` lays the swarm out as the plan says: each
server and client process takes its device's identity (and so its emulated links and compute),
stages own the plan's uneven layer ranges, an idle device is not started, and the run still equals
`peer reference --delay 1`."""

from __future__ import annotations

import json
import os

from tests.swarm.harness import reference_state, rel_diff, swarm_cli

RELIABLE = ["hostA", "hostB", "hostC", "hostD", "hostE"]
VOLUNTEERS = {"alice": 10.0, "bob": 5.0, "carol": 10.0}  # tflops: bob computes at half speed


def cluster() -> dict:
    n = len(RELIABLE)
    return {
        "reliable": [{"id": r, "tflops": 10.0} for r in RELIABLE],
        "unreliable": [{"id": v, "tflops": f} for v, f in VOLUNTEERS.items()],
        "delay_ms": {
            "reliable": [[0 if i == j else 1.0 for j in range(n)] for i in range(n)],
            "unreliable": [[3.0] * n for _ in VOLUNTEERS],
        },
        "bandwidth_mbps": {
            "reliable": [[0 if i == j else 10_000.0 for j in range(n)] for i in range(n)],
            "unreliable": [[1_000.0] * n for _ in VOLUNTEERS],
        },
    }


PLAN = {
    "stages": [
        {"frontal": ["hostA", "hostE"], "backward": ["hostB"], "clients": ["alice"], "layers": [0, 1]},
        {"frontal": ["hostC"], "backward": ["hostD"], "clients": ["bob"], "layers": [1, 4]},
    ],
    "idle": ["carol"],
}


def test_swarm_laid_out_by_a_plan_takes_its_devices_identities(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps(cluster()))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    work = tmp_path / "work"
    steps = 3
    summary, state, _ = swarm_cli(
        tmp_path,
        f"plan-{os.getpid()}",
        "--model",
        "tiny",
        "--steps",
        str(steps),
        "--cluster",
        str(tmp_path / "cluster.json"),
        "--plan",
        str(tmp_path / "plan.json"),
        # the plan's clients do all the work, so both must join (and stay registered) for the run to end
        "--servers-compute",
        "no",
        timeout=400,
    )
    assert summary["microbatches_applied"] == summary["microbatches_expected"] == steps * 4 * 2, summary
    # the run's layout is the plan's, and each client registered with the stage the plan gave it
    layout = summary["layout"]
    assert [(s["frontal"], s["backward"], s["layers"]) for s in layout["stages"]] == [
        (s["frontal"], s["backward"], s["layers"]) for s in PLAN["stages"]
    ]
    assert summary["volunteers_by_stage"] == {"0": ["alice"], "1": ["bob"]}, summary["volunteers_by_stage"]
    # one process per device of the plan, under its id; the idle device is not started
    logs = {p.stem for p in work.glob("*.log")}
    assert logs == set(RELIABLE) | {"alice", "bob"}, logs
    served = (work / "hostE.log").read_text(errors="replace")
    assert "hostE: serving: stage 0 frontal, layers 0-1" in served, served[-2000:]
    assert "hostC: serving: stage 1 frontal, layers 1-4" in (work / "hostC.log").read_text(errors="replace")
    # the profile's compute: bob has half the fastest device's tflops, so his steps are stretched x2
    assert "on stage 1" in (bob := (work / "bob.log").read_text(errors="replace")) and "stretched x2" in bob, bob[
        -2000:
    ]
    assert "stretched" not in (work / "alice.log").read_text(errors="replace")
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
