"""Nothing lost (issue "exactly-once under churn"): volunteers SIGKILLed at every point of the
protocol, and random churn, leave the final parameters equal to the fault-free reference."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from safetensors.torch import load_file

from peer.worker import KILL_POINTS
from tests.swarm.harness import LiveSwarm, no_children_left, reference_state, rel_diff

# where each point occurs: stage 0 has forward-only tasks (outputs go to its BS); the last stage
# has forward+loss+backward tasks that send input gradients
STAGE_OF_POINT = {"before_forward": 0, "during_forward": 0, "after_outputs": 0, "pulling_params": 0,
                  "mid_grad_push": 0, "during_backward": 1, "after_input_grads": 1, "after_grad_push": 1}


def test_every_kill_point_applies_each_micro_batch_exactly_once(tmp_path):
    assert set(STAGE_OF_POINT) == set(KILL_POINTS)
    steps = 6
    # only volunteers compute, so the run waits for them; v0 (stage 0) and v1 (stage 1) survive
    live = LiveSwarm(tmp_path, ["--model", "tiny", "--steps", str(steps), "--volunteers", "2", "--servers-compute", "no",
                                "--volunteer-slowdown", "5", "--client-timeout", "2", "--announce-period", "0.5",
                                "--run-id", f"kill-{os.getpid()}"])
    died = {}

    async def scenario():
        await live.start(volunteers=False)
        for point, stage in STAGE_OF_POINT.items():  # the doomed first, so that they are up when work starts
            live.swarm.start_volunteer(str(stage), name=f"die-{point}", extra=["--die-at", point])

        live.swarm.start_volunteers()

        def all_died():
            for name, (proc, _) in live.swarm.volunteers.items():
                if name.startswith("die-") and proc.poll() is not None:
                    died[name] = proc.returncode
            return len(died) == len(KILL_POINTS)

        await live.wait(all_died, 300, "every kill point to be reached", poll=0.2)
        return await live.finish(steps)

    statuses, state = live.run(scenario)
    assert all(code == -9 for code in died.values()), died
    applied = {st.index: statuses[st.servers[0]]["microbatches_applied"] for st in live.layout.stages}
    assert applied == {0: steps * 4, 1: steps * 4}
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []


def test_random_churn_equals_fault_free_run(tmp_path):
    run_id = f"churn-cli-{os.getpid()}"
    out = subprocess.run(
        [sys.executable, "-m", "peer.cli", "swarm", "--model", "tiny", "--steps", "5", "--volunteers", "4",
         "--churn", "0.5", "--seed", "0", "--volunteer-slowdown", "10", "--client-timeout", "2", "--run-id", run_id,
         # the volunteers do all the work, so a step lasts as long as they take and the kills, timed
         # within a step, land inside the run (with the servers computing too, steps 2-5 could pass
         # between two polls of the launcher and the run end before any kill: 1 run in 20)
         "--servers-compute", "no",
         "--no-progress", "--work-dir", str(tmp_path / "work"), "--summary-json", str(tmp_path / "s.json"),
         "--checkpoint-out", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["volunteers_killed"] >= 2, summary
    assert summary["microbatches_applied"] == summary["microbatches_expected"], summary
    state = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert rel_diff(state, reference_state("tiny", 5)) < 1e-5
    assert no_children_left(run_id) == []


def test_servers_killed_and_restarted_resume_without_losing_a_step(tmp_path):
    """A backward server of stage 0 and a frontal server of stage 1 are SIGKILLed mid-run and
    restarted with the same identity and checkpoint dir: each resumes its shard from the checkpoint
    and its buffers, ledger, pools and credits from its request log."""
    steps = 8
    live = LiveSwarm(tmp_path, ["--model", "tiny", "--steps", str(steps), "--volunteers", "2", "--client-timeout", "2",
                                "--announce-period", "0.5", "--run-id", f"restart-{os.getpid()}"])
    restarted_at = {}

    async def scenario():
        await live.start()
        for name, at in (("s0b0", 2), ("s1f0", 4)):
            await live.wait_version(at)
            restarted_at[name] = live.monitor.min_version()
            live.swarm.restart_server(name)
        return await live.finish(steps)

    statuses, state = live.run(scenario)
    assert set(restarted_at) == {"s0b0", "s1f0"}
    assert all(s["version"] == steps for s in statuses.values())
    for name in restarted_at:
        log = (tmp_path / f"{name}.log").read_text(errors="replace")
        assert "resumed from" in log, log[-2000:]
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []
