"""`peer plan`: planning, scoring, and bad input (a message naming the field, exit code 2)."""

import json
import subprocess
import sys

import pytest

from peer import plan_cmd
from peer.cli import main
from scheduler import ALGORITHMS, scenarios


@pytest.fixture
def files(tmp_path):
    cluster = tmp_path / "cluster.json"
    model = tmp_path / "model.json"
    cluster.write_text(json.dumps(scenarios.random_cluster(4, 5, 3)))
    model.write_text(json.dumps(scenarios.small_model(4)))
    return tmp_path, str(cluster), str(model)


def test_algorithm_names_match_the_scheduler():
    assert plan_cmd.ALGORITHMS == ALGORITHMS


def test_plan_writes_a_plan_and_prints_the_layout(files, capsys):
    tmp, cluster, model = files
    out = tmp / "plan.json"
    assert main(["plan", cluster, model, "-o", str(out), "--time-limit", "1"]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["predicted_seconds_per_batch"] > 0
    for word in (
        "stage",
        "layers",
        "frontal servers",
        "backward servers",
        "clients",
        "tau_k",
        "idle volunteers",
        "predicted seconds per batch",
    ):
        assert word in text
    for st in plan["stages"]:
        for d in st["frontal"] + st["backward"]:
            assert d in text
    assert f"{plan['predicted_seconds_per_batch']:.4f}" in text
    # scoring the written plan gives the same number
    assert main(["plan", "--score", str(out), cluster, model]) == 0
    assert f"{plan['predicted_seconds_per_batch']:.4f}" in capsys.readouterr().out


def test_plan_prints_the_link_budget_of_each_stage_with_volunteers(files, capsys):
    """A scored plan whose one stage has volunteers: what their links leave of their compute at the
    model's batch and the tokens a version each needs for 50% (scheduler/linkbudget.py)."""
    tmp, cluster, model = files
    c = json.loads(open(cluster).read())
    r, u = [d["id"] for d in c["reliable"]], [d["id"] for d in c["unreliable"]]
    layers = json.loads(open(model).read())["layers"]
    plan = tmp / "with-clients.json"
    stages = [{"frontal": r[:2], "backward": r[2:], "clients": u[:2], "layers": [0, layers]}]
    plan.write_text(json.dumps({"stages": stages, "idle": u[2:]}))
    assert main(["plan", "--score", str(plan), cluster, model]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("link budget, stage 0:"))
    assert "tokens a version at this batch, busy" in line and "50% needs" in line, line


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_by_name(files, algorithm, capsys):
    _, cluster, model = files
    # the searches stop at the limit; the exact one ends when it has proved its best (milliseconds on
    # this cluster) and fails at the limit, which a loaded machine's 0.5 s of wall time did not leave it
    limit = "60" if algorithm == "exact" else "0.5"
    assert main(["plan", cluster, model, "--algorithm", algorithm, "--time-limit", limit, "--seed", "3"]) == 0
    assert f"plan by {algorithm}" in capsys.readouterr().out


def test_score_an_invalid_plan(files, capsys):
    tmp, cluster, model = files
    bad = tmp / "bad.json"
    bad.write_text(json.dumps({"stages": [{"frontal": ["s0"], "backward": ["s1"], "layers": [0, 4]}], "idle": []}))
    assert main(["plan", "--score", str(bad), cluster, model]) == 2
    assert "invalid plan: reliable device s2 is not a server of any stage" in capsys.readouterr().err


def test_bad_files_name_the_field_and_exit_2(files, capsys):
    tmp, cluster, model = files
    d = json.loads(open(cluster).read())
    d["delay_ms"]["reliable"][2] = d["delay_ms"]["reliable"][2][:3]
    broken = tmp / "broken.json"
    broken.write_text(json.dumps(d))
    assert main(["plan", str(broken), model]) == 2
    assert "cluster.delay_ms.reliable[2]: expected 5 values, got 3" in capsys.readouterr().err
    m = json.loads(open(model).read())
    del m["hidden"]
    broken.write_text(json.dumps(m))
    assert main(["plan", cluster, str(broken)]) == 2
    assert "model.hidden: missing" in capsys.readouterr().err
    assert main(["plan", cluster, model, "--score", str(tmp / "nothing.json")]) == 2
    assert "plan: cannot read" in capsys.readouterr().err
    assert main(["plan", cluster, model, "--time-limit", "0"]) == 2
    assert "--time-limit" in capsys.readouterr().err


def test_exact_refusal_is_a_clear_error(tmp_path, capsys):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(scenarios.hps_datacenter(0)))
    model = tmp_path / "m.json"
    model.write_text(json.dumps(scenarios.EXAMPLE_MODEL))
    assert main(["plan", str(cluster), str(model), "--algorithm", "exact"]) == 2
    assert "exhaustive search is limited to 6 reliable" in capsys.readouterr().err


def test_as_a_process(files):
    _, cluster, model = files
    r = subprocess.run(
        [sys.executable, "-m", "peer.cli", "plan", cluster, model, "--algorithm", "paper"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "predicted seconds per batch" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "peer.cli", "plan", cluster, "/nonexistent/model.json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "model: cannot read" in r.stderr
