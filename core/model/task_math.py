"""What one task computes, as a pure function of a stage slice (holding the task's parameter version)
and its rows: the forward pass of a stage that is not the last, and the backward pass (recomputing
the forward) with the loss on the last stage or the output gradient on the others. The volunteer's
worker runs these, and a server re-runs them to check a volunteer's work (parameter_server/verify.py):
one definition, so the check compares like with like."""

from __future__ import annotations

import torch

from core.model.transformer import StageSlice, loss_sum


def forward_rows(model: StageSlice, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The slice's output for rows x (no graph kept), fp32 on the CPU."""
    with torch.no_grad():
        return model(x.to(device)).float().cpu()


def backward_rows(
    model: StageSlice,
    x: torch.Tensor,
    device: torch.device,
    total_tokens: int,
    out_grad: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
):
    """Recompute the slice on rows x and backpropagate the loss (labels given: the last stage, the
    loss sum divided by the batch's tokens) or the output gradient. Returns (input gradient or None
    on the first stage, loss sum or None, {parameter name: gradient} fp32 on the CPU)."""
    model.zero_grad(set_to_none=True)
    x = x.to(device)
    if not model.is_first:
        x = x.detach().requires_grad_(True)
    out = model(x)
    loss = None
    if labels is not None:
        ls = loss_sum(out, labels.to(device))
        (ls / total_tokens).backward()
        loss = float(ls.detach())
    else:
        out.backward(out_grad.to(device))
    gin = None if model.is_first else x.grad.detach().float().cpu()
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu()
        for n, p in model.named_parameters()
    }
    return gin, loss, grads


class KeptForward:
    """A forward pass kept with its autograd graph (its input, its output and the activations
    autograd saved), so that the backward pass of the same rows runs without recomputing the forward.
    Valid as long as the slice that ran it keeps its parameters unchanged."""

    def __init__(self, x: torch.Tensor, out: torch.Tensor, nbytes: int):
        self.x, self.out, self.nbytes = x, out, nbytes


def forward_keeping(model: StageSlice, x: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, KeptForward]:
    """The slice's output for rows x (fp32 on the CPU) and the kept pass; its size counts what autograd
    saved for the backward pass (parameters excluded: they are not a copy). A first-order backward
    only (saved tensors come back detached)."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.data_ptr() not in params:
            saved += t.numel() * t.element_size()
        # a detached alias (same storage, no grad_fn), never `t` itself: an op that saves its own output
        # (rsqrt, attention) would else hold tensor -> grad_fn -> saved tensor in a cycle through C++
        # that gc cannot break, and a pass dropped without its backward would never be freed
        return t.detach()

    x = x.to(device)
    if not model.is_first:
        x = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    kept = KeptForward(x, out, saved + out.numel() * out.element_size() + x.numel() * x.element_size())
    return out.detach().float().cpu(), kept


def backward_kept(model: StageSlice, kept: KeptForward, out_grad: torch.Tensor, device: torch.device):
    """The backward pass of a kept forward (the graph is freed): (input gradient or None on the first
    stage, None, {parameter name: gradient} fp32 on the CPU), as backward_rows returns them."""
    named = list(model.named_parameters())
    inputs = [p for _, p in named] if model.is_first else [kept.x] + [p for _, p in named]
    res = torch.autograd.grad(kept.out, inputs, out_grad.to(device), allow_unused=True)
    gin = None if model.is_first else res[0].detach().float().cpu()
    pgrads = res if model.is_first else res[1:]
    grads = {
        n: (g if g is not None else torch.zeros_like(p)).detach().float().cpu() for (n, p), g in zip(named, pgrads)
    }
    return gin, None, grads
