"""A run's life with the objects `peer serve` and `peer join` run (peer.host.ServerHost and
VolunteerSession), every peer in this test's event loop on a real DHT node and p2p daemon of its own
(tests/swarm/hosts.py): the end said by every peer, a restart that finds the run through the peers it
kept, a server lost for good failed over, a failed-over server that comes back refused, the loss
of a role's last server stopping the run until it is back, and a volunteer crashed while it holds a
task dropped when its connection closes. Each run ends equal to the reference."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from pathlib import Path

import pytest

from tests.swarm import hosts
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.hosts import FOUR_A_STAGE, TWO_STAGES, HostRun, device, servers_of

pytestmark = pytest.mark.swarm
REPO = Path(__file__).resolve().parents[2]


def play(scenario, timeout: float = 900.0):
    return hosts.play(scenario, timeout)


def test_every_peer_says_the_end_and_returns_by_itself(tmp_path, capsys):
    """Two stages, the servers not computing, two volunteers that join before the second stage's
    servers are up: every server says `run R finished at step N (loss L)`, writes its checkpoint and
    returns 0; every volunteer says the run is over with what it did and returns 0; a volunteer that
    comes after the end says so and returns 0."""
    steps = 4
    run = HostRun(tmp_path, "ends", steps, TWO_STAGES, ["--no-compute"])
    out = {}

    async def scenario():
        try:
            first = await run.first_server([*device(0, "frontal"), "--hold"])
            run.start_server(device(0, "backward"))
            await run.wait(lambda: "s1f0" in first.state.detail, 60, "s0f0 to wait for the second stage")
            run.join("v0", "0")
            run.join("v1", "1")
            run.start_server(device(1, "frontal"))
            run.start_server(device(1, "backward"))
            out["codes"] = await run.ended(["s0b0", "s1f0", "s1b0", "v0", "v1"])
            out["progress"] = run.servers["s1f0"].report.progress_text()  # what its progress line said last
            await run.wait(lambda: "holding its final state" in first.state.detail, 30, "s0f0 to hold")
            out["state"] = run.state()
            run.join("late", "0")
            out["late"] = await run.ended(["late"], timeout=60)
            run.stops["s0f0"].set()  # (SIGTERM)
            out["held"] = await run.ended(["s0f0"], timeout=30)
        finally:
            await run.close()

    play(scenario)
    assert out["codes"] == {"s0b0": 0, "s1f0": 0, "s1b0": 0, "v0": 0, "v1": 0}, out["codes"]
    assert out["held"] == {"s0f0": 0} and out["late"] == {"late": 0}
    # the last stage's loss per token, tokens/s and the time left over its last versions
    assert re.match(
        rf"^step {steps}/{steps}, loss \d\.\d{{4}}, [\d,]+ tokens/s, about 0 s left, \d+ volunteers here$",
        out["progress"],
    ), out["progress"]
    for name in ("s0f0", "s0b0", "s1f0", "s1b0"):
        text = run.said[name].getvalue()
        assert re.search(rf"^{name}: finished: run ends finished at step {steps} \(loss \d+\.\d+\)$", text, re.M), text
        assert (tmp_path / "checkpoints" / f"{name}.shard.pt").exists()
    said_s0f0 = run.said["s0f0"].lines()
    assert any(re.search(r"waiting: for the run.s servers .*s1f0 s1b0", line) for line in said_s0f0), said_s0f0
    for name in ("v0", "v1"):
        text = run.said[name].getvalue()
        assert re.search(rf"finished: run ends is over at step {steps}: \d+ forward and \d+ backward tasks", text), text
        # and how busy it was: its passes' seconds over its time since its first task
        busy = re.search(
            r"computing ([\d.]+) s of the ([\d.]+) s since its first task \((\d+)%\), ([\d.]+) s wait", text
        )
        assert busy is not None, text
        computing, span, share, waiting = (float(x) for x in busy.groups())
        assert 0 < computing <= span and computing + waiting <= span + 0.1, busy.group(0)
        assert abs(share - 100 * computing / span) <= 1 + 100 * 0.05 / span, busy.group(0)  # (rounding)
    assert f"run ends already finished at step {steps}: nothing to do" in run.said["late"].getvalue()
    assert rel_diff(out["state"], reference_state("tiny", steps)) < 1e-5
    # what lasts: each server's run summary in its checkpoint folder, read back by `peer summary`
    import json

    from peer.cli import main

    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("*.run-summary.json")) == [
        f"{d}.run-summary.json" for d in ("s0b0", "s0f0", "s1b0", "s1f0")
    ]
    capsys.readouterr()  # (what the in-process peers printed: their initial_peers= and run= lines)
    assert main(["summary", str(ckpt), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert (
        merged["run_id"] == "ends"
        and merged["steps"] == steps
        and merged["servers"] == ["s0b0", "s0f0", "s1b0", "s1f0"]
    )
    assert merged["microbatches_applied"] == steps * 4 * 2 and 1.0 < merged["loss"] < 7.0, merged
    by_device = {v["device"]: v for v in merged["volunteers"].values()}
    # the servers do not compute (--no-compute): every task was a volunteer's; the late one did none
    assert set(by_device) == {"v0", "v1"} and all(v["tasks"] > 0 and v["banned"] is None for v in by_device.values())
    assert main(["summary", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"run ends: finished at step {steps}, loss ") and "volunteers (2):" in text, text


def test_a_reader_that_saw_the_run_finds_it_again_when_its_initial_peer_is_gone(tmp_path):
    """The dashboard's reader, given only the first server's address, has read the run; the first
    server crashes (its DHT process SIGKILLed). The reader still finds the run, through the other
    servers. (On one machine libp2p's own peer routing finds them; where it does not, on the deploy
    page's hosts, the reader reaches the servers its records named, at their announced addresses:
    DhtReader.fetch.)"""
    from peer.dashboard.reader import DhtReader

    run = HostRun(tmp_path, "seen", 1000, TWO_STAGES)
    out = {}

    async def scenario():
        reader = None
        try:
            await run.start_servers(servers_of(1))
            await run.wait_version("s1b0", 1)
            reader = await asyncio.to_thread(DhtReader, run.initial, "seen", run.run_fp, 30)
            config, stages = await asyncio.to_thread(reader.fetch)
            out["before"] = config is not None and all(stages)
            out["known"] = len(reader.known)
            await run.crash("s0f0")  # the reader's only initial peer
            config, stages = await asyncio.to_thread(reader.fetch)
            out["after"] = config is not None, sorted(r["device"] for st in stages for r in (st or {}).values())
        finally:
            if reader is not None:
                await asyncio.to_thread(reader.shutdown)
            await run.close()

    play(scenario)
    assert out["before"] and out["known"] == 4, out
    config_found, devices = out["after"]
    assert config_found and {"s0b0", "s1f0", "s1b0"} <= set(devices), out


def logged(caplog, *words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if all(w in r.getMessage() for w in words)]


@pytest.mark.stress
def test_servers_crashed_and_restarted_with_their_own_command_resume_without_losing_a_step(tmp_path, caplog):
    """s0b0 at step 2 and s1f0 at step 4 crash (their DHT processes SIGKILLed) and are started again
    with the command they were started with, less --initial-peers, as an operator would: each joins
    the run through the peers it kept in its checkpoint folder (the DHT does not split), resumes its
    shard from the checkpoint and the rest from its request log, and the run ends equal to the
    reference."""
    caplog.set_level(logging.INFO, logger="hivepipe")
    steps = 7
    run = HostRun(tmp_path, "restart", steps, TWO_STAGES)
    out = {}

    async def scenario():
        try:
            await run.start_servers(servers_of(1))
            for name, flags, at in (("s0b0", device(0, "backward"), 2), ("s1f0", device(1, "frontal"), 4)):
                await run.wait_version(name, at)
                await run.crash(name)
                run.restart(flags)
            out["codes"] = await run.ended()
            out["state"] = run.state()
        finally:
            await run.close()

    play(scenario)
    assert out["codes"] == dict.fromkeys(("s0f0", "s1b0", "s0b0", "s1f0"), 0), out["codes"]
    for name in ("s0b0", "s1f0"):
        assert logged(caplog, f"{name}: joining the run through the", "peers it knew before"), name
        assert logged(caplog, f"{name} resumed from"), name
    assert rel_diff(out["state"], reference_state("tiny", steps)) < 1e-5


def test_the_loss_of_a_roles_last_server_stops_the_run_until_it_comes_back(tmp_path):
    """Stage 1 has one backward server. Crashed at step 2 and kept away past --failover-after, it
    cannot be failed over: every other server, the volunteer and the dashboard say that the run is
    stopped and why, once. Restarted with its own command, it brings the run back, which every peer
    says, and the run ends equal to the reference."""
    steps = 6
    run = HostRun(tmp_path, "halt", steps, TWO_STAGES, ["--failover-after", "3"])
    said = "run stopped: stage 1 has no backward server (s1b0 gone)"
    out = {}

    def others():
        return {name: text.getvalue() for name, text in run.said.items() if name != "s1b0"}

    async def scenario():
        try:
            await run.start_servers(servers_of(1))
            run.join("v0", "1")
            await run.wait_version("s1b0", 2)
            await run.crash("s1b0")
            await run.wait(lambda: all(said in t for t in others().values()), 120, "every other peer to say it")
            # v0 reads the stop in every record from now on, as it does when the run goes on and ends
            # within the 3 announce periods a stopped server's record stays fresh: it learns the end
            # while it still counts the run stopped, and must say that the run went on (it said
            # "stopped" then "finished" once, in 1 of 3 clean-clone runs)
            v0 = run.volunteers["v0"]
            v0.directory.halted = lambda period, reason=v0.halt.reason: reason
            dash = await asyncio.create_subprocess_exec(
                sys.executable,
                str(REPO / "scripts" / "dashboard.py"),
                "--json",
                "--run-id",
                f"halt@{run.run_fp}",
                "--initial-peers",
                *run.initial,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            out["dashboard"] = json.loads((await asyncio.wait_for(dash.communicate(), 120))[0])
            out["stopped_at"] = min(h.server.version for h in run.servers.values())
            await asyncio.sleep(3.0)  # stopped a while: no line per attempt
            run.restart(device(1, "backward"))
            out["codes"] = await run.ended()
            out["state"] = run.state()
        finally:
            await run.close()

    play(scenario)
    health = out["dashboard"]["health"]
    assert health["status"] == "stopped" and said in health["stopped"], health
    assert {"stage": 1, "reason": "no live backward server"} in health["blocking"]
    assert out["stopped_at"] < steps
    assert out["codes"] == dict.fromkeys(("s0f0", "s0b0", "s1f0", "v0", "s1b0"), 0), out["codes"]
    for name, text in others().items():
        assert text.count(said) == 1, f"{name} said:\n{text}"
        assert "the run goes on again after" in text, f"{name} said:\n{text}"
    assert rel_diff(out["state"], reference_state("tiny", steps)) < 1e-5


def online(run: HostRun) -> bool:
    return all(h.announcer is not None and h.announcer.online.is_set() for h in run.servers.values())


@pytest.mark.stress
def test_servers_lost_before_the_first_step_and_mid_run_are_failed_over(tmp_path, caplog):
    """Two frontal and two backward servers a stage, the servers not computing. s0b1 is lost before
    any volunteer joins (its next server holds its slot from when the run came online): s0f0 takes it
    over at version 0. The volunteers join once the run config carries layout epoch 1 and start in
    it (none is refused as of a stale epoch). Then s0f0, which builds the batches and coordinated
    the first failover, is lost at step 2: the first remaining server fails it over (layout epoch 2),
    and the run ends equal to the reference."""
    from core.protocol import record_store

    caplog.set_level(logging.INFO, logger="hivepipe")
    steps = 5
    run = HostRun(tmp_path, "failover", steps, FOUR_A_STAGE, ["--failover-after", "3", "--no-compute"])
    out = {}

    async def scenario():
        try:
            first = await run.start_servers(servers_of(2))
            await run.wait(lambda: online(run), 120, "the servers to come online")
            await run.wait(lambda: first.server.replicas.get(3) is not None, 60, "s0f0 to hold s0b1's slot")
            await run.crash("s0b1")
            await run.wait(lambda: first.server.epoch >= 1, 120, "the first failover")

            async def config_epoch(epoch: int) -> bool:
                config = await record_store.read_config_value(run.servers["s1f0"].dht)
                return isinstance(config, dict) and config.get("epoch") == epoch

            await run.wait(lambda: config_epoch(1), 60, "the run config to carry layout epoch 1", poll=0.5)
            run.join("v0", "0")
            run.join("v1", "1")
            await run.wait_version("s1f0", 2)
            await run.crash("s0f0")
            await run.wait(lambda: run.servers["s1f0"].server.epoch >= 2, 120, "the second failover")
            out["codes"] = await run.ended()
            out["state"] = run.state()
            out["epoch"] = {d: h.server.epoch for d, h in run.servers.items()}
        finally:
            await run.close()

    play(scenario)
    assert logged(caplog, "s0f0: took over shard slot 3 at version 0")
    assert logged(caplog, "took over shard slot 0 at version")  # (s0f0's own slot, by the server after it)
    assert [m for v in ("v0", "v1") for m in logged(caplog, f"{v}: layout epoch 1 ")] == []
    assert set(out["epoch"].values()) == {2}, out["epoch"]
    assert out["codes"] == dict.fromkeys(("s0b0", "s1f0", "s1f1", "s1b0", "s1b1", "s0f1", "v0", "v1"), 0)
    assert rel_diff(out["state"], reference_state("tiny", steps)) < 1e-5


@pytest.mark.stress
def test_a_failed_over_server_that_comes_back_is_refused_and_its_successor_restarts_with_the_slot(tmp_path, caplog):
    """s0b0 is lost at step 2; as soon as s0b1 (which held its replica) has taken its slot over, s0b1
    crashes too, before a step of the new epoch, and is restarted with its own command: its checkpoint
    holds both slots, and it takes the slot over again from its log, without waiting for the lost
    server. Then s0b0 is started again with its own command: it finds the run's layout without it
    and ends with the reason (exit 2). The run ends equal to the reference."""
    caplog.set_level(logging.INFO, logger="hivepipe")
    steps = 6
    run = HostRun(tmp_path, "comeback", steps, FOUR_A_STAGE, ["--failover-after", "3"])
    out = {}

    async def scenario():
        try:
            await run.start_servers(servers_of(2))
            await run.wait_version("s0b0", 2)
            await run.crash("s0b0")
            successor = run.servers["s0b1"]
            await run.wait(lambda: successor.server.epoch >= 1, 120, "the failover")
            out["restarted_at"] = successor.server.version
            await run.crash("s0b1")
            run.restart(device(0, "backward", 1))
            run.restart(device(0, "backward", 0))
            out["back"] = await run.ended(["s0b0"], timeout=120)
            out["codes"] = await run.ended()
            out["state"] = run.state()
        finally:
            await run.close()

    play(scenario)
    assert out["back"] == {"s0b0": 2} and "s0b0 was failed over" in run.errors["s0b0"], run.errors
    assert out["restarted_at"] < steps
    assert len(logged(caplog, "s0b1: took over shard slot 2")) == 2  # at the failover, and in the replay
    assert logged(caplog, "s0b1 resumed from")
    assert "s0b1: serving: " in run.said["s0b1"].getvalue()  # (it did not wait for the lost server)
    assert out["codes"] == dict.fromkeys(("s0f0", "s0f1", "s1f0", "s1f1", "s1b0", "s1b1", "s0b1", "s0b0"), 0) | {
        "s0b0": 2
    }
    assert rel_diff(out["state"], reference_state("tiny", steps)) < 1e-5


def test_a_volunteer_crashed_holding_a_task_is_noticed_when_its_connection_closes(tmp_path):
    """With --client-timeout and --task-timeout 600 (silence would not do it), a volunteer whose host
    dies (its DHT process SIGKILLed, its p2p daemon with it) while it holds a forward task is dropped
    once its connection closes, its lease re-queued at once, and the run ends equal to the reference."""
    steps = 3
    flags = ["--no-compute", "--client-timeout", "600", "--task-timeout", "600"]
    run = HostRun(tmp_path, "disconnect", steps, TWO_STAGES, flags, 0.5)
    out = {}

    async def scenario():
        try:
            await run.start_servers(servers_of(1))
            # the doomed volunteer is stage 0's only compute until it dies, so it takes the first task
            doomed = run.join("doomed", "0", "--slowdown", "5")
            run.join("v1", "1", "--slowdown", "5")

            def holding():
                worker = doomed.worker
                return worker is not None and worker.current is not None and worker.current[1].startswith("F")

            await run.wait(holding, 180, "the doomed volunteer to hold a forward task")
            await run.crash("doomed")
            run.join("v0", "0")
            out["codes"] = await run.ended(timeout=300)
            out["counters"] = {d: dict(h.server.counters) for d, h in run.servers.items()}
            out["state"] = run.state()
        finally:
            await run.close()

    play(scenario)
    assert out["codes"] == dict.fromkeys(["s0f0", "s0b0", "s1f0", "s1b0", "v1", "v0"], 0), out["codes"]
    stage0 = [out["counters"][d] for d in ("s0f0", "s0b0")]
    assert sum(c.get("clients_disconnected", 0) for c in stage0) >= 1, stage0
    assert sum(c.get("clients_timed_out", 0) for c in stage0) == 0, stage0
    assert rel_diff(out["state"], reference_state("tiny", steps)) < 1e-5


@pytest.mark.stress
def test_a_second_server_with_a_live_servers_identity_is_refused_even_when_hivemind_misses_it(tmp_path, monkeypatch):
    """s0b0 serves (waiting for the rest of the run); a second `peer serve` of s0b0 with the same
    identity file joins through s0f0 while hivemind's own check at start misses the holder (patched to
    say the identity is free, as it sometimes does under load): the run's records show the live
    holder re-announcing, and the second one ends with the reason (exit 2) before it announces
    anything."""
    from hivemind.p2p import P2P

    async def missed(cls, identity_path, **kwargs):  # (runs in the DHT's forked process)
        return False

    monkeypatch.setattr(P2P, "is_identity_taken", classmethod(missed))
    run = HostRun(tmp_path, "twin", 3, TWO_STAGES)
    twin_run = HostRun(tmp_path, "twin", 3, TWO_STAGES)
    out = {}

    async def scenario():
        try:
            first = await run.first_server(device(0, "frontal"))
            holder = run.start_server(device(0, "backward"))
            await run.wait(
                lambda: getattr(first, "directory", None) is not None and "s0b0" in first.directory.known,
                120,
                "s0f0 to see s0b0's record",
            )
            twin_run.initial, twin_run.run_fp = run.initial, run.run_fp
            twin_run.start_server(device(0, "backward"))
            out["twin"] = await twin_run.ended(["s0b0"], timeout=120)
            out["holder_alive"] = not run.runs["s0b0"].done() and holder.peer_id
        finally:
            await twin_run.close()
            await run.close()

    play(scenario, timeout=300)
    assert out["twin"] == {"s0b0": 2}, (out, twin_run.errors)
    # refused by the run's records, or earlier by the DHT's start itself (its initial peer dials the
    # peer id back and reaches the holder: 1 of 20 loaded runs); either way the error says why
    key = tmp_path / "identities" / "s0b0.key"
    assert f"identity {key}" in twin_run.errors["s0b0"], twin_run.errors
    assert "is held by a live server" in twin_run.errors["s0b0"], twin_run.errors
    assert out["holder_alive"]
