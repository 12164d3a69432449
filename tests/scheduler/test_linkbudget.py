"""The link budget (scheduler/linkbudget.py, `peer simulate --link-budget`): the tokens a volunteer
computes per version reach the utilisation asked for and no fewer would, they scale with FLOP/s over
link and bytes on the wire and not with the model's size, and the command prints them or names what
is wrong."""

import json
import subprocess
import sys

import pytest

from scheduler.files import load_cluster, load_model, load_plan
from scheduler.linkbudget import MODES, Volunteer, plan_budget, seconds, stage_size, tokens_for, utilisation


def spec(layers: int, hidden: int, seq_len: int = 2048) -> object:
    per_layer = 72 * hidden**2 + 12 * seq_len * hidden  # the planner's count (peer/model/config.py)
    return load_model(
        {
            "layers": layers,
            "hidden": hidden,
            "bytes_per_value": 4,
            "batch_tokens": 8192,
            "micro_batches": 4,
            "flops_per_token_per_layer": per_layer,
        }
    )


ONE_B = spec(22, 2048)
HOME = Volunteer(tflops=20, mbps=50)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", [0.1, 0.5, 0.9, 0.99])
def test_the_tokens_reach_the_utilisation_and_one_fewer_does_not(mode, target):
    k = tokens_for(ONE_B, 2, HOME, target, mode)
    worst = min(utilisation(ONE_B, 2, s, HOME, k, mode) for s in range(2))
    assert worst >= target * (1 - 1e-12)
    assert min(utilisation(ONE_B, 2, s, HOME, k - 1, mode) for s in range(2)) < target


def test_a_version_costs_the_stage_parameters_each_way_and_its_flops_per_token():
    params, flops = stage_size(ONE_B, 2, 0)
    assert params == 11 * 12 * 2048**2 and flops == 11 * (72 * 2048**2 + 12 * 2048 * 2048)
    t = seconds(ONE_B, 2, 0, HOME, 1000)
    assert t["pull"] == pytest.approx(params * 4 / 6.25e6) and t["push"] == t["pull"]
    assert t["compute"] == pytest.approx(1000 * flops / 8e12)
    # 566 M parameters in fp32 at 50 Mbit/s: about six minutes each way (the arithmetic)
    assert 300 < t["pull"] < 400


def test_the_tokens_follow_flops_over_link_and_the_bytes_not_the_model_size():
    base = tokens_for(ONE_B, 2, HOME, 0.5, "overlapped")
    faster_link = Volunteer(tflops=20, mbps=200)
    assert tokens_for(ONE_B, 2, faster_link, 0.5, "overlapped") == pytest.approx(base / 4, rel=1e-5)
    bf16 = Volunteer(tflops=20, mbps=50, down_bytes=2, up_bytes=2)
    assert tokens_for(ONE_B, 2, bf16, 0.5, "overlapped") == pytest.approx(base / 2, rel=1e-5)
    # overlapped, only the larger of pull and push counts: a bf16 pull alone saves nothing
    pull_only = Volunteer(tflops=20, mbps=50, down_bytes=2)
    assert tokens_for(ONE_B, 2, pull_only, 0.5, "overlapped") == base
    # a model of another width and depth needs nearly the same (attention's share differs a little)
    medium = tokens_for(spec(14, 768, 1024), 2, HOME, 0.5, "overlapped")
    assert 0.9 < medium / base < 1.3
    # serial: pull + push + compute, so at 50% the compute must equal both transfers
    assert tokens_for(ONE_B, 2, HOME, 0.5, "serial") == pytest.approx(4 * base, rel=1e-5)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Volunteer(tflops=0, mbps=50),
        lambda: Volunteer(tflops=10, mbps=float("nan")),
        lambda: Volunteer(tflops=10, mbps=50, mfu=1.5),
        lambda: tokens_for(ONE_B, 2, HOME, 1.0, "overlapped"),
        lambda: tokens_for(ONE_B, 2, HOME, 0.5, "pipelined"),
        lambda: stage_size(ONE_B, 23, 0),
    ],
)
def test_bad_input_is_refused_by_name(bad):
    with pytest.raises(ValueError):
        bad()


def test_a_plans_volunteers_are_budgeted_with_their_own_flops_and_links():
    """Two servers of one stage, two volunteers: u0 on 50 Mbit/s, u1 ten times faster at compute on
    the same link (it needs ten times the tokens); the busy share at the model's batch follows."""
    cluster = load_cluster(
        {
            "reliable": [{"id": "s0", "tflops": 10}, {"id": "s1", "tflops": 10}],
            "unreliable": [{"id": "u0", "tflops": 1}, {"id": "u1", "tflops": 10}],
            "delay_ms": {"reliable": [[0, 1], [1, 0]], "unreliable": [[30, 30], [30, 30]]},
            "bandwidth_mbps": {"reliable": [[0, 1000], [1000, 0]], "unreliable": [[50, 50], [50, 50]]},
        }
    )
    model = spec(4, 512)
    plan = load_plan(
        {"stages": [{"frontal": ["s0"], "backward": ["s1"], "clients": ["u0", "u1"], "layers": [0, 4]}]}, cluster
    )
    (b,) = plan_budget(cluster, model, plan)
    params, flops = 4 * model.params_per_layer, 4 * model.flops_per_token_per_layer
    link = params * 4 / 6.25e6  # half from each server, one after the other: the whole stage at 50 Mbit/s
    assert b["share"] == model.batch_tokens / 2
    assert b["need"] == -(-0.5 * link * 10e12 // flops)  # u1's: it computes fastest
    assert b["batch"] == 2 * b["need"]
    low, high = b["busy"]
    assert low == pytest.approx(b["share"] * flops / 10e12 / link) and high == pytest.approx(10 * low)
    with pytest.raises(ValueError):
        plan_budget(cluster, model, plan, target=0)


def peer(*argv):
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "simulate", *argv], capture_output=True, text=True, timeout=120
    )


def test_peer_simulate_link_budget_prints_the_tokens_and_the_batch():
    argv = ["--link-budget", "--model", "1b", "--volunteer-tflops", "10-20", "--volunteers", "1000"]
    out = peer(*argv, "--link-mbps", "50", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["tflops"] == 20 and got["stages"] == 2
    rows = {(r["pull"], r["push"], r["mode"]): r["tokens"] for r in got["rows"]}
    from peer.model.config import get_preset, planner_model_file

    preset = load_model(planner_model_file(get_preset("1b"), 64, 4, bytes_per_value=4))
    want = tokens_for(preset, 2, Volunteer(tflops=20, mbps=50), 0.5, "overlapped")
    assert rows[("fp32", "fp32", "overlapped")]["0.5"] == want
    assert rows[("bf16", "bf16", "overlapped")]["0.9"] < rows[("fp32", "fp32", "overlapped")]["0.9"]
    table = peer(*argv)
    assert table.returncode == 0, table.stderr
    assert "50% batch (1,000)" in table.stdout.replace(":", "") and "200 Mbit/s" in table.stdout


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--link-mbps", "fast"], "--link-mbps is a comma-separated list"),
        (["--utilisation", "0.5,1"], "--utilisation is a comma-separated list of numbers in (0, 1)"),
        (["--mfu", "0"], "--mfu is a share of the peak"),
    ],
)
def test_peer_simulate_link_budget_names_what_is_wrong(argv, words):
    out = peer("--link-budget", *argv)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
