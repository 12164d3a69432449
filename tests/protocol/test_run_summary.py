"""`peer summary`: the servers' run summaries merged (tasks and checks summed per volunteer, banned if
any server banned it, micro-batches per stage), and every bad folder or file refused naming it."""

from __future__ import annotations

import json

import pytest

from peer.cli import main
from peer.summary_cmd import FORMAT, merge, write_summary


def summary(device: str, stage: int, **extra) -> dict:
    d = {
        "run_id": "r",
        "device": device,
        "stage": stage,
        "role": "frontal" if device[2] == "f" else "backward",
        "last_stage": stage == 1,
        "steps": 10,
        "loss": 2.5 if stage == 1 else None,
        "eval_loss": None,
        "tokens_per_second": 100.0 + stage,
        "microbatches_applied": 40,
        "volunteers": {},
    }
    return d | extra


def test_the_servers_summaries_merge_into_the_run():
    a = {"Qm1": {"device": "v0", "tasks": 5, "checks_passed": 1, "banned": None}}
    b = {
        "Qm1": {"device": "v0", "tasks": 3, "checks_passed": 2, "banned": "re-run 0.5 off"},
        "Qm2": {"device": "v1", "tasks": 9, "checks_passed": 0, "banned": None},
    }
    m = merge(
        [
            summary("s0f0", 0, volunteers=a),
            summary("s0b0", 0, volunteers=b),
            summary("s1f0", 1, eval_loss=2.7, eval_version=10),
            summary("s1b0", 1),
        ]
    )
    assert m["servers"] == ["s0b0", "s0f0", "s1b0", "s1f0"] and m["steps"] == 10
    assert (m["loss"], m["eval_loss"], m["eval_version"]) == (2.5, 2.7, 10)
    assert m["microbatches_applied"] == 80  # 40 a stage, not 40 a server
    assert m["tokens_per_second"] == 100.0  # the slowest stage's pace
    assert m["volunteers"] == {
        "Qm2": {"device": "v1", "tasks": 9, "checks_passed": 0, "banned": None},
        "Qm1": {"device": "v0", "tasks": 8, "checks_passed": 3, "banned": "re-run 0.5 off"},
    }


def test_a_written_summary_is_read_back_by_the_command(tmp_path, capsys):
    write_summary(str(tmp_path), "s0f0", summary("s0f0", 0))
    write_summary(str(tmp_path), "s1f0", summary("s1f0", 1))
    assert json.loads((tmp_path / "s0f0.run-summary.json").read_text())["format"] == FORMAT
    assert main(["summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("run r: finished at step 10, loss 2.5000, 100 tokens/s")


@pytest.mark.parametrize(
    "case,words",
    [
        ("missing", "not a folder"),
        ("empty", "no *.run-summary.json"),
        ("not-json", "not readable as JSON"),
        ("old-format", "not a run summary of format"),
        ("no-run-id", "field 'run_id' missing"),
        ("two-runs", "the summaries are of 2 runs (a, b)"),
    ],
)
def test_what_is_not_one_runs_summary_is_refused_naming_it(case, words, tmp_path, capsys):
    d = tmp_path / "ckpt"
    if case != "missing":
        d.mkdir()
    if case == "not-json":
        (d / "s0f0.run-summary.json").write_text("{")
    elif case == "old-format":
        (d / "s0f0.run-summary.json").write_text(json.dumps(summary("s0f0", 0) | {"format": 0}))
    elif case == "no-run-id":
        write_summary(str(d), "s0f0", {k: v for k, v in summary("s0f0", 0).items() if k != "run_id"})
    elif case == "two-runs":
        write_summary(str(d), "s0f0", summary("s0f0", 0, run_id="a"))
        write_summary(str(d), "s1f0", summary("s1f0", 1, run_id="b"))
    assert main(["summary", str(d)]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert words in first, first
