"""The link budget (scheduler/linkbudget.py, `peer simulate --link-budget`): the tokens a volunteer
computes per version reach the utilisation asked for and no fewer would, they scale with FLOP/s over
link and bytes on the wire and not with the model's size, and the command prints them or names what
is wrong."""

import json
import subprocess
import sys

import pytest

from scheduler.files import load_cluster, load_model, load_plan
from scheduler.linkbudget import (
    MODES,
    Fleet,
    Volunteer,
    Wire,
    choose_layout,
    layout_for_links,
    plan_budget,
    seconds,
    stage_size,
    tokens_for,
    utilisation,
)


def spec(layers: int, hidden: int, seq_len: int = 2048) -> object:
    per_layer = 72 * hidden**2 + 12 * seq_len * hidden  # the planner's count (core/model/config.py)
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
    from core.model.config import get_preset, planner_model_file

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


# --- choosing the stages and the batch for a fleet of home links (`peer simulate --choose-layout`)

HOMES = Fleet(1000, (10, 20), (50, 50))


def worst_volunteer(model, row, wire):
    """Per stage of a feasible layout: (compute seconds, link seconds) of its fastest volunteer on the
    slowest link, from first principles: rows in proportion to FLOP/s, volunteers in proportion to
    layers, a token's activations crossing each neighbouring boundary each way."""
    out = []
    r_lo, r_hi = 10e12 * 0.4, 20e12 * 0.4
    total_flops = model.layers * model.flops_per_token_per_layer
    compute = row["batch"] * total_flops / (HOMES.count * (r_lo + r_hi) / 2)
    for s in range(row["stages"]):
        layers = (s + 1) * model.layers // row["stages"] - s * model.layers // row["stages"]
        params, flops = layers * model.params_per_layer, layers * model.flops_per_token_per_layer
        tokens = compute * r_hi / flops
        act = ((s > 0) + (s < row["stages"] - 1)) * model.hidden * wire.act
        out.append((compute, (params * max(wire.down, wire.up) + tokens * act) / 6.25e6))
    return out


@pytest.mark.parametrize("wire", [Wire(), Wire(down=2, act=1), Wire(down=2, up=2, act=1)])
@pytest.mark.parametrize("target", [0.3, 0.5, 0.9])
def test_every_volunteer_of_a_chosen_layout_is_busy_as_asked_and_a_smaller_batch_is_not(wire, target):
    rows, best = choose_layout(ONE_B, HOMES, target, wire)
    for row in rows:
        if row["reason"] is not None:
            continue
        stages = worst_volunteer(ONE_B, row, wire)
        assert all(c / max(c, link) >= target * (1 - 1e-9) for c, link in stages)
        assert row["version_s"] == pytest.approx(max(max(c, link) for c, link in stages))
        assert row["busy"] == pytest.approx(min(c for c, _ in stages) / row["version_s"])
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / row["version_s"])
        smaller = dict(row, batch=row["batch"] * 0.99)
        assert min(c / max(c, link) for c, link in worst_volunteer(ONE_B, smaller, wire)) < target
    assert best is not None and best["batch"] == min(r["batch"] for r in rows if r["reason"] is None)


def test_one_stage_needs_the_link_budgets_tokens_and_no_activations():
    row = layout_for_links(ONE_B, HOMES, 1, 0.5)
    params, flops = stage_size(ONE_B, 1, 0)
    pull = params * 4 / 6.25e6
    assert row["reason"] is None and row["version_s"] == pytest.approx(pull)
    # the fastest volunteer computes what tokens_for says a 20 TFLOP/s volunteer needs
    assert row["tokens"][2] == pytest.approx(tokens_for(ONE_B, 1, HOME, 0.5, "overlapped"), abs=1)  # (it rounds up)
    assert row["tokens"][0] == pytest.approx(row["tokens"][2] / 2)  # 10 TFLOP/s: half the rows
    assert row["batch"] == pytest.approx(1000 * row["tokens"][1])
    # every volunteer pulls every version from the servers in one version's time: 1,000 links of
    # 50 Mbit/s are 50 servers of 1 Gbit/s
    assert row["servers"] == [50]
    assert layout_for_links(ONE_B, HOMES, 1, 0.5, server_mbps=400)["servers"] == [126]  # 125, made even
    assert row["memory_gb"] == pytest.approx(params * 12 / 1e9)


def test_activations_or_memory_rule_a_number_of_stages_out_and_say_why():
    row = layout_for_links(ONE_B, HOMES, 2, 0.5)  # fp32 activations: 8 KiB a token each way
    params, flops = stage_size(ONE_B, 2, 0)
    ceiling = flops / 8e12 / (8192 / 6.25e6)  # a token's compute over its activations' link time
    assert row["reason"].startswith("activations alone (8,192 bytes a token each way)")
    assert f"at most {ceiling:.0%} with a stage of 11 layers" in row["reason"]
    assert layout_for_links(ONE_B, HOMES, 2, 0.5, Wire(act=1))["reason"] is None  # 8-bit activations
    small_gpus = Fleet(1000, (10, 20), (50, 50), memory_gb=12)
    row = layout_for_links(ONE_B, small_gpus, 1, 0.5)
    assert "needs 13.3 GB" in row["reason"] and "12 GB" in row["reason"]
    rows, best = choose_layout(ONE_B, small_gpus, 0.5)
    assert best is None and all(r["reason"] for r in rows)
    rows, best = choose_layout(ONE_B, small_gpus, 0.5, Wire(down=2, act=1))
    assert best["stages"] == 2 and rows[0]["reason"] is None  # bf16 parameters fit in 12 GB too
    assert best["batch"] < rows[0]["batch"]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Fleet(0, (10, 20), (50, 50)),
        lambda: Fleet(10, (20, 10), (50, 50)),
        lambda: Fleet(10, (10, 20), (0, 50)),
        lambda: Fleet(10, (10, 20), (50, 50), mfu=0),
        lambda: layout_for_links(ONE_B, HOMES, 23),
        lambda: layout_for_links(ONE_B, Fleet(2, (10, 20), (50, 50)), 3),
        lambda: layout_for_links(ONE_B, HOMES, 1, 1.0),
        lambda: layout_for_links(ONE_B, HOMES, 1, 0.5, server_mbps=float("inf")),
    ],
)
def test_a_bad_fleet_or_layout_is_refused_by_name(bad):
    with pytest.raises(ValueError):
        bad()


def two_stage_plan(u0_tflops: float):
    cluster = load_cluster(
        {
            "reliable": [{"id": f"s{i}", "tflops": 10} for i in range(4)],
            "unreliable": [{"id": "u0", "tflops": u0_tflops}, {"id": "u1", "tflops": 0.1}],
            "delay_ms": {"reliable": [[0] * 4] * 4, "unreliable": [[30] * 4] * 2},
            "bandwidth_mbps": {"reliable": [[1000] * 4] * 4, "unreliable": [[50] * 4] * 2},
        }
    )
    stages = [
        {"frontal": ["s0"], "backward": ["s1"], "clients": ["u0"], "layers": [0, 2]},
        {"frontal": ["s2"], "backward": ["s3"], "clients": ["u1"], "layers": [2, 4]},
    ]
    return cluster, load_plan({"stages": stages}, cluster)


def test_a_plans_volunteers_move_their_activations_too():
    """Two stages, one volunteer each: u0 (stage 0) receives its output gradients from the backward
    server s1 and sends its outputs to it; u1 (the last stage) its inputs from the frontal server s2
    and its input gradients back; each token's activations take the link beside the parameters."""
    model = spec(4, 512)
    cluster, plan = two_stage_plan(0.1)
    params, flops = 2 * model.params_per_layer, 2 * model.flops_per_token_per_layer
    link, act = params * 4 / 6.25e6, 512 * 4 / 6.25e6  # the stage's parameters; a token's activations
    for b in plan_budget(cluster, model, plan):
        assert b["need"] == -(-0.5 * link // (flops / 0.1e12 - 0.5 * act))
        share, compute = model.batch_tokens, model.batch_tokens * flops / 0.1e12
        busy = compute / max(compute, link + share * act)
        assert 0.5 < busy < 1  # the link matters at this batch, and the activations in it
        assert b["busy"] == (pytest.approx(busy), pytest.approx(busy))
    cluster, plan = two_stage_plan(10)  # 10 TFLOP/s on 50 Mbit/s: its activations alone bind
    first, second = plan_budget(cluster, model, plan)
    assert first["need"] is None and first["batch"] is None
    assert second["need"] is not None


def test_peer_simulate_choose_layout_says_the_stages_and_the_batch_plainly():
    argv = ["--choose-layout", "--model", "1b", "--volunteers", "1000", "--volunteer-tflops", "10-20"]
    argv += ["--volunteer-mbps", "50", "--utilisation", "0.5"]
    out = peer(*argv)
    assert out.returncode == 0, out.stderr
    from core.model.config import get_preset, planner_model_file

    preset = load_model(planner_model_file(get_preset("1b"), 64, 4, bytes_per_value=4))
    _, best = choose_layout(preset, Fleet(1000, (10, 20), (50, 50), memory_gb=24), 0.5)
    assert best["stages"] == 1  # fp32 activations: a second stage's would idle its volunteers
    chosen = next(x for x in out.stdout.splitlines() if x.startswith("chosen:"))
    assert f"a batch of {best['batch']:,.0f} tokens ({best['batch'] / 2048:,.0f} sequences of 2,048)" in chosen
    assert "2-22    no: activations alone" in out.stdout  # the refused tail, once
    got = json.loads(peer(*argv, "--precision", "bf16", "--compress", "8bit", "--json").stdout)
    (result,) = got["results"]
    assert result["chosen"] == 2 and got["seq_len"] == 2048
    assert result["rows"][1]["batch"] < result["rows"][0]["batch"]
    nothing = peer(*argv, "--volunteer-memory-gb", "4")
    assert nothing.returncode == 0 and "chosen: none" in nothing.stdout


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--volunteer-memory-gb", "0"], "--volunteer-memory-gb must be a positive number"),
        (["--compress", "4bit"], "--compress: invalid choice"),
        (["--utilisation", "0"], "--utilisation is a comma-separated list of numbers in (0, 1)"),
        (["--volunteer-mbps", "50-20"], "--volunteer-mbps must be positive numbers LO-HI"),
        (["--link-budget"], "--link-budget and --choose-layout are two reports"),
    ],
)
def test_peer_simulate_choose_layout_names_what_is_wrong(argv, words):
    out = peer("--choose-layout", *argv)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
