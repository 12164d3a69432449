"""A run's compute precision (`--precision fp32|bf16`), in one place for the volunteers, the servers'
checks and `peer reference`.

bf16 is mixed precision as torch's autocast makes it: fp32 master parameters and AdamW on the servers;
a task's forward and backward under `torch.autocast(dtype=bfloat16)` (CPU and CUDA) on the master
parameters rounded to bfloat16 (what the volunteers are sent: half the bytes of fp32); the loss in
fp32 (core.model.transformer.loss_sum); gradients, activations between stages and input gradients
in fp32 on the wire unless `--compress` says otherwise. `peer reference --precision bf16` computes
each batch gradient on the same rounded parameters under the same autocast, so the only difference
left between the swarm and the reference is where rows are cut into tasks (bf16 rounds each
matmul's output, so a sum over rows cut otherwise rounds otherwise: docs/training.md)."""

from __future__ import annotations

import torch

_DTYPE = {"fp32": None, "bf16": torch.bfloat16}
PRECISIONS = tuple(_DTYPE)  # (the run config record checks the same names: core.protocol.records)


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of `precision` (None: fp32, no autocast); ValueError for another name."""
    if precision not in _DTYPE:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return _DTYPE[precision]


def wire_dtype(precision: str) -> torch.dtype:
    """The dtype parameters are sent to volunteers in."""
    return compute_dtype(precision) or torch.float32


def rounded(state: dict[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """The parameters a task computes on: fp32 tensors holding the values of `state` rounded to the
    precision's dtype (the identity at fp32)."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return state
    return {k: v.to(dtype).float() for k, v in state.items()}
