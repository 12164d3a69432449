"""The dashboard's snapshot model without a DHT: build_snapshot on hand-made records (schema, health,
stale and malformed records, rates, history), and its renderings (Prometheus text, terminal, page)."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.layout import RunLayout
from core.protocol.records import validate_record
from peer.dashboard import main
from peer.dashboard.cli import build_parser
from peer.dashboard.entries import History
from peer.dashboard.metrics import prometheus_text
from peer.dashboard.snapshot import build_snapshot, to_json
from peer.dashboard.terminal import render_terminal
from peer.dashboard.web import render_html

NOW = 1_700_000_000.0
TOKENS = 16 * 32  # batch_size x the tiny model's seq_len
PEERS = {
    "s0f0": "12D3KooWStage0Frontal",
    "s0b0": "12D3KooWStage0Backwrd",
    "s1f0": "12D3KooWStage1Frontal",
    "s1b0": "12D3KooWStage1Backwrd",
    "v0": "12D3KooWVolunteerZero",
    "v1": "12D3KooWVolunteerOne1",
}


def config(**overrides) -> dict:
    d = {
        "run_id": "r",
        "model": "tiny",
        "seed": 0,
        "steps": 10,
        "batch_size": 16,
        "micro_batches": 4,
        "lr": 0.002,
        "layout": RunLayout.even(2, 4).to_dict(),
        "announce_period": 1.0,
    }
    d.update(overrides)
    return d


def server(
    device: str,
    version: int = 3,
    state: str = "online",
    age: float = 0.2,
    compute: float = 0.0,
    step_every: float = 2.0,
    **overrides,
) -> dict:
    stage, role = int(device[1]), "frontal" if device[2] == "f" else "backward"
    rec = {
        "kind": "server",
        "device": device,
        "role": role,
        "stage": stage,
        "state": state,
        "version": version,
        "maddrs": ["/ip4/127.0.0.1/tcp/1"],
        "layers": [2 * stage, 2 * stage + 2],
        "pool": {
            "queued": 2,
            "leased": 1,
            "done": 40,
            "requeued": 1,
            "duplicates": 0,
            "abandoned": 0,
            "added": 44,
            "oldest_queued_age": 0.5,
            "clients": {},
        },
        "losses": {str(b): (2900.0 - 100 * b) for b in range(version)} if stage == 1 else {},
        "stats": {
            "microbatches_applied": 4 * version,
            "duplicates": 2,
            "requeued": 1,
            "clients": 1,
            "payload_errors": 0,
            "clients_joined": 1,
            "clients_left": 0,
        },
        "compute": compute,
        "step_times": {str(v): NOW - (version - v) * step_every for v in range(1, version + 1)},
        "time": NOW - age,
    }
    rec.update(overrides)
    return rec


def client(device: str, stage: int, age: float = 0.3, compute: float = 120.0, **overrides) -> dict:
    rec = {
        "kind": "client",
        "device": device,
        "stage": stage,
        "state": "online",
        "compute": compute,
        "throughput": 1.5,
        "tasks_done": 30,
        "time": NOW - age,
    }
    rec.update(overrides)
    return rec


def healthy() -> list[dict]:
    return [
        {PEERS["s0f0"]: server("s0f0"), PEERS["s0b0"]: server("s0b0"), PEERS["v0"]: client("v0", 0)},
        {PEERS["s1f0"]: server("s1f0"), PEERS["s1b0"]: server("s1b0"), PEERS["v1"]: client("v1", 1)},
    ]


def shift(stages: list[dict], dt: float) -> list[dict]:
    """The same records, announced again `dt` seconds later."""
    out = copy.deepcopy(stages)
    for recs in out:
        for rec in recs.values():
            rec["time"] += dt
    return out


def snap(stages=None, cfg="default", **kw) -> dict:
    return build_snapshot(
        "r", config() if cfg == "default" else cfg, healthy() if stages is None else stages, NOW, **kw
    )


def entry(s: dict, stage: int, device: str) -> dict:
    st = s["stages"][stage]
    found = [e for e in st["frontal"] + st["backward"] + st["volunteers"] if e["device"] == device]
    assert len(found) == 1, (device, found)
    return found[0]


# ------------------------------------------------------------------------------------------------ schema


def test_snapshot_follows_the_json_contract():
    s = snap()
    assert set(s) == {"run_id", "time", "config", "stages", "progress", "health", "malformed", "errors"}
    assert s["run_id"] == "r" and s["malformed"] == [] and s["errors"] == []
    assert [st["index"] for st in s["stages"]] == [0, 1]
    assert [st["layers"] for st in s["stages"]] == [[0, 2], [2, 4]]
    for stage in s["stages"]:
        assert {"index", "layers", "frontal", "backward", "volunteers", "pools"} <= set(stage)
        assert set(stage["pools"]) == {"queued", "leased", "done", "requeued", "duplicates", "oldest_task_age"}
        for e in stage["frontal"] + stage["backward"]:
            assert {"device", "peer", "short", "state", "version", "pool", "last_seen"} <= set(e)
            assert set(e["pool"]) == {"queued", "leased", "done", "requeued", "duplicates", "oldest_task_age"}
        for v in stage["volunteers"]:
            assert {"device", "peer", "short", "state", "compute", "throughput", "last_seen"} <= set(v)
    assert {
        "step",
        "steps",
        "last_loss",
        "tokens_per_second",
        "seconds_per_step",
        "predicted_seconds_per_step",
        "microbatches_applied",
        "microbatches_expected",
        "volunteers_joined",
        "volunteers_lost",
    } <= set(s["progress"])
    assert {"ok", "status", "blocking", "warnings"} <= set(s["health"])
    assert json.loads(to_json(s)) == s


def test_figures_come_from_the_records():
    s = snap()
    s0f0 = entry(s, 0, "s0f0")
    assert (s0f0["peer"], s0f0["short"], s0f0["state"], s0f0["version"]) == (
        PEERS["s0f0"],
        PEERS["s0f0"][-8:],
        "online",
        3,
    )
    assert s0f0["pool"] == {
        "queued": 2,
        "leased": 1,
        "done": 40,
        "requeued": 1,
        "duplicates": 2,
        "oldest_task_age": 0.5,
    }
    assert s0f0["last_seen"] == pytest.approx(0.2)
    v0 = entry(s, 0, "v0")
    assert (v0["state"], v0["compute"], v0["throughput"], v0["last_seen"]) == ("online", 120.0, 1.5, pytest.approx(0.3))
    assert s["stages"][0]["pools"]["done"] == 80 and s["stages"][0]["pools"]["queued"] == 4
    p = s["progress"]
    assert p["step"] == 3 and p["steps"] == 10
    assert p["loss_batch"] == 2 and p["last_loss"] == pytest.approx(2700.0 / TOKENS)  # losses are summed per token
    assert p["seconds_per_step"] == pytest.approx(2.0) and p["tokens_per_second"] == pytest.approx(TOKENS / 2.0)
    assert s["stages"][1]["tokens_per_second"] == pytest.approx(TOKENS / 2.0)
    assert p["microbatches_applied"] == 2 * 4 * 3 and p["microbatches_expected"] == 10 * 4 * 2
    assert p["predicted_seconds_per_step"] is None
    assert (p["volunteers_live"], p["volunteers_joined"], p["volunteers_lost"]) == (2, 2, 0)
    assert s["health"] == {
        "ok": True,
        "status": "ok",
        "finished": None,
        "unseen_for": None,
        "stopped": None,
        "blocking": [],
        "warnings": [],
    }


def test_step_is_the_lowest_live_version_and_rates_follow_the_slowest_server():
    stages = healthy()
    stages[1][PEERS["s1b0"]] = server("s1b0", version=5)  # ahead
    s = snap(stages)
    assert s["progress"]["step"] == 3 and s["stages"][1]["version"] == 3
    # the others reached v1 at NOW-4 and v3 at NOW; s1b0 reached v1 last, at NOW-2: a version counts
    # when every live server has it, so v1..v3 took 2 s, 1 s per step
    stages[1][PEERS["s1b0"]] = server("s1b0", step_times={"1": NOW - 2.0, "2": NOW - 1.5, "3": NOW - 1.0})
    assert snap(stages)["progress"]["seconds_per_step"] == pytest.approx(1.0)
    assert snap(stages)["stages"][0]["seconds_per_step"] == pytest.approx(2.0)  # stage 0 is not held back


def test_predicted_seconds_per_step_comes_from_the_plan():
    layout = RunLayout.even(2, 4).to_dict() | {"predicted_seconds_per_batch": 1.25}
    carried = RunLayout.from_dict(layout, 4).to_dict()  # what `peer serve --plan` publishes
    assert carried["predicted_seconds_per_step"] == 1.25
    assert snap(cfg=config(layout=carried))["progress"]["predicted_seconds_per_step"] == 1.25
    assert "predicted_seconds_per_step" not in RunLayout.even(2, 4).to_dict()


def test_new_server_record_fields_are_optional_and_typed():
    rec = server("s0f0")
    assert validate_record(rec) is rec
    for name in ("compute", "step_times"):
        old = dict(rec)
        del old[name]
        validate_record(old)
    with pytest.raises(ValueError, match="compute"):
        validate_record(rec | {"compute": "fast"})
    with pytest.raises(ValueError, match="step_times"):
        validate_record(rec | {"step_times": [1, 2]})
    with pytest.raises(ValueError, match="unknown record kind"):  # not a TypeError: a kind that cannot be hashed
        validate_record(rec | {"kind": ["server"]})


# ------------------------------------------------------------------------------------------------ health


def test_a_stage_without_a_live_backward_server_blocks_the_run():
    stages = healthy()
    del stages[1][PEERS["s1b0"]]
    s = snap(stages)
    assert s["health"]["status"] == "blocked" and not s["health"]["ok"]
    assert s["health"]["blocking"] == [{"stage": 1, "reason": "no live backward server"}]
    missing = entry(s, 1, "s1b0")  # the layout names it: it shows, never seen
    assert missing["state"] == "unreachable" and missing["peer"] is None and missing["last_seen"] is None
    assert s["stages"][1]["blocking"] == ["no live backward server"] and s["stages"][0]["blocking"] == []


def test_an_offline_frontal_server_blocks_its_stage():
    stages = healthy()
    stages[0][PEERS["s0f0"]] = server("s0f0", state="offline")
    s = snap(stages)
    assert entry(s, 0, "s0f0")["state"] == "offline"
    assert s["health"]["blocking"] == [{"stage": 0, "reason": "no live frontal server"}]
    assert any("s0f0" in w and "offline" in w for w in s["health"]["warnings"])


def test_a_stage_with_no_compute_blocks_but_a_computing_server_is_enough():
    stages = healthy()
    del stages[0][PEERS["v0"]]
    s = snap(stages)
    assert s["health"]["blocking"] == [{"stage": 0, "reason": "no compute: no live volunteer and no server computes"}]
    assert s["stages"][0]["compute"] == 0
    stages[0][PEERS["s0b0"]] = server("s0b0", compute=50.0)
    s = snap(stages)
    assert s["health"]["status"] == "ok" and s["stages"][0]["compute"] == 50.0


def test_a_run_a_server_says_is_stopped_shows_why_in_every_view():
    """A role lost its last server: the live servers announce the run stopped and why; the
    dashboard's status is `stopped` with that reason, in JSON, terminal, page and metrics."""
    from rich.console import Console

    from core.layout import halt_reason

    reason = halt_reason([(1, "backward", ("s1b0",))])
    stages = healthy()
    del stages[1][PEERS["s1b0"]]
    for d in ("s0f0", "s0b0"):
        stages[0][PEERS[d]] = server(d, halted=reason)
    stages[1][PEERS["s1f0"]] = server("s1f0", halted=reason)
    s = snap(stages)
    assert s["health"]["status"] == "stopped" and not s["health"]["ok"] and s["health"]["stopped"] == reason
    assert "stage 1 has no backward server (s1b0 gone)" in reason and "--checkpoint-dir" in reason
    assert s["health"]["blocking"] == [{"stage": 1, "reason": "no live backward server"}]
    console = Console(width=80, record=True, force_terminal=False, color_system=None)
    console.print(render_terminal(s))
    text = " ".join(console.export_text().split())
    assert "STOPPED" in text and "stage 1 has no backward server (s1b0 gone)" in text
    assert [v for _, v in parse_prometheus(prometheus_text(s))["hivepipe_run_stopped"]] == [1.0]
    assert "s.health.stopped" in render_html(1.0) and ".st-stopped" in render_html(1.0)
    # an offline record's word does not count, and a record whose reason is not text is malformed
    stages[0][PEERS["s0f0"]] = server("s0f0", state="offline", halted=reason)
    stages[0][PEERS["s0b0"]] = server("s0b0", halted=7)
    stages[1][PEERS["s1f0"]] = server("s1f0")
    s = snap(stages)
    assert s["health"]["status"] == "blocked" and s["health"]["stopped"] is None
    assert any("halted" in m["reason"] for m in s["malformed"])
    assert [v for _, v in parse_prometheus(prometheus_text(s))["hivepipe_run_stopped"]] == [0.0]


def test_a_run_at_its_last_step_is_finished_not_blocked():
    stages = [
        {PEERS[d]: server(d, version=10) for d in ("s0f0", "s0b0")},
        {PEERS[d]: server(d, version=10) for d in ("s1f0", "s1b0")},
    ]
    s = snap(stages)
    assert s["health"]["status"] == "finished" and s["health"]["ok"]
    assert s["progress"]["microbatches_applied"] == s["progress"]["microbatches_expected"] == 80


def test_a_run_whose_lost_server_is_behind_is_stopped_not_finished():
    """Stage 1's last backward server is gone at version 2; the live servers stepped their own slots
    to the end (seen in CI once the swarm got faster): the run is not finished, it is stopped."""
    from core.layout import halt_reason

    reason = halt_reason([(1, "backward", ("s1b0",))])
    stages = [
        {PEERS[d]: server(d, version=10, halted=reason) for d in ("s0f0", "s0b0")},
        {PEERS["s1f0"]: server("s1f0", version=10, halted=reason), PEERS["s1b0"]: server("s1b0", version=2, age=30.0)},
    ]
    s = snap(stages)
    assert s["health"]["status"] == "stopped" and s["health"]["stopped"] == reason
    del stages[1][PEERS["s1b0"]]  # its record expired: no word of it at all
    assert snap(stages)["health"]["status"] == "stopped"


def test_a_joining_server_is_live():
    stages = healthy()
    stages[0][PEERS["s0f0"]] = server("s0f0", state="joining", version=0, step_times={})
    s = snap(stages)
    assert entry(s, 0, "s0f0")["state"] == "joining"
    assert s["health"]["blocking"] == [] and s["progress"]["step"] == 0
    assert s["progress"]["seconds_per_step"] is None  # one server has no step times yet


# ------------------------------------------------------------------------------------------------ stale records


def test_a_stale_record_is_unreachable_and_leaves_the_step():
    stages = healthy()
    stages[0][PEERS["s0b0"]] = server("s0b0", version=1, age=3.5)  # 3.5 periods old
    s = snap(stages)
    e = entry(s, 0, "s0b0")
    assert e["state"] == "unreachable" and e["announced_state"] == "online" and e["last_seen"] == pytest.approx(3.5)
    assert s["progress"]["step"] == 3  # its version 1 no longer holds the step back
    assert s["health"]["blocking"] == [{"stage": 0, "reason": "no live backward server"}]
    assert any("s0b0" in w and "unreachable" in w for w in s["health"]["warnings"])
    # the threshold is in announce periods: 2.9 periods is still online, and --stale-periods moves it
    stages[0][PEERS["s0b0"]] = server("s0b0", age=2.9)
    assert entry(snap(stages), 0, "s0b0")["state"] == "online"
    assert entry(snap(stages, stale_periods=2.0), 0, "s0b0")["state"] == "unreachable"
    assert entry(build_snapshot("r", config(announce_period=0.5), stages, NOW), 0, "s0b0")["state"] == "unreachable"


def test_a_stale_offline_record_stays_offline():
    stages = healthy()
    stages[0][PEERS["s0b0"]] = server("s0b0", state="offline", age=100)
    assert entry(snap(stages), 0, "s0b0")["state"] == "offline"


def test_a_stale_volunteer_is_unreachable_and_counts_as_lost():
    """A volunteer stores its record every VOLUNTEER_PERIODS announce periods: it is stale after
    that many times the servers' threshold (3 periods of 1 s here)."""
    stages = healthy()
    stages[1][PEERS["v1"]] = client("v1", 1, age=14.0)
    assert entry(snap(stages), 1, "v1")["state"] == "online"
    stages[1][PEERS["v1"]] = client("v1", 1, age=16.0)
    s = snap(stages)
    assert entry(s, 1, "v1")["state"] == "unreachable"
    assert s["progress"]["volunteers_lost"] == 1 and s["progress"]["volunteers_live"] == 1
    assert s["health"]["blocking"] == [{"stage": 1, "reason": "no compute: no live volunteer and no server computes"}]


def test_the_servers_count_of_the_volunteers_registered_now_is_the_stages_live_volunteers():
    """A server counts the volunteers registered with it now (`stats.volunteers`, their compute in
    `stats.volunteer_compute`): fresher than a volunteer's own record, so it says the stage's live
    volunteers and compute; the server that counts the most (a volunteer registers at all of them)."""
    stages = healthy()
    stats = server("s1f0")["stats"]
    stages[1][PEERS["s1f0"]] = server("s1f0", stats=stats | {"volunteers": 0, "volunteer_compute": 0.0})
    stages[1][PEERS["s1b0"]] = server("s1b0", stats=stats | {"volunteers": 0, "volunteer_compute": 0.0})
    s = snap(stages)  # v1's record is still fresh, but no server has it registered: it is gone
    assert s["stages"][1]["volunteers_live"] == 0 and s["stages"][1]["compute"] == 0.0
    assert s["health"]["blocking"] == [{"stage": 1, "reason": "no compute: no live volunteer and no server computes"}]
    stages[1][PEERS["s1b0"]] = server("s1b0", stats=stats | {"volunteers": 2, "volunteer_compute": 250.0})
    s = snap(stages)
    assert s["stages"][1]["volunteers_live"] == 2 and s["stages"][1]["compute"] == 250.0
    assert s["health"]["blocking"] == []


def test_a_bans_reach_is_what_the_live_server_keeping_the_fewest_versions_says():
    assert snap()["progress"]["ban_reach"] is None  # (servers that do not say it)
    stages = healthy()
    for device, reach in (("s0f0", 70), ("s0b0", 9), ("s1f0", 70), ("s1b0", 71)):
        rec = stages[int(device[1])][PEERS[device]]
        rec["stats"] = rec["stats"] | {"ban_reach": reach}
    assert snap(stages)["progress"]["ban_reach"] == 9  # s0b0 restarted: its disk holds none yet
    stages[0][PEERS["s0b0"]]["state"] = "offline"
    assert snap(stages)["progress"]["ban_reach"] == 70  # (an offline server's record does not count)
    stages[0][PEERS["s0f0"]]["stats"]["ban_reach"] = float("nan")
    s = snap(stages)
    assert [m["reason"] for m in s["malformed"]] == ["server record: stats.ban_reach is not a finite number (nan)"]


def test_the_servers_count_of_departed_volunteers_is_used():
    stages = healthy()
    stages[0][PEERS["s0f0"]] = server(
        "s0f0",
        stats={
            "microbatches_applied": 12,
            "duplicates": 0,
            "requeued": 0,
            "clients": 1,
            "clients_joined": 4,
            "clients_left": 3,
        },
    )
    p = snap(stages)["progress"]
    assert (p["volunteers_joined"], p["volunteers_lost"]) == (4 + 1, 3)


# ------------------------------------------------------------------------------------------------ history


def test_history_keeps_a_vanished_volunteer_as_unreachable_and_lost():
    history = History(show_vanished_for=30.0)
    stages = healthy()
    s = build_snapshot("r", config(), stages, NOW, history=history)
    assert s["progress"]["volunteers_joined"] == 2
    del stages[1][PEERS["v1"]]  # its record expired from the DHT
    s = build_snapshot("r", config(), shift(stages, 5), NOW + 5, history=history)
    v1 = entry(s, 1, "v1")
    assert v1["state"] == "unreachable" and v1["vanished"] and v1["last_seen"] == pytest.approx(5.3)
    assert (s["progress"]["volunteers_live"], s["progress"]["volunteers_joined"], s["progress"]["volunteers_lost"]) == (
        1,
        2,
        1,
    )
    s = build_snapshot("r", config(), shift(stages, 60), NOW + 60, history=history)
    assert all(v["device"] != "v1" for v in s["stages"][1]["volunteers"])  # no longer shown...
    assert s["progress"]["volunteers_lost"] == 1  # ...still counted


def test_history_keeps_a_vanished_server_with_its_last_record():
    history = History()
    stages = healthy()
    build_snapshot("r", config(), stages, NOW, history=history)
    del stages[0][PEERS["s0b0"]]
    s = build_snapshot("r", config(), shift(stages, 10), NOW + 10, history=history)
    e = entry(s, 0, "s0b0")
    assert e["state"] == "unreachable" and e["peer"] == PEERS["s0b0"] and e["version"] == 3
    assert e["last_seen"] == pytest.approx(10.2)


def test_history_measures_rates_when_servers_publish_no_step_times():
    def at(version):
        return [
            {PEERS[d]: server(d, version=version, step_times={}) for d in ("s0f0", "s0b0")}
            | {PEERS["v0"]: client("v0", 0)},
            {PEERS[d]: server(d, version=version, step_times={}) for d in ("s1f0", "s1b0")}
            | {PEERS["v1"]: client("v1", 1)},
        ]

    assert snap(at(3))["progress"]["seconds_per_step"] is None  # one look tells no rate
    history = History()
    for t, version in ((0, 3), (1, 3), (2, 4), (3, 4), (5, 5), (8, 6)):
        s = build_snapshot("r", config(), shift(at(version), t), NOW + t, history=history)
    # steps first seen at +2 (v4) and +8 (v6): 3 s per step; the first look (+0) is not a step change
    assert s["progress"]["seconds_per_step"] == pytest.approx(3.0)
    assert s["stages"][0]["tokens_per_second"] == pytest.approx(TOKENS / 3.0)


def test_history_accumulates_losses_beyond_the_records_window():
    history = History()
    for version in (3, 6, 9):
        stages = healthy()
        losses = {str(b): 100.0 * b for b in range(version - 3, version)}
        stages[1][PEERS["s1f0"]] = server("s1f0", version=version, losses=losses)
        s = build_snapshot("r", config(), stages, NOW + version, history=history)
    assert [b for b, _ in s["progress"]["loss_history"]] == list(range(9))
    assert s["progress"]["loss_batch"] == 8 and s["progress"]["last_loss"] == pytest.approx(800.0 / TOKENS)


def test_held_out_losses_and_gradient_norms_are_kept_shown_and_exported():
    """A record carries only its server's last few held-out losses and norms: the dashboard keeps the
    curve from what it saw, and shows the latest in every view."""
    from rich.console import Console

    history = History()
    for version in (4, 8, 12):
        stages = healthy()
        evals = {str(v): 5.0 - 0.1 * v for v in range(version - 4, version + 1, 2)}
        norms = {str(b): 1.0 + b for b in range(version - 2, version)}
        stages[1][PEERS["s1f0"]] = server("s1f0", version=version, eval_losses=evals, grad_norms=norms)
        s = build_snapshot("r", config(), shift(stages, version), NOW + version, history=history)
    p = s["progress"]
    assert [v for v, _ in p["eval_history"]] == list(range(0, 13, 2))
    assert (p["eval_version"], p["eval_loss"]) == (12, pytest.approx(5.0 - 1.2))
    assert (p["grad_norm_batch"], p["grad_norm"]) == (11, 12.0)
    fam = parse_prometheus(prometheus_text(s))
    assert fam["hivepipe_eval_loss"] == [('{run_id="r"}', pytest.approx(3.8))]
    assert fam["hivepipe_eval_version"] == [('{run_id="r"}', 12.0)]
    assert fam["hivepipe_grad_norm"] == [('{run_id="r"}', 12.0)]
    console = Console(width=80, record=True, force_terminal=False, color_system=None)
    console.print(render_terminal(s))
    text = console.export_text()
    assert "held-out loss 3.8000 (version 12)" in text and "gradient norm 12 (batch 11)" in text
    # a run without either shows neither, and exports no sample for them
    plain = snap()
    assert plain["progress"]["eval_loss"] is None and plain["progress"]["eval_history"] == []
    assert "hivepipe_eval_loss" not in parse_prometheus(prometheus_text(plain))


def test_a_finished_run_stays_finished_after_its_servers_left():
    """At the last step every server announces it, then leaves: its records expire. The live view
    keeps saying finished, with the step and the loss it saw, never blocked or not found."""
    history = History()
    done = [{p: server(d, version=10) for p, d in ((PEERS["s0f0"], "s0f0"), (PEERS["s0b0"], "s0b0"))}]
    done.append({p: server(d, version=10) for p, d in ((PEERS["s1f0"], "s1f0"), (PEERS["s1b0"], "s1b0"))})
    s = build_snapshot("r", config(), done, NOW, history=history)
    assert s["health"]["status"] == "finished" and s["health"]["finished"]["step"] == 10
    loss = s["health"]["finished"]["loss"]
    assert loss == pytest.approx((2900.0 - 100 * 9) / TOKENS)
    # a minute later: the records are stale (servers gone), then gone from the DHT altogether
    for later, stages in ((60.0, done), (120.0, [None, None])):
        s = build_snapshot("r", config() if stages is done else None, stages, NOW + later, history=history)
        h = s["health"]
        assert (h["status"], h["ok"], h["blocking"], h["stopped"]) == ("finished", True, [], None), h
        assert h["finished"] == {"step": 10, "loss": loss, "eval_loss": None, "at": NOW}
    fam = parse_prometheus(prometheus_text(s))
    assert fam["hivepipe_run_finished"][0][1] == 1.0 and fam["hivepipe_health_ok"][0][1] == 1.0


def test_a_run_seen_before_and_not_found_now_is_unreachable_not_missing():
    history = History()
    build_snapshot("r", config(), healthy(), NOW, history=history)
    s = build_snapshot("r", None, [None, None], NOW + 40.0, history=history)
    assert s["health"]["status"] == "unreachable" and s["health"]["unseen_for"] == 40.0, s["health"]
    assert s["errors"] == [], s["errors"]  # no "check --run-id" hint: the id found the run before
    assert parse_prometheus(prometheus_text(s))["hivepipe_run_found"][0][1] == 0.0
    # the same read by a view that never saw the run: not found; and one that sees it again: live
    assert build_snapshot("r", None, [None, None], NOW + 40.0)["health"]["status"] == "not_found"
    back = build_snapshot("r", config(), shift(healthy(), 50.0), NOW + 50.0, history=history)
    assert back["health"]["status"] == "ok" and back["health"]["unseen_for"] is None


# ------------------------------------------------------------------------------------------------ malformed

BAD_RECORDS = {
    "not-a-map": ("a string", "expected a map"),
    "unknown-kind": ({"kind": "robot", "time": NOW}, "unknown record kind"),
    "missing-field": ({"kind": "server", "device": "x"}, "missing field"),
    "wrong-type": (server("s0f0") | {"version": "3"}, "'version' has the wrong type"),
    "bad-state": (server("s0f0") | {"state": "sleeping"}, "state 'sleeping'"),
    "bad-role": (server("s0f0") | {"role": "middle"}, "role 'middle'"),
    "nan-time": (client("vx", 0) | {"time": math.nan}, "'time' is not a finite number"),
    "inf-compute": (client("vx", 0) | {"compute": math.inf}, "'compute' is not a finite number"),
    "bad-pool": (server("s0f0") | {"pool": {"queued": "lots"}}, "pool.queued"),
    "bad-losses": (server("s0f0") | {"losses": {"last": 1.0}}, "losses"),
    "bad-step-times": (server("s0f0") | {"step_times": {"1": None}}, "step_times"),
    "bad-eval-losses": (server("s0f0") | {"eval_losses": {"3": math.inf}}, "eval_losses"),
    "bad-grad-norms": (server("s0f0") | {"grad_norms": {"x": 1.0}}, "grad_norms"),
    "bad-layers": (server("s0f0") | {"layers": [1, 2, 3]}, "layers"),
    "wrong-stage": (server("s1f0"), "says stage 1"),
}


def test_malformed_records_are_listed_with_the_reason_and_the_rest_still_shows():
    stages = healthy()
    for peer, (value, _) in BAD_RECORDS.items():
        stages[0][peer] = value
    s = snap(stages)
    reasons = {m["peer"]: m["reason"] for m in s["malformed"]}
    assert set(reasons) == set(BAD_RECORDS)
    for peer, (_, words) in BAD_RECORDS.items():
        assert words in reasons[peer], (peer, reasons[peer])
    assert all(m["stage"] == 0 for m in s["malformed"])
    # the good records are untouched by the bad ones
    assert s["health"]["status"] == "ok" and s["progress"]["step"] == 3
    assert f"{len(BAD_RECORDS)} malformed record(s)" in s["health"]["warnings"]
    assert json.loads(to_json(s)) == s


def test_a_stage_key_that_is_not_a_map_is_malformed():
    stages = healthy()
    stages[1] = [1, 2, 3]
    s = snap(stages)
    assert s["malformed"] == [
        {"stage": 1, "peer": None, "short": "-", "reason": "the stage key holds a list, not a map of peer records"}
    ]
    assert {b["reason"] for b in s["health"]["blocking"] if b["stage"] == 1} >= {"no live frontal server"}


@pytest.mark.parametrize(
    "bad_config, words",
    [
        ("garbage", "expected a map"),
        ({"run_id": "r"}, "missing field 'model'"),
        (config(steps="ten"), "'steps' has the wrong type"),
        (config(model="gigantic"), "unknown"),
        (config(layout={"stages": []}), "layout"),
        (config(layout=RunLayout.even(2, 4).to_dict() | {"idle": 5}), "plan.idle"),
        (config(layout={"stages": [{"layers": [0, 4], "frontal": "s0f0", "backward": ["s0b0"]}]}), "frontal"),
    ],
)
def test_a_config_that_does_not_parse_is_an_error_not_a_crash(bad_config, words):
    s = snap(cfg=bad_config)
    assert any(words in e for e in s["errors"]), s["errors"]
    # the stage records still show, from the records themselves
    assert [st["index"] for st in s["stages"]] == [0, 1]
    assert entry(s, 0, "s0f0")["state"] == "online"
    assert json.loads(to_json(s)) == s


def test_without_a_config_the_stage_records_show_alone():
    s = snap(cfg=None)
    assert any("no config record" in e for e in s["errors"])
    assert s["stages"][1]["layers"] == [2, 4] and s["progress"]["step"] == 3
    assert s["progress"]["last_loss"] is None  # the tokens per batch come from the config


def test_a_run_that_is_not_there_says_so():
    s = build_snapshot("nope", None, [], NOW)
    assert s["health"]["status"] == "not_found" and not s["health"]["ok"]
    assert s["stages"] == [] and "no run 'nope'" in s["errors"][0] and "--run-id" in s["errors"][0]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)
# records that look nearly right, so that the checks beyond the kind and the required fields are reached
near_records = st.builds(
    lambda base, patch: {**base, **patch},
    st.sampled_from([server("s0f0"), server("s0b0"), client("v0", 0)]),
    st.dictionaries(
        st.sampled_from(
            [
                "kind",
                "stage",
                "state",
                "time",
                "version",
                "pool",
                "stats",
                "losses",
                "step_times",
                "layers",
                "compute",
                "role",
                "device",
                "throughput",
            ]
        ),
        json_values,
        max_size=3,
    ),
)


near_layouts = st.builds(
    lambda base, patch: {**base, **patch},
    st.just(RunLayout.even(2, 4).to_dict()),
    st.dictionaries(st.sampled_from(["stages", "idle", "predicted_seconds_per_step"]), json_values, max_size=2),
)
near_configs = st.builds(
    lambda base, patch: {**base, **patch},
    st.just(config()),
    st.dictionaries(
        st.sampled_from(["model", "steps", "batch_size", "micro_batches", "announce_period", "layout"]),
        json_values | near_layouts,
        max_size=2,
    ),
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.dictionaries(st.text(min_size=1, max_size=6), json_values | near_records, max_size=5),
    cfg=st.one_of(st.just(config()), json_values, near_configs),
)
def test_no_record_or_config_crashes_the_snapshot(records, cfg):
    stages = healthy()
    stages[0].update(records)
    s = build_snapshot("r", cfg, stages, NOW)
    json.loads(to_json(s))  # always valid JSON (no NaN)
    prometheus_text(s)
    rendered = render_terminal(s)
    assert rendered is not None


# ------------------------------------------------------------------------------------------------ renderings

SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)?\})? (-?[0-9.e+-]+|NaN|[+-]Inf)$'
)


def parse_prometheus(text: str) -> dict[str, list[tuple[str, float]]]:
    """A strict reader of the text exposition format: HELP then TYPE then the family's samples."""
    assert text.endswith("\n")
    families: dict[str, list[tuple[str, float]]] = {}
    current, typed = None, False
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert name not in families, f"family {name} twice"
            families[name], current, typed = [], name, False
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name == current and kind == "gauge" and not typed
            typed = True
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            assert m.group(1) == current and typed, line
            families[current].append((m.group(2) or "", float(m.group(3))))
    return families


def test_prometheus_text_is_well_formed_and_carries_the_snapshot():
    s = snap()
    fam = parse_prometheus(prometheus_text(s))
    assert fam["hivepipe_step"] == [('{run_id="r"}', 3.0)]
    assert fam["hivepipe_loss"][0][1] == pytest.approx(2700.0 / TOKENS)
    assert fam["hivepipe_health_ok"][0][1] == 1.0
    assert fam["hivepipe_tokens_per_second"][0][1] == pytest.approx(TOKENS / 2.0)
    assert fam["hivepipe_seconds_left"][0][1] == pytest.approx((10 - 3) * 2.0)  # 7 steps at 2 s each
    assert "hivepipe_predicted_seconds_per_step" not in fam  # null: no sample rather than a made-up value
    assert len(fam["hivepipe_server_up"]) == 4 and all(v == 1.0 for _, v in fam["hivepipe_server_up"])
    assert f'peer="{PEERS["s0f0"]}"' in fam["hivepipe_server_version"][0][0]
    assert sorted(lab for lab, _ in fam["hivepipe_stage_blocked"]) == [
        '{run_id="r",stage="0"}',
        '{run_id="r",stage="1"}',
    ]
    queued = [v for lab, v in fam["hivepipe_stage_pool_tasks"] if 'stage="0"' in lab and 'state="queued"' in lab]
    assert queued == [4.0]
    assert len(fam["hivepipe_volunteer_compute"]) == 2


def test_prometheus_label_values_are_escaped():
    stages = healthy()
    stages[0][PEERS["v0"]] = client('v"0\\\nx', 0)
    stages[1][PEERS["s1b0"]] = server("s1b0", state="offline")
    s = snap(stages)
    fam = parse_prometheus(prometheus_text(s))
    assert any('device="v\\"0\\\\\\nx"' in lab for lab, _ in fam["hivepipe_volunteer_compute"])
    down = [(lab, v) for lab, v in fam["hivepipe_server_up"] if 'device="s1b0"' in lab]
    assert down == [(down[0][0], 0.0)] and 'state="offline"' in down[0][0]
    assert [v for lab, v in fam["hivepipe_stage_blocked"] if 'stage="1"' in lab] == [1.0]
    assert fam["hivepipe_health_ok"][0][1] == 0.0


def test_the_terminal_view_fits_80_columns():
    from rich.console import Console

    stages = healthy()
    stages[0]["bad-peer"] = {"kind": "server"}
    del stages[1][PEERS["s1b0"]]
    s = snap(stages)
    console = Console(width=80, record=True, force_terminal=False, color_system=None)
    console.print(render_terminal(s))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for word in (
        "run r",
        "BLOCKED",
        "step 3/10",
        "stage 0",
        "stage 1",
        "layers 2-4",
        "s0f0",
        "s1b0",
        "v1",
        PEERS["v0"][-8:],
        "unreachable",
        "BLOCKING stage 1: no live backward server",
        "malformed records (1)",
        "missing field 'device'",
        f"loss {2700 / TOKENS:.4f}",
        "left 14 s",
    ):
        assert word in text, word


def test_the_page_is_self_contained():
    page = render_html(1.5)
    assert "const REFRESH_MS = 1500;" in page
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page)  # no CDN, nothing external
    assert 'fetch("api/state"' in page
    assert ".innerHTML" not in page  # DHT strings go in as text only


# ------------------------------------------------------------------------------------------------ command line


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "--initial-peers"),
        (["--initial-peers", "not-an-address", "--json"], "not a multiaddr"),
        (["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--json"], "lacks the peer id"),
        (
            [
                "--initial-peers",
                "/ip4/127.0.0.1/tcp/1/p2p/QmXfz1KyWEtpjDp1ah1cDZnRnTVfM7p5ZK6LCG1ruN4Pqk",
                "--json",
                "--serve",
                "0",
            ],
            "not allowed with",
        ),
        (
            [
                "--initial-peers",
                "/ip4/127.0.0.1/tcp/1/p2p/QmXfz1KyWEtpjDp1ah1cDZnRnTVfM7p5ZK6LCG1ruN4Pqk",
                "--refresh",
                "-1",
            ],
            "positive",
        ),
        (
            [
                "--initial-peers",
                "/ip4/127.0.0.1/tcp/1/p2p/QmXfz1KyWEtpjDp1ah1cDZnRnTVfM7p5ZK6LCG1ruN4Pqk",
                "--serve",
                "70000",
            ],
            "outside",
        ),
    ],
)
def test_bad_arguments_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_the_default_run_id_is_the_swarm_default():
    from peer.cli import build_parser as peer_parser

    swarm_default = peer_parser().parse_args(["swarm"]).run_id
    assert build_parser().parse_args(["--initial-peers", "x"]).run_id == swarm_default == "swarm"


def test_merged_reads_keep_every_peers_latest_record():
    """A one-shot snapshot merges several reads: a record one read missed (s0b0 in the second) is
    kept, the later of two records of a peer wins, and a stage no read found stays None."""
    from peer.dashboard.reader import merge_reads

    first = healthy()
    second = shift(healthy(), 0.5)
    del second[0][PEERS["s0b0"]]
    reads = [(config(), first, {}), (None, second, {}), (config(steps=11), [second[0]], {})]
    merged_config, merged, _ = merge_reads(reads)
    assert merged_config["steps"] == 11  # the last read that has a config
    assert set(merged[0]) == set(first[0]) and set(merged[1]) == set(first[1])
    assert merged[0][PEERS["s0b0"]] is first[0][PEERS["s0b0"]]  # only the first read had it
    assert merged[0][PEERS["s0f0"]]["time"] == first[0][PEERS["s0f0"]]["time"] + 0.5  # the later one
    assert merge_reads([(None, [None, None], {}), (None, [None], {})]) == (None, [None, None], {})
    snap = build_snapshot("r", merged_config, merged, NOW + 0.5)
    assert {e["device"] for e in snap["stages"][0]["backward"] if e["peer"]} == {"s0b0"}


def test_a_records_age_is_taken_when_it_was_read():
    """A read of the DHT can take seconds (each key up to READ_TIMEOUT_S on a loaded machine): the
    records found first are judged at the moment they were read, not when the snapshot is built, so
    that a slow read does not call live servers unreachable. Merged reads keep the time of the last
    read that found a peer's newest record (it was still its newest then)."""
    from peer.dashboard.reader import merge_reads

    stages = healthy()
    late = NOW + 20  # the snapshot is built 20 s (40 periods) after the records were announced
    stale = build_snapshot("r", config(), stages, late)
    assert {e["state"] for st in stale["stages"] for r in ("frontal", "backward") for e in st[r]} == {"unreachable"}
    # stage 0 read as it was announced, stage 1 read 20 s later: only stage 1's records are stale
    seen = {(k, p): (NOW if k == 0 else late) for k, recs in enumerate(stages) for p in recs}
    snap = build_snapshot("r", config(), stages, late, seen_at=seen)
    states = {e["device"]: e["state"] for st in snap["stages"] for r in ("frontal", "backward") for e in st[r]}
    assert states == {"s0f0": "online", "s0b0": "online", "s1f0": "unreachable", "s1b0": "unreachable"}
    assert [v["state"] for v in snap["stages"][0]["volunteers"]] == ["online"]
    assert [v["state"] for v in snap["stages"][1]["volunteers"]] == ["unreachable"]
    # merged: the same record found by a read at NOW and one at NOW + 20 was still the newest at NOW + 20
    first = {(k, p): NOW for k, recs in enumerate(stages) for p in recs}
    again = {(k, p): late for k, recs in enumerate(stages) for p in recs}
    _, merged, merged_seen = merge_reads([(config(), stages, first), (config(), stages, again)])
    assert merged_seen == again
    # a record only the first read found keeps that read's time
    missing = copy.deepcopy(stages)
    del missing[0][PEERS["s0f0"]]
    _, merged, merged_seen = merge_reads([(config(), stages, first), (config(), missing, again)])
    assert merged_seen[(0, PEERS["s0f0"])] == NOW and merged_seen[(0, PEERS["s0b0"])] == late
