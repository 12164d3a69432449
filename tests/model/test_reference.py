"""The update rule and the reference trainer: delayed updates, determinism, and the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from core.model.config import get_preset
from core.model.data import make_batch
from core.model.optim import apply_update, batch_gradient, make_optimizer
from core.model.transformer import StageSlice, build_slice
from core.protocol.recipe import Recipe
from peer.reference import train_reference

CFG = get_preset("tiny")
RUN = dict(seed=4, batch_size=8, micro_batches=2, lr=1e-2, progress=False)


def _train(corpus, steps, delay, **kw):
    return train_reference(CFG, corpus, steps=steps, delay=delay, **{**RUN, **kw})


def _assert_states_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_optimizer_is_the_shared_rule():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer([p], Recipe(lr=0.5))
    group = opt.param_groups[0]
    d = Recipe()
    assert group["lr"] == 0.5 and group["betas"] == d.betas == (0.9, 0.95)
    assert group["eps"] == d.eps == 1e-8 and group["weight_decay"] == d.weight_decay == 0.01
    assert group["foreach"] is False and isinstance(opt, torch.optim.AdamW)
    opt = make_optimizer([p], Recipe(lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0))
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.1, (0.8, 0.99), 1e-6, 0.0)


def test_micro_batch_gradients_average_by_token_count(default_corpus):
    model = build_slice(CFG, 0, CFG.layers, seed=0)
    x, y = make_batch(default_corpus, 0, 0, 8, CFG.seq_len)
    loss1, g1 = batch_gradient(model, x, y, 1)
    loss4, g4 = batch_gradient(model, x, y, 4)
    assert abs(loss1 - loss4) < 1e-5
    assert all(p.grad is None for p in model.parameters())
    for k in g1:
        torch.testing.assert_close(g4[k], g1[k], rtol=1e-4, atol=1e-7)


def test_delay_1_computes_the_first_two_gradients_on_the_initial_parameters(default_corpus):
    seen = {}

    def on_step(info):
        seen[info.step] = (info.updates_applied, info.loss, {k: v.clone() for k, v in info.grads.items()})

    _train(default_corpus, 4, 1, on_step=on_step)
    assert [seen[t][0] for t in range(4)] == [0, 0, 1, 2]
    initial = build_slice(CFG, 0, CFG.layers, seed=RUN["seed"])
    for t in (0, 1):
        x, y = make_batch(default_corpus, RUN["seed"], t, RUN["batch_size"], CFG.seq_len)
        loss, grads = batch_gradient(initial, x, y, RUN["micro_batches"])
        assert loss == seen[t][1]
        for k in grads:
            assert torch.equal(grads[k], seen[t][2][k]), (t, k)


def test_delay_1_follows_the_rule_step_by_step(default_corpus):
    """Unrolled by hand: g0, g1 on θ0; apply u0; g2 on θ0+u0; apply u1; g3; apply u2; then u3."""
    state, summary = _train(default_corpus, 4, 1)
    model = build_slice(CFG, 0, CFG.layers, seed=RUN["seed"])
    opt = make_optimizer(model.parameters(), Recipe(lr=RUN["lr"]))

    def grad(t):
        x, y = make_batch(default_corpus, RUN["seed"], t, RUN["batch_size"], CFG.seq_len)
        return batch_gradient(model, x, y, RUN["micro_batches"])

    (l0, g0), (l1, g1) = grad(0), grad(1)
    apply_update(opt, model, g0)
    l2, g2 = grad(2)
    apply_update(opt, model, g1)
    l3, g3 = grad(3)
    apply_update(opt, model, g2)
    apply_update(opt, model, g3)
    assert summary["losses"] == [l0, l1, l2, l3]
    _assert_states_equal(state, model.state_dict())


def test_each_update_takes_the_schedules_learning_rate_and_the_recipes_adamw(default_corpus):
    """Unrolled by hand with the cosine schedule after a warm-up: update u at lr_at(u), AdamW with the
    recipe's betas, eps and weight decay; and not the constant-rate run."""
    recipe = Recipe(lr=RUN["lr"], schedule="cosine", warmup_steps=1, min_lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1)
    state, summary = _train(default_corpus, 4, 1, recipe=recipe)
    assert summary["recipe"] == recipe.record()
    model = build_slice(CFG, 0, CFG.layers, seed=RUN["seed"])
    opt = make_optimizer(model.parameters(), recipe)

    def grad(t):
        x, y = make_batch(default_corpus, RUN["seed"], t, RUN["batch_size"], CFG.seq_len)
        return batch_gradient(model, x, y, RUN["micro_batches"])

    (_, g0), (_, g1) = grad(0), grad(1)
    apply_update(opt, model, g0, recipe.lr_at(0, 4))
    _, g2 = grad(2)
    apply_update(opt, model, g1, recipe.lr_at(1, 4))
    _, g3 = grad(3)
    apply_update(opt, model, g2, recipe.lr_at(2, 4))
    apply_update(opt, model, g3, recipe.lr_at(3, 4))
    _assert_states_equal(state, model.state_dict())
    constant, _ = _train(default_corpus, 4, 1)
    assert any(not torch.equal(state[k], constant[k]) for k in state)


def test_a_clipped_update_is_clip_grad_norm_over_the_whole_model(default_corpus):
    recipe = Recipe(lr=RUN["lr"], clip_grad_norm=0.5)
    state, summary = _train(default_corpus, 3, 0, recipe=recipe)
    model = build_slice(CFG, 0, CFG.layers, seed=RUN["seed"])
    opt = make_optimizer(model.parameters(), recipe)
    norms = []
    for t in range(3):
        x, y = make_batch(default_corpus, RUN["seed"], t, RUN["batch_size"], CFG.seq_len)
        _, g = batch_gradient(model, x, y, RUN["micro_batches"])
        for name, p in model.named_parameters():
            p.grad = g[name]
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=False)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    _assert_states_equal(state, model.state_dict())
    assert summary["grad_norms"] == norms and all(n > 0.5 for n in norms)  # (every step clipped)


def test_delay_0_and_1_differ_after_the_first_step(default_corpus):
    s0, sum0 = _train(default_corpus, 3, 0)
    s1, sum1 = _train(default_corpus, 3, 1)
    assert sum0["losses"][0] == sum1["losses"][0]  # both on θ0
    assert sum0["losses"][1] != sum1["losses"][1]  # delay 0: on θ0+u0; delay 1: still θ0
    assert any(not torch.equal(s0[k], s1[k]) for k in s0)
    initial = build_slice(CFG, 0, CFG.layers, seed=RUN["seed"]).state_dict()
    assert all(not torch.equal(s1[k], initial[k]) for k in s1)  # every parameter got its updates


def test_runs_are_deterministic_and_report_a_summary(default_corpus):
    s_a, sum_a = _train(default_corpus, 3, 1)
    s_b, sum_b = _train(default_corpus, 3, 1)
    _assert_states_equal(s_a, s_b)
    assert sum_a["losses"] == sum_b["losses"]
    for key in ("steps", "first_loss", "last_loss", "wall_seconds", "tokens_per_second"):
        assert key in sum_a
    assert (
        sum_a["steps"] == 3 and sum_a["first_loss"] == sum_a["losses"][0] and sum_a["last_loss"] == sum_a["losses"][-1]
    )
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in s_a.values())
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is restored


def test_loss_falls(default_corpus):
    _, summary = train_reference(
        CFG, default_corpus, steps=30, seed=0, batch_size=8, micro_batches=2, delay=1, lr=1e-2, progress=False
    )
    assert summary["first_loss"] > 5.4
    assert sum(summary["losses"][-5:]) / 5 < 4.0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(steps=0), "steps"),
        (dict(micro_batches=3), "divide"),
        (dict(delay=2), "delay"),
        (dict(lr=0.0), "learning rate"),
    ],
)
def test_train_reference_rejects_bad_arguments(default_corpus, kw, match):
    args = dict(steps=2, delay=1, **RUN)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        train_reference(CFG, default_corpus, **args)


# ---- the CLI, in a separate process ------------------------------------------------------------


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "reference", *args], capture_output=True, text=True, cwd=cwd
    )


def test_cli_writes_checkpoint_and_summary_equal_to_in_process_run(tmp_path, default_corpus):
    ck, summary_path = tmp_path / "ck", tmp_path / "out" / "summary.json"
    r = _cli(
        "--model",
        "tiny",
        "--steps",
        "3",
        "--seed",
        "4",
        "--batch-size",
        "8",
        "--micro-batches",
        "2",
        "--lr",
        "1e-2",
        "--checkpoint-out",
        str(ck),
        "--summary-json",
        str(summary_path),
    )
    assert r.returncode == 0, r.stderr
    assert "loss" in r.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 3 and summary["first_loss"] > summary["last_loss"] - 1
    assert summary["wall_seconds"] > 0 and summary["tokens_per_second"] > 0

    from safetensors.torch import load_file

    saved = load_file(str(ck / "model.safetensors"))
    model = StageSlice(CFG, 0, CFG.layers)
    model.load_state_dict(saved, strict=True)
    assert set(saved) == set(model.state_dict())
    assert "embed.weight" in saved and "lm_head.weight" in saved and "layers.3.mlp.w2.weight" in saved
    state, in_process = _train(default_corpus, 3, 1)  # same run in this process: same parameters
    _assert_states_equal(dict(sorted(state.items())), dict(sorted(saved.items())))
    assert in_process["losses"] == summary["losses"]


@pytest.mark.parametrize(
    "args, match",
    [
        (["--data", "/nonexistent/corpus.txt"], "corpus.txt.*does not exist"),
        (["--data", "EMPTY"], "empty"),
        (["--model", "huge"], "unknown model preset 'huge'.*tiny, small"),
        (["--batch-size", "16", "--micro-batches", "5"], "divide"),
        (["--steps", "0"], "steps must be >= 1"),
    ],
)
def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, args, match, capsys):
    """Through the command's own entry point (`peer.cli.main`), in this process."""
    from peer.cli import main

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    ck, summary = tmp_path / "ck", tmp_path / "s.json"
    code = main(["reference", "--model", "tiny", *args, "--checkpoint-out", str(ck), "--summary-json", str(summary)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error:" in err
    assert re.search(match, err), err
    assert not ck.exists() and not summary.exists()
