"""parameter_server.blob: the encoding of a server's checkpoints, replicas, kept versions and
request-log records."""

from __future__ import annotations

import torch

from parameter_server import blob


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_any_structure_of_tensors_comes_back_bit_for_bit(tmp_path):
    """A kept version's shape (parameters, AdamW moments as tuples with None before the first step),
    every dtype a server stores, scalars, empty and non-contiguous tensors, a Parameter (stored as
    its data): dtype, shape and bits come back."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4, generator=gen))
    state = {
        "version": 7,
        "token": "ab12",
        "losses": {3: 2.5},
        "snapshot": {"w": w, "b": torch.randn(5, generator=gen).to(torch.bfloat16)},
        "moments": {
            "w": (7.0, torch.randn(3, 4, generator=gen), torch.rand(3, 4, generator=gen)),
            "b": (0.0, None, None),
        },
        "misc": [
            torch.tensor(2.5),
            torch.empty(0, 7),
            torch.randn(4, 4, generator=gen).t(),
            torch.arange(6).half(),
            torch.tensor([True, False]),
            torch.arange(3),
        ],
    }
    data = blob.dumps(state)
    back, again = blob.loads(data), blob.loads(data)
    assert _same({**state, "snapshot": {**state["snapshot"], "w": w.detach()}}, back)
    assert type(back["snapshot"]["w"]) is torch.Tensor and not back["snapshot"]["w"].requires_grad
    back["misc"][0].add_(1)  # each loaded tensor owns its memory (writable, shared with nothing)
    assert float(again["misc"][0]) == 2.5 and blob.loads(data)["misc"][0].item() == 2.5
    path = str(tmp_path / "x.pt")
    blob.save(state, path)
    assert _same(blob.load(path)["moments"], state["moments"])


def test_a_file_torch_save_wrote_before_still_loads(tmp_path):
    state = {"version": 2, "params": {"w": torch.ones(2, 3)}, "moments": {"w": (2.0, torch.zeros(2, 3), None)}}
    torch.save(state, tmp_path / "old.pt")
    assert _same(blob.load(str(tmp_path / "old.pt")), state)
    assert not (tmp_path / "old.pt").read_bytes().startswith(blob.MAGIC)
