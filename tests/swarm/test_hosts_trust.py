"""Checked work (parameter_server/verify.py) on a run of the objects `peer serve` and `peer join` run,
every peer in this test's event loop on a real DHT node and p2p daemon of its own
(tests/swarm/hosts.py): volunteers that lie (`peer join --cheat`) are caught by the servers' re-runs
and banned, each told the check it failed, their work undone by a rollback epoch, and the run ends
equal to the reference as if they had never joined; with `--compress 8bit` the tensors travel in
about a byte per value and a liar is still caught."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from peer.model.config import get_preset
from peer.protocol.traffic import TRAFFIC, VALUES
from peer.reference import DEFAULTS
from tests.swarm.harness import reference_state, rel_diff
from tests.swarm.hosts import HostRun

pytestmark = pytest.mark.swarm

TWO_STAGES = ["--stages", "2", "--frontal-per-stage", "1", "--backward-per-stage", "1"]
SERVERS = [["--stage", str(k), "--role", r, "--index", "0"] for k in (0, 1) for r in ("frontal", "backward")]
# the servers do not compute and the honest volunteers are slowed down, so that every volunteer, the
# liars too, takes work from the first steps on
CHECKED = ["--no-compute", "--client-timeout", "3"]
SLOW = ("--slowdown", "8")


def play(scenario, timeout: float = 600.0):
    return asyncio.run(asyncio.wait_for(scenario(), timeout))


async def run_with(run: HostRun, volunteers: dict[str, tuple[str, ...]]) -> dict:
    """The four servers, then `volunteers` (name -> stage and flags); the servers' statuses once every
    peer has ended by itself."""
    try:
        await run.start_servers(SERVERS)
        for name, (stage, *flags) in volunteers.items():
            run.join(name, stage, *flags)
        codes = await run.ended(timeout=400)
        statuses = {d: host.server.status() for d, host in run.servers.items()}
        return {"codes": codes, "statuses": statuses, "state": run.state()}
    finally:
        await run.close()


def totals(statuses: dict) -> dict:
    """What `peer swarm`'s summary adds up from its servers' statuses."""
    return {
        "banned": sorted({p for s in statuses.values() for p in s["banned"]}),
        "checks": {k: sum(s["checks"].get(k, 0) for s in statuses.values()) for k in ("passed", "caught")},
        "max_honest_distance": max(s["checks"]["max_honest_distance"] for s in statuses.values()),
        "epoch": max(s["epoch"] for s in statuses.values()),
        "applied": min(s["microbatches_applied"] for s in statuses.values()),
    }


def test_liars_of_every_kind_are_banned_and_the_run_equals_the_clean_one(tmp_path, caplog):
    """One liar of each kind from its first task, and one that lies only after 6 honest tasks, past a
    probation of 1 passed check per server (then half of its work is checked): all banned, each told
    the check it failed, and the run ends equal to the reference as if they had never joined."""
    caplog.set_level(logging.WARNING)
    steps = 10
    run = HostRun(tmp_path, "cheats", steps, TWO_STAGES, [*CHECKED, "--probation", "1", "--verify-rate", "0.5"], 0.5)
    liars = {"cheat0": "scale", "cheat1": "signflip", "cheat2": "noise", "cheat3": "zeros", "cheat4": "scale@6"}
    volunteers = {"v0": ("0", *SLOW), "v1": ("1", *SLOW)}
    for i, (name, lie) in enumerate(liars.items()):
        volunteers[name] = (str(i % 2), "--cheat", lie, "--rebalance-period", "0")
    out = play(lambda: run_with(run, volunteers))
    assert out["codes"] == {**dict.fromkeys(("s0f0", "s0b0", "s1f0", "s1b0", "v0", "v1"), 0), **dict.fromkeys(liars, 3)}
    said = {name: run.said[name].getvalue() for name in liars}
    # each liar is told it is banned, with the check it failed, named
    assert all(re.search(r"leaving: banned from run cheats .*relative L2", text) for text in said.values()), said
    late = re.search(r"after (\d+) forward and (\d+) backward tasks", said["cheat4"])
    assert late and int(late.group(1)) + int(late.group(2)) >= 6, said["cheat4"]  # honest until then
    t = totals(out["statuses"])
    assert len(t["banned"]) == 5, t["banned"]
    assert t["checks"]["caught"] >= 5 and t["checks"]["passed"] > 0, t["checks"]
    assert t["max_honest_distance"] < 1e-4  # honest re-runs agree far inside the tolerance
    assert t["epoch"] >= 1  # the rollbacks travel as layout epochs
    assert t["applied"] == steps * DEFAULTS["micro_batches"]  # every micro-batch, at every server
    # equal to the reference, unless the late liar (past probation, half its work checked) lied on work
    # the sample skipped that is older than the kept versions by the time a lie was caught: then the
    # coordinator says which of its work stays applied (README, "Not handled yet"), never in silence
    diff = rel_diff(out["state"], reference_state("tiny", steps))
    assert diff < 1e-5 or "stays applied" in caplog.text, diff


def test_an_8bit_run_moves_about_a_byte_per_activation_value_and_still_catches_a_liar(tmp_path):
    """`--compress 8bit`: activations, their gradients and gradient pushes travel in hivemind's 8-bit
    codec, the run trains to about where the exact run goes, and the servers' checks re-run what
    volunteers received, so honest volunteers pass and the liar alone is banned."""
    steps = 6
    TRAFFIC.clear()  # (counted by every server of this process: the run's servers are all here)
    VALUES.clear()
    run = HostRun(tmp_path, "squeeze", steps, TWO_STAGES, [*CHECKED, "--compress", "8bit"], 0.5)
    volunteers = {"v0": ("0", *SLOW), "v1": ("1", *SLOW), "cheat0": ("0", "--cheat", "signflip")}
    out = play(lambda: run_with(run, volunteers))
    assert out["codes"] == {**dict.fromkeys(("s0f0", "s0b0", "s1f0", "s1b0", "v0", "v1"), 0), "cheat0": 3}
    t = totals(out["statuses"])
    assert t["applied"] == steps * DEFAULTS["micro_batches"]
    assert len(t["banned"]) == 1, t["banned"]  # honest re-runs of 8-bit inputs agree with what was sent
    assert t["checks"]["passed"] > 0 and t["max_honest_distance"] < 1e-3
    cfg = get_preset("tiny")
    # every row of stage 0's outputs reached its backward server at least once; a rollback or a lost
    # lease re-sends some, so the bytes are judged per value sent: float32 takes 4 bytes, 16-bit 2.02;
    # 8-bit 1 plus hivemind's per-tensor header
    values = VALUES["push_outputs"]
    assert values >= steps * 16 * cfg.seq_len * cfg.hidden, values
    assert TRAFFIC["push_outputs.request"] / values < 1.5, (dict(TRAFFIC), values)
    # lossy, so not equal to the reference, but close after a few steps (training moves the parameters
    # ~0.5 of their norm here; measured 0.028-0.052 with processes, depending on which rows the
    # caught liar's re-runs round to 8 bits again)
    assert 1e-6 < rel_diff(out["state"], reference_state("tiny", steps)) < 0.08
