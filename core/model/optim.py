"""The update rule, in one place for the reference trainer and the distributed servers.

- Gradient of a batch: the sum over its d micro-batches of d loss_sum(micro-batch) / d params,
  divided by the batch's total token count (so micro-batch gradients average by token count).
- Update: torch.optim.AdamW (the run's core.protocol.recipe.Recipe: betas, eps, weight decay;
  foreach=False) on fp32 master weights, update t at the learning rate `Recipe.lr_at(t)` of the
  run's schedule. AdamW is applied parameter by parameter, so a server holding a shard of the
  parameters with its own AdamW steps them exactly as one AdamW over all of them would.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from core.model.data import split_micro_batches
from core.model.transformer import loss_sum


def make_optimizer(params: Iterable[torch.nn.Parameter], recipe) -> torch.optim.AdamW:
    """AdamW over fp32 master weights with the settings of `recipe` (a core.protocol.recipe.Recipe: its
    `lr` and `adamw()`), at its peak learning rate until `set_lr` says otherwise."""
    return torch.optim.AdamW(params, lr=recipe.lr, foreach=False, **recipe.adamw())


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of the optimizer's next step (the schedule's value for that update)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def batch_gradient(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, micro_batches: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """The gradient of one batch under the update rule, computed on the model's current parameters
    one micro-batch after another (in order). Returns (mean token loss of the batch, {name: grad});
    the model's `.grad` fields are left empty."""
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    total = torch.zeros((), dtype=torch.float64)
    for x, y in split_micro_batches(inputs, labels, micro_batches):
        loss = loss_sum(model(x), y)
        loss.backward()
        total += loss.detach().double().cpu()
    tokens = labels.numel()
    grads = {}
    for name, p in params.items():
        grads[name] = p.grad.div_(tokens) if p.grad is not None else torch.zeros_like(p)
        p.grad = None
    return float(total) / tokens, grads


def apply_update(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    grads: dict[str, torch.Tensor],
    lr: float | None = None,
    clip: float | None = None,
) -> float | None:
    """One optimizer step of `model`'s parameters with the batch gradient `grads` (by name), at
    learning rate `lr` (None: the optimizer's current one), the gradient's global L2 norm clipped to
    `clip` first by torch.nn.utils.clip_grad_norm_ (None: not clipped). Returns the gradient's norm
    before clipping when it clips, else None. `grads` is not changed."""
    if lr is not None:
        set_lr(optimizer, lr)
    params = dict(model.named_parameters())
    for name, p in params.items():
        p.grad = grads[name] if clip is None else grads[name].clone()
    norm = None
    if clip is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), clip, foreach=False))
    optimizer.step()
    for p in params.values():
        p.grad = None
    return norm
