"""Stage slices: the chain of slices computes exactly what the full model does, forward and
backward, for every preset; parameters do not depend on how the model is cut."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from core.model.config import PRESETS, get_preset, param_shapes
from core.model.transformer import StageSlice, build_slice, init_state, loss_sum


def _cuts(layers: int) -> list[list[tuple[int, int]]]:
    """A few ways to cut [0, layers) into consecutive slices."""
    cuts = [[(i, i + 1) for i in range(layers)]]  # one layer per slice
    if layers >= 3:
        cuts.append([(0, 1), (1, layers - 1), (layers - 1, layers)])  # uneven
    return cuts


def _shared_slice(cfg, lo, hi, state) -> StageSlice:
    """Slice [lo, hi) whose parameters share the full model's tensors (no copy), with its own grads."""
    s = StageSlice(cfg, lo, hi, device="meta")
    s.load_state_dict({k: state[k] for k in param_shapes(cfg, lo, hi)}, assign=True)
    return s


def _chain_forward_backward(slices, tokens, labels):
    """What the pipeline does: each slice gets the previous output detached, and the backward pass
    hands each slice the gradient of its output (its successor's input gradient)."""
    inputs, outputs = [], []
    x = tokens
    for s in slices:
        inputs.append(x)
        out = s(x)
        outputs.append(out)
        x = out.detach().requires_grad_(True)
    logits = outputs[-1]
    loss_sum(logits, labels).backward()
    for k in range(len(slices) - 2, -1, -1):
        outputs[k].backward(inputs[k + 1].grad)
    return logits.detach()


def _check_chain_equals_full(cfg, batch: int, seq: int, cuts) -> None:
    full = build_slice(cfg, 0, cfg.layers, seed=3)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    logits = full(tokens)
    loss_sum(logits, labels).backward()
    logits = logits.detach()
    full_grads = {k: p.grad for k, p in full.named_parameters()}
    state = full.state_dict()
    for cut in cuts:
        slices = [_shared_slice(cfg, lo, hi, state) for lo, hi in cut]
        chained = _chain_forward_backward(slices, tokens, labels)
        assert torch.equal(chained, logits), f"{cfg.name} cut {cut}: logits differ"
        for s in slices:
            for name, p in s.named_parameters():
                assert torch.equal(p.grad, full_grads[name]), f"{cfg.name} cut {cut}: gradient of {name} differs"
        del slices
        gc.collect()


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_chain_equals_full_model_small_presets(name):
    cfg = get_preset(name)
    _check_chain_equals_full(cfg, batch=2, seq=cfg.seq_len, cuts=_cuts(cfg.layers))


@pytest.mark.heavy
def test_chain_equals_full_model_medium():
    # the whole preset (14 layers, ~100M parameters), on a very short input: 1 x 8 tokens
    cfg = get_preset("medium")
    _check_chain_equals_full(cfg, batch=1, seq=8, cuts=_cuts(cfg.layers)[1:])
    gc.collect()


@pytest.mark.heavy
@pytest.mark.parametrize("name, layers", [("large", 3), ("1b", 2)])
def test_chain_equals_full_model_big_widths(name, layers):
    # The full large and 1b presets take 4 and 14 GB here (parameters and two sets of gradients)
    # and 10 to 40 s on 2 shared cores, too heavy for CI. A block's code does not depend on the
    # depth (tiny, small and medium check whole presets), so test truncations of these presets to
    # `layers` layers with exactly their widths, on 1 x 8 tokens.
    cfg = dataclasses.replace(get_preset(name), layers=layers)
    _check_chain_equals_full(cfg, batch=1, seq=8, cuts=_cuts(cfg.layers))
    gc.collect()


@pytest.mark.parametrize("name", list(PRESETS))
def test_slice_names_shapes_and_counts(name):
    cfg = get_preset(name)
    full = StageSlice(cfg, 0, cfg.layers, device="meta")
    shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    assert shapes == param_shapes(cfg, 0, cfg.layers)
    assert list(shapes) == list(param_shapes(cfg, 0, cfg.layers))  # same order too
    assert sum(p.numel() for p in full.parameters()) == cfg.param_count()
    assert cfg.param_count() == cfg.layers * cfg.params_per_layer + 2 * cfg.vocab_size * cfg.hidden + cfg.hidden
    assert "embed.weight" in shapes and "norm.weight" in shapes and "lm_head.weight" in shapes
    assert f"layers.{cfg.layers - 1}.attn.wq.weight" in shapes
    # the slices' names partition the full model's
    mid = cfg.layers // 2
    first, last = StageSlice(cfg, 0, mid, device="meta"), StageSlice(cfg, mid, cfg.layers, device="meta")
    names = list(first.state_dict()) + list(last.state_dict())
    assert names == list(shapes)
    assert first.is_first and not first.is_last and last.is_last and not last.is_first
    assert cfg.param_count(0, mid) + cfg.param_count(mid, cfg.layers) == cfg.param_count()


def test_init_does_not_depend_on_the_cut():
    cfg = get_preset("small")
    full = init_state(cfg, 0, cfg.layers, seed=7)
    for lo, hi in [(0, 1), (1, 3), (3, 4), (2, 4)]:
        part = build_slice(cfg, lo, hi, seed=7).state_dict()
        assert list(part) == list(param_shapes(cfg, lo, hi))
        for k, v in part.items():
            assert torch.equal(v, full[k]), k
    other = init_state(cfg, 0, cfg.layers, seed=8)
    assert not torch.equal(other["layers.0.attn.wq.weight"], full["layers.0.attn.wq.weight"])
    # every matrix is drawn from its own stream: no two parameters share values
    assert not torch.equal(full["layers.0.attn.wq.weight"], full["layers.0.attn.wk.weight"])
    assert torch.equal(full["layers.0.attn_norm.weight"], torch.ones(cfg.hidden))


def test_a_slice_built_from_a_state_runs_no_initializer_of_its_own(monkeypatch):
    """A worker builds the slice of every version it computes on: the values come from the state,
    so torch's initializers (which nn.Linear and nn.Embedding run even on the meta device, slowly)
    are never called, and the slice holds exactly the state."""
    from core.model.transformer import slice_from_state

    def forbidden(*args, **kwargs):
        raise AssertionError("an initializer ran while building a slice from a state")

    cfg = get_preset("tiny")
    state = init_state(cfg, 0, cfg.layers, seed=3)
    for fn in ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_"):
        monkeypatch.setattr(torch.nn.init, fn, forbidden)
    model = slice_from_state(cfg, 0, cfg.layers, state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_initial_loss_is_near_uniform():
    cfg = get_preset("tiny")
    model = build_slice(cfg, 0, cfg.layers, seed=0)
    tokens = torch.randint(0, 256, (4, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = loss_sum(model(tokens), tokens) / tokens.numel()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.05


def test_causal_outputs_do_not_see_the_future():
    cfg = get_preset("tiny")
    model = build_slice(cfg, 0, cfg.layers, seed=0)
    a = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(a)[:, :10], model(b)[:, :10], rtol=0, atol=0)
        assert not torch.allclose(model(a)[:, 10:], model(b)[:, 10:])


def test_bad_inputs_and_ranges_are_rejected():
    cfg = get_preset("tiny")
    first, middle = build_slice(cfg, 0, 2, seed=0), build_slice(cfg, 2, 4, seed=0)
    with pytest.raises(ValueError, match="token ids"):
        first(torch.zeros(1, 4, cfg.hidden))
    with pytest.raises(ValueError, match="hidden states"):
        middle(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden states"):
        middle(torch.zeros(1, 4, cfg.hidden + 1))
    with pytest.raises(ValueError, match="seq_len"):
        first(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))
    for lo, hi in [(2, 2), (-1, 2), (0, 5), (3, 1)]:
        with pytest.raises(ValueError, match="layer range"):
            StageSlice(cfg, lo, hi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    cfg = get_preset("tiny")
    cpu, gpu = build_slice(cfg, 0, cfg.layers, seed=0), build_slice(cfg, 0, cfg.layers, seed=0, device="cuda")
    for k, v in gpu.state_dict().items():
        assert torch.equal(v.cpu(), cpu.state_dict()[k])
    tokens = torch.randint(0, 256, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gpu(tokens.cuda()).cpu(), cpu(tokens), rtol=1e-4, atol=1e-4)
