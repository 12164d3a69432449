"""`peer join --stage auto` measures its links to every stage's servers with real P2P calls and
picks the stage the planner's rule predicts from the emulated link profile (the objects of `peer
serve` and `peer join` in one event loop, each on a real DHT node: tests/swarm/hosts.py)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from core.model.config import get_preset
from scheduler import choose_stage_for_volunteer, load_cluster
from tests.swarm.hosts import TWO_STAGES, HostRun, play, servers_of

SERVERS = ["s0f0", "s0b0", "s1f0", "s1b0"]
NEAR = (4.0, 1000.0)  # delay ms, bandwidth Mb/s
FAR = (120.0, 20.0)


def profile() -> dict:
    """va sits next to stage 0's servers, vb next to stage 1's."""
    n = len(SERVERS)
    rel_delay = [[0 if i == j else 1.0 for j in range(n)] for i in range(n)]
    rel_bw = [[0 if i == j else 10000.0 for j in range(n)] for i in range(n)]
    rows = {"va": [NEAR, NEAR, FAR, FAR], "vb": [FAR, FAR, NEAR, NEAR]}
    return {
        "reliable": [{"id": s, "tflops": 10.0} for s in SERVERS],
        "unreliable": [{"id": v, "tflops": 10.0} for v in rows],
        "delay_ms": {"reliable": rel_delay, "unreliable": [[d for d, _ in r] for r in rows.values()]},
        "bandwidth_mbps": {"reliable": rel_bw, "unreliable": [[b for _, b in r] for r in rows.values()]},
    }


def predicted_stage(cluster, volunteer: str) -> int:
    cfg = get_preset("tiny")
    nbytes = 2 * (16 // 4) * cfg.seq_len * cfg.hidden * 4
    stages = [SERVERS[:2], SERVERS[2:]]
    return choose_stage_for_volunteer(
        [[cluster.delay(volunteer, s) for s in st] for st in stages],
        [[cluster.bandwidth(volunteer, s) for s in st] for st in stages],
        nbytes,
    )


@pytest.mark.stress
def test_stage_auto_follows_the_rule_under_emulated_links(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(profile()))
    cluster = load_cluster(str(path))
    expected = {v: predicted_stage(cluster, v) for v in ("va", "vb")}
    assert expected == {"va": 0, "vb": 1}
    links = ["--link-profile", str(path)]
    # the servers compute (each stage has compute when a volunteer chooses), and the run is long enough
    # not to end before the volunteers have measured their links: it is stopped once they have chosen
    run = HostRun(tmp_path, "auto", 10_000, TWO_STAGES, links)
    chosen = {}

    async def scenario():
        try:
            await run.start_servers(servers_of(1))
            for v in expected:
                run.join(v, "auto", "--probe-bytes", str(1 << 18), *links)

            def joined():
                for v in expected:
                    found = re.search(r"on stage (\d+)", run.said[v].getvalue())
                    if found:
                        chosen[v] = int(found.group(1))
                return len(chosen) == len(expected)

            await run.wait(joined, 180, "the volunteers to choose a stage", poll=0.2)
        finally:
            await run.close()

    play(scenario, 600)
    assert chosen == expected


@pytest.mark.stress
def test_a_computing_servers_records_say_its_compute_from_the_first_online_one(tmp_path, monkeypatch):
    """A server that computes measures its worker before it announces: every record it stores says
    its compute, the first "online" one included (it used to say 0 until the worker had started, an
    announce period later, and a volunteer choosing its stage then saw a stage without compute)."""
    from peer.host.announcer import Announcer

    said, everyone = [], asyncio.Event()
    record = Announcer.record

    def noted(self, state):
        rec = record(self, state)
        said.append((rec["device"], rec["state"], rec["compute"]))
        if {d for d, s, _ in said if s == "online"} == set(SERVERS):
            everyone.set()
        return rec

    monkeypatch.setattr(Announcer, "record", noted)
    run = HostRun(tmp_path, "measured", 10_000, TWO_STAGES)

    async def scenario():
        try:
            await run.start_servers(servers_of(1))
            await asyncio.wait_for(everyone.wait(), 120)
        finally:
            await run.close()

    play(scenario, 300)
    assert all(c > 0 for _, _, c in said), said
