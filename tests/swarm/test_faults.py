"""Nothing lost (exactly once under churn): volunteers SIGKILLed at every point of the
protocol, and random churn, leave the final parameters equal to `peer reference --delay 1` (which
the same swarm without faults equals: tests/swarm/test_e2e.py); a supervised server SIGKILLed and
forked again, and a server frozen past its failover, lose nothing either. (Servers crashed and
restarted with their own command, lost for good and failed over, or the last of a role: the
objects of `peer serve` in one event loop, tests/swarm/test_hosts.py.)"""

from __future__ import annotations

import csv
import os
import re
import signal

from core.protocol import record_store
from core.protocol.recipe import Recipe
from peer.launcher.processes import child_groups
from peer.volunteer.worker import KILL_POINTS
from tests.swarm.harness import LiveSwarm, no_children_left, reference_run, reference_state, rel_diff, swarm_cli

# where each point occurs: stage 0 has forward-only tasks (outputs go to its BS); the last stage
# has forward+loss+backward tasks that send input gradients
STAGE_OF_POINT = {
    "before_forward": 0,
    "during_forward": 0,
    "after_outputs": 0,
    "pulling_params": 0,
    "mid_grad_push": 0,
    "during_backward": 1,
    "after_input_grads": 1,
    "after_grad_push": 1,
}


STEPS = 6  # of the kill-point and the random-churn runs


# the runs of `peer swarm` as a process here: the tiny model, STEPS steps, quick to notice departures
CLI_ARGS = ("--model", "tiny", "--steps", str(STEPS), "--seed", "0", "--client-timeout", "2")


def tiny_swarm(tmp_path, name: str, steps: int, *extra: str) -> LiveSwarm:
    """A swarm of the tiny model with 2 volunteers, quick to notice departures."""
    return LiveSwarm(
        tmp_path,
        [
            "--model",
            "tiny",
            "--steps",
            str(steps),
            "--volunteers",
            "2",
            "--client-timeout",
            "2",
            "--announce-period",
            "1",
            "--run-id",
            f"{name}-{os.getpid()}",
            *extra,
        ],
    )


def test_every_kill_point_applies_each_micro_batch_exactly_once(tmp_path):
    assert set(STAGE_OF_POINT) == set(KILL_POINTS)
    steps = STEPS
    # only volunteers compute, so the run waits for them; v0 (stage 0) and v1 (stage 1) survive
    live = tiny_swarm(tmp_path, "kill", steps, "--servers-compute", "no", "--volunteer-slowdown", "5")
    died = {}

    def dead(names):
        def check():
            for name in names:
                proc, _ = live.swarm.volunteers[name]
                if proc.poll() is not None:
                    died[name] = proc.returncode
            return all(name in died for name in names)

        return check

    async def scenario():
        await live.start(volunteers=False)
        # The doomed come in two waves and the survivors after them, so that each doomed volunteer
        # meets the work its point needs and no survivor takes it first (started all at once, a
        # doomed volunteer slow to start under load found the 6 steps done by the survivors).
        # 1. the points of stage 0's forward tasks, alone: no stage-1 volunteer, so no backward task
        #    exists and each of them dies at its first task (a death hands its task to the next)
        # 2. the stage-1 points and stage 0's gradient push: the pushing volunteer is stage 0's only
        #    one, so it does the forwards the stage-1 points need, then their backward tasks
        for wave in (
            [p for p, stage in STAGE_OF_POINT.items() if stage == 0 and p != "mid_grad_push"],
            [p for p, stage in STAGE_OF_POINT.items() if stage == 1 or p == "mid_grad_push"],
        ):
            names = [
                live.swarm.start_volunteer(str(STAGE_OF_POINT[p]), name=f"die-{p}", extra=["--die-at", p]) for p in wave
            ]
            await live.wait(dead(names), 300, f"the kill points {wave} to be reached", poll=0.2)
        live.swarm.start_volunteers()
        return await live.finish(steps)

    statuses, state = live.run(scenario)
    assert all(code == -9 for code in died.values()), died
    applied = {st.index: statuses[st.servers[0]]["microbatches_applied"] for st in live.layout.stages}
    assert applied == {0: steps * 4, 1: steps * 4}
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []


# the churn and restart runs train with a schedule and global gradient clipping (every step of the
# tiny model clips at 1.0: its batch gradients' norms are 1.4-2.3): the norm round between the servers
# must survive volunteers killed mid-task and a server restarted from its checkpoint and request log
RECIPE = Recipe(lr=2e-3, schedule="cosine", warmup_steps=2, clip_grad_norm=1.0)


def test_random_churn_equals_the_reference(tmp_path):
    summary, state, _ = swarm_cli(
        tmp_path,
        f"churn-cli-{os.getpid()}",
        *CLI_ARGS,
        "--volunteers",
        "4",
        "--churn",
        "0.5",
        "--volunteer-slowdown",
        "10",
        # the volunteers do all the work, so a step lasts as long as they take and the kills, timed
        # within a step, land inside the run (with the servers computing too, steps 2-5 could pass
        # between two polls of the launcher and the run end before any kill: 1 run in 20); and the
        # launcher, which times the kills by the steps it sees in the servers' records, sees them
        # every second: at the default 3 s the 6 steps passed in two or three reads, the kills
        # scheduled at the last one cancelled by the run's end (2 runs in 6 killed only one)
        "--servers-compute",
        "no",
        "--announce-period",
        "1",
        *RECIPE.flags(),
        "--eval-every",
        "3",
    )
    assert summary["volunteers_killed"] >= 2, summary
    assert summary["microbatches_applied"] == summary["microbatches_expected"], summary
    assert isinstance(summary["duplicates_dropped"], int) and isinstance(summary["requeued"], int), summary
    assert rel_diff(state, reference_state("tiny", STEPS, recipe=RECIPE)) < 1e-5
    # the last stage's first frontal server wrote the training log: a row a step, in CSV and TensorBoard
    all_rows = list(csv.DictReader(open(tmp_path / "work" / "logs" / "train.csv")))
    rows = [r for r in all_rows if not r["val_loss"]]  # (a held-out loss has a row of its own)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert all(abs(float(r["lr"]) - RECIPE.lr_at(int(r["step"]) - 1, STEPS)) < 1e-12 for r in rows)
    assert all(float(r["grad_norm"]) > 1.0 for r in rows)  # (the tiny model's norms: 1.4-2.3, all clipped)
    assert abs(float(rows[-1]["loss"]) - summary["last_loss"]) < 1e-6
    scalars = tensorboard_scalars(tmp_path / "work" / "logs")
    assert sorted(step for step, _ in scalars["train/loss"]) == list(range(1, STEPS + 1))
    assert [round(v, 6) for _, v in sorted(scalars["train/lr"])] == [round(float(r["lr"]), 6) for r in rows]
    # and the held-out loss of versions 3 and 6 (--eval-every 3), as `peer reference --eval-every 3` has it
    want = reference_run(STEPS, RECIPE, eval_every=3)[1]["eval_losses"]
    assert sorted(summary["eval_losses"]) == sorted(want) == ["3", "6"], summary["eval_losses"]
    assert all(abs(summary["eval_losses"][v] - want[v]) < 1e-5 * want[v] for v in want)
    logged = {r["step"]: float(r["val_loss"]) for r in all_rows if r["val_loss"]}
    assert sorted(logged) == ["3", "6"] and all(abs(logged[v] - want[v]) < 1e-5 * want[v] for v in want), logged
    assert sorted(step for step, _ in scalars["train/val_loss"]) == [3, 6]


def tensorboard_scalars(directory) -> dict:
    """{tag: [(step, value)]} of the TensorBoard event files in `directory` (TFRecord framing: a
    length, its CRC, the Event, its CRC; read with tensorboardX's own Event message)."""
    import struct

    from tensorboardX.proto import event_pb2

    out: dict = {}
    for path in directory.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_a_supervised_server_killed_is_forked_again_by_its_supervisor_and_loses_nothing(tmp_path):
    """`--supervise-servers`: the server process of s0b0 (not its supervisor) is SIGKILLed mid-run;
    the supervisor, which kept torch and hivemind imported and holds the DHT node, forks a new one,
    which takes the node's streams over (same peer id, same address), resumes from the checkpoint
    (the version the stalled run had reached, 0 or 1) and replays its request log, and the run ends
    equal to the reference (with the gradient-norm round of RECIPE).

    Mid-run whatever the machine's pace: only volunteers compute, and stage 1's only one dies after
    its first gradient push, so the run stands short of its end until the test starts another
    (killed once s0b0 was seen at version 2 of a run that went on, the kill met a run already at its
    last step on a loaded machine: its status had answered late)."""
    steps = 8
    live = tiny_swarm(tmp_path, "supervised", steps, "--supervise-servers", "--servers-compute", "no", *RECIPE.flags())
    seen = {}

    async def scenario():
        await live.start(volunteers=False)
        live.swarm.start_volunteer("0", name="first0")
        short = live.swarm.start_volunteer("1", name="short1", extra=["--die-at", "after_grad_push"])
        proc, _ = live.swarm.volunteers[short]
        await live.wait(lambda: proc.poll() is not None, 300, "stage 1's volunteer to die after its first push")
        seen["version_at_kill"] = (await live.status("s0b0"))["version"]
        supervisor = live.swarm.servers["s0b0"]
        seen["supervisor"] = supervisor.pid
        seen["workers_before"] = child_groups(supervisor.pid)
        live.swarm.restart_server("s0b0")
        await live.wait(
            lambda: child_groups(supervisor.pid) not in ([], seen["workers_before"]),
            60,
            "the supervisor to fork a new server process",
        )
        seen["workers_after"] = child_groups(supervisor.pid)
        seen["supervisor_alive"] = supervisor.poll() is None
        live.swarm.start_volunteer("1")  # (stage 0's volunteer is still there)
        return await live.finish(steps)

    statuses, state = live.run(scenario)
    assert len(seen["workers_before"]) == 1 and seen["supervisor_alive"], seen
    assert all(s["version"] == steps for s in statuses.values())
    log = (tmp_path / "s0b0.log").read_text(errors="replace")
    assert "was killed by SIGKILL" in log and "restarting it" in log and "resumed from" in log, log[-3000:]
    # the DHT node and its p2p daemon lived on: both server processes announced the same address
    announced = re.findall(r"^initial_peers=(.*)$", log, re.M)
    assert len(announced) == 2 and announced[0] == announced[1], announced
    resumed_at = int(re.search(r"resumed from .* at version (\d+)", log).group(1))
    assert resumed_at <= seen["version_at_kill"] < steps, (seen, log[-3000:])  # it came back mid-run
    assert rel_diff(state, reference_state("tiny", steps, recipe=RECIPE)) < 1e-5
    assert no_children_left(live.args.run_id) == []


def test_a_server_failed_over_while_it_is_frozen_leaves_the_run_when_it_wakes(tmp_path):
    """A server frozen (SIGSTOP of its process group: a suspended laptop, a paused VM) for longer
    than --failover-after is failed over; when it wakes, its own records are of an older layout
    epoch. It finds the later epoch without it in the others' records, exits with code 2 and says
    why, and never announces its older layout as the run's; the run ends equal to the reference.
    (It stayed, a server of no epoch, and so does a restart slower than --failover-after that
    passed the check at its start: then the loss of the stage's other backward server stopped
    the run, found by scripts/soak.py.)"""
    steps = 8
    live = tiny_swarm(tmp_path, "frozen", steps, "--servers-per-stage", "3", "--failover-after", "3")
    out = {}

    async def scenario():
        await live.start()
        await live.wait_server_version("s0f1", 2)
        proc = live.swarm.servers.pop("s0f1")
        live.swarm.volunteers["s0f1-frozen"] = (proc, "none")  # (so that closing the swarm reaps it)
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            # (from a server's own status: while a DHT peer is frozen, reads of the records lag)
            await live.wait_server("s0f0", lambda st: st["epoch"] >= 1, "the failover", timeout=120)
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        await live.wait(lambda: proc.poll() is not None, 120, "the woken server to leave")
        out["code"] = proc.returncode
        result = await live.finish(steps)
        config = await record_store.read_config_value(live.dht)
        out["config_epoch"] = config.get("epoch")
        return result

    statuses, state = live.run(scenario)
    log = (tmp_path / "s0f1.log").read_text(errors="replace")
    assert out["code"] == 2 and "s0f1 was failed over while it was away" in log, log[-2000:]
    assert out["config_epoch"] == 1 and "s0f1" not in statuses
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []
