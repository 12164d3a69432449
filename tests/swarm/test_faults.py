"""Nothing lost (issue "exactly-once under churn"): volunteers SIGKILLed at every point of the
protocol, and random churn, leave the final parameters equal to `peer reference --delay 1` (which
the same swarm without faults equals: tests/swarm/test_e2e.py); servers restarted from their
checkpoints, or lost for good and failed over, lose nothing either."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import signal
import subprocess
import sys

from peer.launcher.processes import child_groups
from peer.protocol import records
from peer.volunteer.worker import KILL_POINTS
from tests.swarm.harness import LiveSwarm, no_children_left, reference_state, rel_diff, swarm_cli

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
    )
    assert summary["volunteers_killed"] >= 2, summary
    assert summary["microbatches_applied"] == summary["microbatches_expected"], summary
    assert isinstance(summary["duplicates_dropped"], int) and isinstance(summary["requeued"], int), summary
    assert rel_diff(state, reference_state("tiny", STEPS)) < 1e-5


def test_a_volunteer_killed_holding_a_task_is_noticed_when_its_connection_closes(tmp_path):
    """With --client-timeout 600 (silence would not do it), a volunteer that SIGKILLs itself (with
    its DHT process and p2p daemon) in the middle of a forward task is dropped once its connection
    closes, its lease re-queued at once, and the run ends equal to the reference."""
    steps = 3
    live = tiny_swarm(
        tmp_path,
        "disconnect",
        steps,
        "--servers-compute",
        "no",
        "--volunteer-slowdown",
        "5",
        "--client-timeout",
        "600",
        "--task-timeout",
        "600",
    )
    died = {}

    async def scenario():
        await live.start(volunteers=False)
        # the doomed volunteer is stage 0's only compute until it dies, so it takes the first task
        # (started beside it, v0 once did all 12 tasks of the run first)
        live.swarm.start_volunteer("0", name="die-mid-forward", extra=["--die-at", "during_forward"])
        live.swarm.start_volunteer("1", name="v1")

        def dead():
            proc, _ = live.swarm.volunteers["die-mid-forward"]
            if proc.poll() is not None:
                died["code"] = proc.returncode
            return "code" in died

        await live.wait(dead, 300, "the doomed volunteer to die", poll=0.2)
        live.swarm.start_volunteer("0", name="v0")
        return await live.finish(steps)

    statuses, state = live.run(scenario)
    assert died["code"] == -9
    stage0 = [statuses[d]["counters"] for d in live.layout.stages[0].servers]
    assert sum(c.get("clients_disconnected", 0) for c in stage0) >= 1, stage0
    assert sum(c.get("clients_timed_out", 0) for c in stage0) == 0, stage0
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []


def test_servers_killed_and_restarted_resume_without_losing_a_step(tmp_path):
    """A backward server of stage 0 and a frontal server of stage 1 are SIGKILLed mid-run and
    restarted with the same identity and checkpoint dir: each resumes its shard from the checkpoint
    and its buffers, ledger, pools and credits from its request log."""
    steps = 8
    live = tiny_swarm(tmp_path, "restart", steps)
    restarted_at = {}

    async def scenario():
        await live.start()
        for name, at in (("s0b0", 2), ("s1f0", 4)):
            await live.wait_server_version(name, at)
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


def test_a_supervised_server_killed_is_forked_again_by_its_supervisor_and_loses_nothing(tmp_path):
    """`--supervise-servers`: the server process of s0b0 (not its supervisor) is SIGKILLed mid-run;
    the supervisor, which kept torch and hivemind imported and holds the DHT node, forks a new one,
    which takes the node's streams over (same peer id, same address), resumes from the checkpoint
    and request log, and the run ends equal to the reference."""
    steps = 8
    live = tiny_swarm(tmp_path, "supervised", steps, "--supervise-servers")
    seen = {}

    async def scenario():
        await live.start()
        await live.wait_server_version("s0b0", 2)
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
    assert resumed_at < steps, log[-3000:]  # it came back mid-run, and the run waited for it
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []


def test_a_server_lost_for_good_is_failed_over_and_nothing_is_lost(tmp_path):
    """`peer swarm --servers-per-stage 4` (two frontal and two backward servers per stage) SIGKILLs
    the frontal server that builds the batches (and would coordinate failovers) once the run reaches
    step 2, and a backward server of stage 1 at step 4 (after the first failover), for good. The
    remaining servers notice each loss in the DHT, the first remaining one makes a new layout epoch
    (the lost shard hosted by the server that kept its replica, the rows re-segmented, unapplied
    batches run again), volunteers and servers adopt it, and the run ends equal to the reference."""
    steps = 7
    summary, state, _ = swarm_cli(
        tmp_path,
        f"failover-{os.getpid()}",
        "--model",
        "tiny",
        "--steps",
        str(steps),
        "--volunteers",
        "2",
        "--servers-per-stage",
        "4",
        "--lose-server",
        "s0f0@2",
        "--lose-server",
        "s1b1@4",
        "--failover-after",
        "3",
        "--announce-period",
        "1",
        "--client-timeout",
        "2",
    )
    assert summary["layout_epoch"] == 2, summary
    assert summary["microbatches_applied"] == summary["microbatches_expected"], summary
    logs = {name: (tmp_path / "work" / f"{name}.log").read_text(errors="replace") for name in ("s0f1", "s1f0")}
    assert "took over shard slot 0" in logs["s0f1"] and "took over shard slot 3" in logs["s1f0"], logs
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5


def test_a_failed_over_server_that_comes_back_is_refused_and_training_goes_on(tmp_path):
    """A backward server of stage 0 is lost for good; as soon as the others have failed it over, the
    server that took its shard slot over (s0b1, which held its replica) is SIGKILLed, before a step
    of the new epoch, and restarted from its checkpoint, which holds both slots (the adopted one was
    written before it was served), and takes the slot over again from it; then the lost server is
    started again (same identity and checkpoint dir): it finds the run's layout epoch without it and
    exits with code 2 and the reason, and the run ends equal to the reference."""
    steps = 8
    live = tiny_swarm(tmp_path, "comeback", steps, "--servers-per-stage", "4", "--failover-after", "3")
    back = {}

    async def scenario():
        await live.start()
        await live.wait_server_version("s0b0", 2)
        live.swarm.lose_server("s0b0")
        adopted = await live.wait_server("s0b1", lambda st: st["epoch"] >= 1, "the failover", timeout=120)
        # right after adopting the slot, before a step of the new epoch: the slot is in its
        # checkpoint already (written before the epoch was logged or served)
        back["restarted_at"] = adopted["version"]
        live.swarm.restart_server("s0b1")
        proc = live.swarm._spawn("s0b0-again", live.swarm.server_argv["s0b0"])
        live.swarm.volunteers["s0b0-again"] = (proc, "none")  # (so that closing the swarm reaps it)
        await live.wait(lambda: proc.poll() is not None, 120, "the returning server to exit")
        back["code"] = proc.returncode
        return await live.finish(steps)

    statuses, state = live.run(scenario)
    log = (tmp_path / "s0b0-again.log").read_text(errors="replace")
    assert back["code"] == 2 and "s0b0 was failed over" in log, log[-2000:]
    took_over = (tmp_path / "s0b1.log").read_text(errors="replace")
    assert back["restarted_at"] < steps and "resumed from" in took_over, took_over[-2000:]
    assert took_over.count("took over shard slot 2") == 2, took_over[-3000:]  # at the failover, and in the replay
    # restarted in epoch 1, it does not wait for the lost server (it did, 120 s, then crashed)
    restarted = took_over[took_over.rindex("initial_peers=") :]
    assert "Traceback" not in took_over and "s0b1: serving: " in restarted, took_over[-3000:]
    assert live.monitor.epoch == 1 and "s0b0" not in statuses
    applied = {st.index: statuses[st.servers[0]]["microbatches_applied"] for st in live.monitor.layout.stages}
    assert applied == {0: steps * 4, 1: steps * 4}
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []


def test_a_server_lost_before_the_first_step_is_failed_over(tmp_path):
    """Replicas used to be sent only after a step, so a server lost before the run's first step
    could not be failed over ("no remaining server of stage 0 holds a replica", found by the soak
    with an early loss): each server now sends its slots to its next server when the run comes
    online. s0b1 is lost before any volunteer joins (servers do not compute), its next server s0f0
    takes its slot over at version 0, and the run ends equal to the reference. The volunteers join
    once the run config carries layout epoch 1, and start in it: no server refuses their requests
    as of a stale epoch (they used to start at epoch 0 whatever the config said, and every volunteer
    that joined after a failover was refused once before it fetched the layout)."""
    steps = 4
    live = tiny_swarm(
        tmp_path, "early", steps, "--servers-per-stage", "4", "--failover-after", "3", "--servers-compute", "no"
    )

    async def scenario():
        await live.start(volunteers=False)

        async def replica_held():
            return (await live.status("s0f0"))["replicas"].get("3") == 0

        await live.wait(lambda: live.monitor.all_online(), 120, "the servers to come online")
        await live.wait(replica_held, 60, "s0f0 to hold s0b1's slot at version 0")
        live.swarm.lose_server("s0b1")
        await live.wait_server("s0f0", lambda st: st["epoch"] >= 1, "the failover", timeout=120)

        async def config_at_epoch_1():
            config = await records.read_config_value(live.dht)
            return isinstance(config, dict) and config.get("epoch") == 1

        await live.wait(config_at_epoch_1, 60, "the run config to carry layout epoch 1", poll=0.5)
        live.swarm.start_volunteers()
        return await live.finish(steps)

    statuses, state = live.run(scenario)
    log = (tmp_path / "s0f0.log").read_text(errors="replace")
    assert "took over shard slot 3 at version 0" in log, log[-2000:]
    # a worker refused as of a stale epoch fetches the layout and says so (at WARNING)
    refreshed = [
        line
        for f in sorted(glob.glob(str(tmp_path / "v*.log")))
        for line in open(f, errors="replace")
        if ": layout epoch " in line
    ]
    assert glob.glob(str(tmp_path / "v*.log")) and refreshed == [], refreshed[:5]
    assert "s0b1" not in statuses
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
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
    live = tiny_swarm(tmp_path, "frozen", steps, "--servers-per-stage", "4", "--failover-after", "3")
    out = {}

    async def scenario():
        await live.start()
        await live.wait_server_version("s0b0", 2)
        proc = live.swarm.servers.pop("s0b0")
        live.swarm.volunteers["s0b0-frozen"] = (proc, "none")  # (so that closing the swarm reaps it)
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            # (from a server's own status: while a DHT peer is frozen, reads of the records lag)
            await live.wait_server("s0f0", lambda st: st["epoch"] >= 1, "the failover", timeout=120)
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        await live.wait(lambda: proc.poll() is not None, 120, "the woken server to leave")
        out["code"] = proc.returncode
        result = await live.finish(steps)
        config = await records.read_config_value(live.dht)
        out["config_epoch"] = config.get("epoch")
        return result

    statuses, state = live.run(scenario)
    log = (tmp_path / "s0b0.log").read_text(errors="replace")
    assert out["code"] == 2 and "s0b0 was failed over while it was away" in log, log[-2000:]
    assert out["config_epoch"] == 1 and "s0b0" not in statuses
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []


def test_the_loss_of_a_roles_last_server_stops_the_run_until_it_comes_back(tmp_path):
    """Stage 1 has one backward server. SIGKILLed at step 2 and kept away past --failover-after, it
    cannot be failed over: every server, every volunteer and the dashboard say that the run is
    stopped and why (one line, not one per attempt). Restarted from its checkpoint, it brings the
    run back, which ends equal to the reference and says so."""
    steps = 8
    live = tiny_swarm(tmp_path, "halt", steps, "--failover-after", "3")
    said = "run stopped: stage 1 has no backward server (s1b0 gone)"
    out = {}

    def others() -> dict[str, str]:
        return {
            os.path.basename(f)[:-4]: open(f, errors="replace").read()
            for f in glob.glob(str(tmp_path / "*.log"))
            if not f.endswith("s1b0.log")
        }

    async def scenario():
        await live.start()
        await live.wait_server_version("s1b0", 2)
        live.swarm.lose_server("s1b0")
        await live.wait(
            lambda: all(said in log for log in others().values()), 120, "every other peer to say the run stopped"
        )
        dash = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "dashboard.py"),
                "--initial-peers",
                *live.swarm.maddrs,
                "--run-id",
                f"{live.args.run_id}@{live.swarm.run_fp}",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        out["dashboard"] = dash
        out["stopped_at"] = live.monitor.min_version()
        await asyncio.sleep(5.0)  # stopped a while: no line per attempt
        live.swarm.bring_back("s1b0")
        done = await live.finish(steps)
        # the last steps can take less time than a volunteer's next read of the records: every peer
        # (they stay up until the swarm is closed) says so within seconds of it, not before the end
        await live.wait(
            lambda: all("the run goes on again after" in log for log in others().values()),
            60,
            "every other peer to say the run goes on",
        )
        return done

    statuses, state = live.run(scenario)
    snap = json.loads(out["dashboard"].stdout)
    assert snap["health"]["status"] == "stopped" and said in snap["health"]["stopped"], snap["health"]
    assert {"stage": 1, "reason": "no live backward server"} in snap["health"]["blocking"]
    logs = others()
    assert {"s0f0", "s0b0", "s1f0"} <= set(logs) and sum(n.startswith("v") for n in logs) == 2, sorted(logs)
    for name, log in logs.items():
        assert log.count(said) == 1, (name, log[-3000:])  # said once (the next would come after a minute)
        assert "the run goes on again after" in log, (name, log[-3000:])
    assert out["stopped_at"] < steps
    assert "resumed from" in (tmp_path / "s1b0.log").read_text(errors="replace")
    assert all(s["version"] == steps for s in statuses.values())
    assert rel_diff(state, reference_state("tiny", steps)) < 1e-5
    assert no_children_left(live.args.run_id) == []
