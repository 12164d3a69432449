"""Presets, the FLOP count and the planner's model file (`peer model-file`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from core.model.config import PRESETS, flops_per_token_per_layer, get_preset, planner_model_file


def test_presets_have_the_sizes_they_promise():
    assert list(PRESETS)[:2] == ["tiny", "small"]
    assert all(cfg.vocab_size == 256 for cfg in PRESETS.values())
    assert 0.8e6 < get_preset("small").param_count() < 1.2e6
    assert 90e6 < get_preset("medium").param_count() < 110e6
    assert 320e6 < get_preset("large").param_count() < 380e6
    assert 1.0e9 < get_preset("1b").param_count() < 1.2e9
    assert get_preset("1b").hidden == 2048


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown model preset 'xl'.*tiny, small, medium, large, 1b"):
        get_preset("xl")


def test_planner_model_file():
    cfg = get_preset("small")
    m = planner_model_file(cfg, batch_size=16, micro_batches=4)
    assert m == {
        "layers": 4,
        "hidden": 128,
        "bytes_per_value": 2,
        "batch_tokens": 16 * 128,
        "micro_batches": 4,
        "flops_per_token_per_layer": 6 * cfg.params_per_layer + 12 * 128 * 128,
    }
    # close to the cost model's default 72 h^2 when attention's share is small
    big = get_preset("1b")
    assert (
        abs(flops_per_token_per_layer(big) - 12 * big.seq_len * big.hidden - 72 * big.hidden**2)
        < 0.03 * 72 * big.hidden**2
    )
    with pytest.raises(ValueError, match="divide"):
        planner_model_file(cfg, batch_size=16, micro_batches=3)


def _model_file(*args):
    return subprocess.run([sys.executable, "-m", "peer.cli", "model-file", *args], capture_output=True, text=True)


def test_model_file_cli(tmp_path):
    out = tmp_path / "model.json"
    r = _model_file("--model", "1b", "--batch-size", "256", "--micro-batches", "128", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text()) == planner_model_file(get_preset("1b"), 256, 128)
    r = _model_file("--model", "nope", "-o", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "unknown model preset" in r.stderr and not (tmp_path / "x.json").exists()
    r = _model_file("--batch-size", "16", "--micro-batches", "5")
    assert r.returncode == 2 and "divide" in r.stderr
