"""`peer swarm --cluster CLUSTER.json --plan PLAN.json` lays the swarm out as the plan says: each
server and client process takes its device's identity (and so its emulated links and compute),
stages own the plan's uneven layer ranges, an idle device is not started, and the run still equals
`peer reference --delay 1`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from safetensors.torch import load_file

from tests.swarm.harness import no_children_left, reference_state, rel_diff

RELIABLE = ["hostA", "hostB", "hostC", "hostD", "hostE"]
VOLUNTEERS = {"alice": 10.0, "bob": 5.0, "carol": 10.0}  # tflops: bob computes at half speed


def cluster() -> dict:
    n = len(RELIABLE)
    return {"reliable": [{"id": r, "tflops": 10.0} for r in RELIABLE],
            "unreliable": [{"id": v, "tflops": f} for v, f in VOLUNTEERS.items()],
            "delay_ms": {"reliable": [[0 if i == j else 1.0 for j in range(n)] for i in range(n)],
                         "unreliable": [[3.0] * n for _ in VOLUNTEERS]},
            "bandwidth_mbps": {"reliable": [[0 if i == j else 10_000.0 for j in range(n)] for i in range(n)],
                               "unreliable": [[1_000.0] * n for _ in VOLUNTEERS]}}


PLAN = {"stages": [{"frontal": ["hostA", "hostE"], "backward": ["hostB"], "clients": ["alice"], "layers": [0, 1]},
                   {"frontal": ["hostC"], "backward": ["hostD"], "clients": ["bob"], "layers": [1, 4]}],
        "idle": ["carol"]}


def test_swarm_laid_out_by_a_plan_takes_its_devices_identities(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps(cluster()))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    run_id = f"plan-{os.getpid()}"
    work = tmp_path / "work"
    steps = 3
    out = subprocess.run(
        [sys.executable, "-m", "peer.cli", "swarm", "--model", "tiny", "--steps", str(steps),
         "--cluster", str(tmp_path / "cluster.json"), "--plan", str(tmp_path / "plan.json"), "--run-id", run_id,
         # the plan's clients do all the work, so both must join (and stay registered) for the run to end
         "--servers-compute", "no",
         "--no-progress", "--work-dir", str(work), "--summary-json", str(tmp_path / "s.json"),
         "--checkpoint-out", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["microbatches_applied"] == summary["microbatches_expected"] == steps * 4 * 2, summary
    # the run's layout is the plan's, and each client registered with the stage the plan gave it
    layout = summary["layout"]
    assert [(s["frontal"], s["backward"], s["layers"]) for s in layout["stages"]] == \
        [(s["frontal"], s["backward"], s["layers"]) for s in PLAN["stages"]]
    assert summary["volunteers_by_stage"] == {"0": ["alice"], "1": ["bob"]}, summary["volunteers_by_stage"]
    # one process per device of the plan, under its id; the idle device is not started
    logs = {p.stem for p in work.glob("*.log")}
    assert logs == set(RELIABLE) | {"alice", "bob"}, logs
    served = (work / "hostE.log").read_text(errors="replace")
    assert "serving hostE (stage 0 frontal, layers 0-1)" in served, served[-2000:]
    assert "serving hostC (stage 1 frontal, layers 1-4)" in (work / "hostC.log").read_text(errors="replace")
    # the profile's compute: bob has half the fastest device's tflops, so his steps are stretched x2
    assert "on stage 1" in (bob := (work / "bob.log").read_text(errors="replace")) and "stretched x2" in bob, bob[-2000:]
    assert "stretched" not in (work / "alice.log").read_text(errors="replace")
    state = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(run_id) == []
