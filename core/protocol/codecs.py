"""The codecs of a run's `--compress` (none, fp16, bf16, 8bit): which tensors travel compressed, how
each is serialized, and what a peer receives (`roundtrip`, the tensor a server's check re-runs on).
core/protocol/wire.py packs messages with them."""

from __future__ import annotations

import warnings

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

# hivemind's 8-bit codecs (hivemind.compression.quantization, our --compress 8bit) call torch's
# quantized-tensor functions and a numpy conversion that warn at every use under torch 2.13 and numpy 2
# (deprecations, not wrong values: the round trip is tested in tests/protocol/test_compression.py).
# Silenced for that module alone, so that the warnings a user or the suite sees are about our code.
warnings.filterwarnings("ignore", category=UserWarning, module=r"hivemind\.compression\.quantization")
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"hivemind\.compression\.quantization")

# Opt-in compression of activations, their gradients and gradient pushes (a run's `--compress`),
# with hivemind's codecs: fp16 is FLOAT16, 8bit is UNIFORM_8BIT (a 256-level codebook per tensor), and
# bf16 is a bfloat16 tensor under the NONE codec, widened back to fp32 on arrival. Only fp32 tensors of
# at least MIN_COMPRESSED elements are compressed (not token ids, labels or tiny tensors); "none" is
# exact and the default.
COMPRESSION = ("none", "fp16", "bf16", "8bit")
MIN_COMPRESSED = 1024
CODEC = {
    "none": runtime_pb2.CompressionType.NONE,
    "fp16": runtime_pb2.CompressionType.FLOAT16,
    "bf16": runtime_pb2.CompressionType.NONE,
    "8bit": runtime_pb2.CompressionType.UNIFORM_8BIT,
}
UNIFORM_8BIT_OVERHEAD = 1032  # bytes beside one per element: the codebook and its header


def compressed(t: torch.Tensor, compress: str) -> bool:
    """Whether `t` travels compressed under the run's `compress`."""
    return compress != "none" and t.dtype == torch.float32 and t.numel() >= MIN_COMPRESSED


def serialize(t: torch.Tensor, compress: str):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # (a bfloat16 tensor itself: parameters at --precision bf16)
        return bf16(t)
    if not compressed(t, compress):
        return serialize_torch_tensor(t)
    if compress == "bf16":
        return bf16(t)
    return serialize_torch_tensor(t, CODEC[compress])


def bf16(t: torch.Tensor):
    """`t` as bfloat16 in hivemind's NONE codec's 2-byte form (its serializer widens bfloat16 to 4
    bytes unless USE_LEGACY_BFLOAT16=0 is set before import; its deserializer reads both)."""
    return runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE,
        size=t.shape,
        dtype="bfloat16",
        buffer=t.to(torch.bfloat16).view(torch.int16).numpy().tobytes(),
    )


def roundtrip(t: torch.Tensor, compress: str) -> torch.Tensor:
    """`t` as a peer receives it under `compress` (the identity for "none" and for tensors that are
    not compressed): what a server's check re-runs on, so that it compares like with like."""
    if not compressed(t, compress):
        return t
    out = deserialize_torch_tensor(serialize(t, compress))
    return out.float() if compress == "bf16" else out
