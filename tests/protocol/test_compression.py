"""Opt-in compression on the wire (`--compress`): hivemind's codecs for fp32 activations and
gradients, what a receiver accepts, and `roundtrip` (what a server's check re-runs on)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.proto.runtime_pb2 import ExpertRequest

from core.protocol.codecs import COMPRESSION, MIN_COMPRESSED, roundtrip
from core.protocol.wire import PayloadError, pack, stream_of, unpack


def _unpack(messages, accept):
    return asyncio.run(unpack(stream_of(messages), accept=accept))


@pytest.mark.parametrize(
    "mode,ratio,error", [("none", 1.0, 0.0), ("fp16", 0.5, 1e-3), ("bf16", 0.5, 1e-2), ("8bit", 0.27, 5e-2)]
)
def test_each_mode_shrinks_activations_and_arrives_as_its_roundtrip(mode, ratio, error):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 128, generator=gen)
    labels = torch.randint(0, 256, (4, 64), generator=gen)
    small = torch.randn(8, generator=gen)  # below MIN_COMPRESSED: exact
    exact = sum(m.ByteSize() for m in pack({}, [x, labels, small], ExpertRequest))
    messages = pack({"k": 1}, [x, labels, small], ExpertRequest, compress=mode)
    size = sum(m.ByteSize() for m in messages)
    meta, (x2, labels2, small2) = _unpack(messages, accept=mode)
    assert meta == {"k": 1}
    assert x2.dtype == torch.float32 and torch.equal(labels2, labels) and torch.equal(small2, small)
    assert torch.equal(x2, roundtrip(x, mode))  # the receiver sees exactly what a check re-runs on
    assert float((x2 - x).norm() / x.norm()) <= error
    payload = x.numel() * 4
    assert abs((size - (exact - payload)) - ratio * payload) < 0.02 * payload, (mode, size, exact)


def test_a_compressed_tensor_is_refused_where_the_run_does_not_compress():
    x = torch.randn(MIN_COMPRESSED * 2)
    for mode in ("fp16", "8bit"):
        with pytest.raises(PayloadError, match="compression .* is not accepted"):
            _unpack(pack({}, [x], ExpertRequest, compress=mode), accept="none")
    with pytest.raises(PayloadError, match="compression .* is not accepted"):
        _unpack(pack({}, [x], ExpertRequest, compress="8bit"), accept="fp16")
    # an exact tensor is always accepted
    assert torch.equal(_unpack(pack({}, [x], ExpertRequest), accept="8bit")[1][0], x)


def test_a_compressed_tensor_whose_bytes_do_not_fit_its_shape_is_refused_before_it_is_built():
    x = torch.randn(MIN_COMPRESSED * 2)
    messages = pack({}, [x], ExpertRequest, compress="fp16")
    messages[1].tensors[0].size[:] = [MIN_COMPRESSED * 1000]
    with pytest.raises(PayloadError, match="needs .* bytes"):
        _unpack(messages, accept="fp16")


def test_the_run_config_names_a_known_mode():
    from core.protocol.records import RunConfig

    base = {
        "run_id": "r",
        "model": "tiny",
        "seed": 0,
        "steps": 1,
        "batch_size": 4,
        "micro_batches": 2,
        "lr": 1e-3,
        "layout": {},
        "announce_period": 1.0,
    }
    assert RunConfig.from_dict(base).compress == "none"
    assert RunConfig.from_dict(dict(base, compress="8bit")).compress == "8bit"
    with pytest.raises(ValueError, match="'compress' must be one of"):
        RunConfig.from_dict(dict(base, compress="zip"))
    assert set(COMPRESSION) == {"none", "fp16", "bf16", "8bit"}


def test_uncompressed_fp32_tensors_travel_as_one_and_arrive_as_they_left():
    """A shard's parameters or gradient (many fp32 tensors) go as one vector with their shapes in the
    metadata, and arrive split back, bit for bit; other dtypes beside them, or a codec, keep one
    tensor each on the wire."""
    from core.protocol.wire import FLAT, decode_meta

    gen = torch.Generator().manual_seed(0)
    shard = [
        torch.randn(4, 3, generator=gen),
        torch.randn(7, generator=gen),
        torch.empty(0, 2),
        torch.tensor(1.5),
        torch.randn(6, 5, generator=gen).t(),
    ]
    messages = pack({"names": list("abcde")}, shard, ExpertRequest)
    assert decode_meta(messages[0].metadata)["n_tensors"] == 1
    meta, back = _unpack(messages, "none")
    assert meta == {"names": list("abcde")} and FLAT not in meta
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(shard, back, strict=True))
    mixed = [torch.randn(2, 2, generator=gen), torch.arange(3)]
    assert decode_meta(pack({}, mixed, ExpertRequest)[0].metadata)["n_tensors"] == 2
    big = [torch.randn(MIN_COMPRESSED, generator=gen), torch.randn(MIN_COMPRESSED, generator=gen)]
    assert decode_meta(pack({}, big, ExpertRequest, compress="fp16")[0].metadata)["n_tensors"] == 2


@pytest.mark.parametrize(
    "shapes,tensors,error",
    [
        ([[2, 2]], [torch.zeros(5)], "hold 4 values, 5 arrived"),
        ([[2, 2], [1]], [torch.zeros(5), torch.zeros(1)], "one float32 vector"),
        ([[5]], [torch.zeros(5, dtype=torch.float64)], "one float32 vector"),
        ([[5]], [torch.zeros(1, 5)], "one float32 vector"),
        ([[-1, -4]], [torch.zeros(4)], "tensor shapes"),
        ([[True]], [torch.zeros(1)], "tensor shapes"),
        ("4", [torch.zeros(4)], "tensor shapes"),
        ([], [torch.zeros(0)], "tensor shapes"),
        ([[1]] * 5000, [torch.zeros(5000)], "tensor shapes"),
    ],
)
def test_a_flat_field_that_does_not_fit_what_arrived_is_refused(shapes, tensors, error):
    from core.protocol.wire import FLAT

    messages = (
        pack({FLAT: shapes}, tensors, ExpertRequest)
        if len(tensors) == 1
        else pack({FLAT: shapes}, tensors, ExpertRequest, compress="fp16")
    )
    with pytest.raises(PayloadError, match=error):
        _unpack(messages, "fp16")
