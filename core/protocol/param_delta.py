"""A parameter version sent as its difference from one the receiver holds, exactly.

A worker that holds version v-1 of a slot and needs version v asks for v "against" v-1 (the
`get_params` fields `base` and `base_digest`). Every coordinate moves at every AdamW step, so a
difference of values is as large as the version; but a step moves each value by a small fraction of
itself, so the bits of the two versions agree in their sign, exponent and leading mantissa bits.
The difference sent is the bitwise XOR of the two versions' bytes in the wire dtype, its bytes
regrouped by their position in a value (all first bytes, then all second bytes, ...: the planes that
are mostly zero become long runs) and deflated. The receiver XORs it onto the bytes it holds and
gets the version's bits exactly: nothing is rounded, and a run pulling differences stays equal to
`peer reference`.

A server sends a difference only when the base's digest is the receiver's (the same bits: a
rollback, a failover or a replica cannot make them differ unseen) and the deflated difference is
under DELTA_SMALLER of the version's bytes (measured on each version, not assumed)."""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import torch

# a difference is sent only when it is this much smaller than the version it stands for
DELTA_SMALLER = 0.9
ENCODING = "xor-deflate"
LEVEL = 1  # zlib's fastest: on this machine's CPU ~50 MB/s in, and the higher levels gain ~2% more


def _bytes(tensors: list[torch.Tensor]) -> np.ndarray:
    """The tensors' bytes in order, one flat uint8 array (a copy)."""
    parts = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _width(tensors: list[torch.Tensor]) -> int:
    widths = {t.element_size() for t in tensors}
    if len(widths) != 1:
        raise ValueError(f"a slot's tensors share one wire dtype, got element sizes {sorted(widths)}")
    return widths.pop()


def digest(names: list[str], tensors: list[torch.Tensor]) -> str:
    """SHA-256 of the tensors (each one's name, dtype, shape and bytes, in order, whatever the dtype):
    what a receiver and a server compare before a difference against a version is used, and the
    digest of a kept version (ShardState.digest) and of a replica's step by reference."""
    h = hashlib.sha256()
    for n, t in zip(names, tensors):
        h.update(f"{n}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def difference(base: list[torch.Tensor], target: list[torch.Tensor]) -> bytes:
    """`target` as its difference from `base` (same shapes and dtype), whatever its size."""
    if [tuple(t.shape) for t in base] != [tuple(t.shape) for t in target] or {t.dtype for t in base} != {
        t.dtype for t in target
    }:
        raise ValueError("a difference needs the base's shapes and dtype")
    width = _width(target)
    x = np.bitwise_xor(_bytes(base), _bytes(target))
    planes = x.reshape(-1, width).T  # row k: byte k of every value
    return zlib.compress(np.ascontiguousarray(planes).tobytes(), LEVEL)


def encode(base: list[torch.Tensor], target: list[torch.Tensor]) -> bytes | None:
    """`target` as its difference from `base`, or None when that is not under DELTA_SMALLER of
    `target`'s bytes (the version goes whole)."""
    blob = difference(base, target)
    return blob if len(blob) < DELTA_SMALLER * sum(t.numel() * t.element_size() for t in target) else None


def decode(base: list[torch.Tensor], blob: bytes) -> list[torch.Tensor]:
    """The version that `blob` (encode's) stands for, given the `base` it was made against (ValueError
    when the blob does not fit the base: another length, not deflate)."""
    width = _width(base)
    size = sum(t.numel() * t.element_size() for t in base)
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(blob, size + 1)
    except zlib.error as e:
        raise ValueError(f"a parameter difference that does not inflate: {e}") from None
    if len(raw) != size or inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(f"a parameter difference of {len(raw)} bytes for a base of {size}")
    planes = np.frombuffer(raw, np.uint8).reshape(width, -1)
    x = np.bitwise_xor(np.ascontiguousarray(planes.T).reshape(-1), _bytes(base))
    out, at = [], 0
    for t in base:
        n = t.numel() * t.element_size()
        out.append(torch.from_numpy(x[at : at + n].copy()).view(t.dtype).reshape(t.shape))
        at += n
    return out
