"""A parameter version as its difference from the one a worker holds (core/protocol/param_delta.py):
exact, sent only where smaller, and refused where it does not fit."""

import pytest
import torch

from core.protocol import param_delta


def step(tensors, rel=1e-3, seed=0):
    """An AdamW-sized step: every value moves by about `rel` of the tensors' scale."""
    g = torch.Generator().manual_seed(seed)
    return [t + rel * torch.randn(t.shape, generator=g) * t.float().std() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_version_comes_back_bit_for_bit_from_its_difference(dtype):
    g = torch.Generator().manual_seed(1)
    base = [(torch.randn(shape, generator=g) * 0.02).to(dtype) for shape in ((64, 48), (48,), (3, 5, 7))]
    target = [t.to(dtype) for t in step([b.float() for b in base])]
    blob = param_delta.encode(base, target)
    assert blob is not None and len(blob) < 0.9 * sum(t.numel() * t.element_size() for t in target)
    back = param_delta.decode(base, blob)
    for t, b in zip(target, back):
        assert b.dtype == dtype and b.shape == t.shape
        assert torch.equal(t.view(torch.uint8) if t.dim() else t, b.view(torch.uint8) if b.dim() else b)
    assert param_delta.digest(["a", "b", "c"], back) == param_delta.digest(["a", "b", "c"], target)


def test_a_difference_no_smaller_than_the_version_is_not_sent():
    g = torch.Generator().manual_seed(2)
    base = [torch.randn(4096, generator=g)]
    unrelated = [torch.randn(4096, generator=g)]  # every bit differs at random: nothing to gain
    assert param_delta.encode(base, unrelated) is None
    same = param_delta.encode(base, [base[0].clone()])  # nothing moved: all zeros, a few bytes
    assert same is not None and len(same) < 100
    assert torch.equal(param_delta.decode(base, same)[0], base[0])


def test_a_difference_that_does_not_fit_its_base_is_refused_by_name():
    base = [torch.zeros(16)]
    blob = param_delta.encode(base, [torch.ones(16)])
    assert blob is not None
    with pytest.raises(ValueError, match="for a base of 32"):
        param_delta.decode([torch.zeros(8)], blob)  # another base: another length
    with pytest.raises(ValueError, match="does not inflate"):
        param_delta.decode(base, b"not deflate")
    with pytest.raises(ValueError, match="shapes and dtype"):
        param_delta.encode(base, [torch.zeros(8)])
    with pytest.raises(ValueError, match="one wire dtype"):
        param_delta.decode([torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)], blob)


def test_the_digest_tells_bits_names_and_dtypes_apart():
    a = [torch.tensor([1.0, 2.0])]
    assert param_delta.digest(["w"], a) == param_delta.digest(["w"], [torch.tensor([1.0, 2.0])])
    assert param_delta.digest(["w"], a) != param_delta.digest(["v"], a)
    assert param_delta.digest(["w"], a) != param_delta.digest(["w"], [torch.tensor([1.0, 2.0000002])])
    assert param_delta.digest(["w"], a) != param_delta.digest(["w"], [a[0].to(torch.bfloat16)])
