"""The transformer, cut into stage slices by layer range.

`StageSlice(cfg, lo, hi)` holds layers [lo, hi) under the full model's parameter names; the first
slice (lo == 0) also holds the embedding, the last (hi == cfg.layers) the final norm and the LM head.
The full model is `StageSlice(cfg, 0, cfg.layers)`, so slices' state dicts assemble into it.

Initialization does not depend on the cut: `init_state` draws every parameter from its own generator
seeded by (seed, parameter name), on the CPU in fp32, so any process can build any slice alone and
get the same numbers as the full model's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from core.model.config import ModelConfig, param_shapes
from core.model.seeding import stable_seed

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class _Linear(nn.Linear):
    """nn.Linear without its own initialization: a slice's values come from init_state or a
    checkpoint. Run on the meta device, nn.Linear's reset still went through torch's Python
    decompositions, ~0.13 ms a layer: 5 of the 6.8 ms a worker spent building the slice of each
    version it computes on (model `small`, two layers)."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    """nn.Embedding without its own initialization (as _Linear; ~1.7 ms on the meta device)."""

    def reset_parameters(self) -> None:
        pass


def _linear(n_in: int, n_out: int, device) -> nn.Linear:
    # created on the meta device and materialized uninitialized by StageSlice: the values come from
    # init_state or a checkpoint
    return _Linear(n_in, n_out, bias=False, device=device)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] for rotate-half rotary embeddings, computed on the CPU
    in float64 and rounded to fp32, so they are the same on every device."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = _linear(cfg.hidden, cfg.hidden, device)
        self.wk = _linear(cfg.hidden, cfg.kv_dim, device)
        self.wv = _linear(cfg.hidden, cfg.kv_dim, device)
        self.wo = _linear(cfg.hidden, cfg.hidden, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = (w(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.kv_heads != self.heads:  # grouped-query attention: kv head i serves query heads i*g .. i*g+g-1
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, h))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.w1 = _linear(cfg.hidden, cfg.ffn_hidden, device)  # gate
        self.w2 = _linear(cfg.ffn_hidden, cfg.hidden, device)  # down
        self.w3 = _linear(cfg.hidden, cfg.ffn_hidden, device)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, device)
        self.attn = Attention(cfg, device)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, device)
        self.mlp = SwiGLU(cfg, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class StageSlice(nn.Module):
    """Layers [lo, hi) of the model, under the full model's parameter names.

    Input: token ids LongTensor [B, S] for the first slice (lo == 0), otherwise the previous slice's
    hidden states float [B, S, hidden]; S <= cfg.seq_len. Output: hidden states [B, S, hidden], or
    logits [B, S, vocab] for the last slice (hi == cfg.layers). The loss is `loss_sum`.

    The parameters are allocated uninitialized on `device` ("meta" allocates nothing, for use with
    `load_state_dict(..., assign=True)`); fill them with `build_slice` or `load_state_dict`.
    """

    def __init__(self, cfg: ModelConfig, lo: int, hi: int, *, device: torch.device | str | None = None):
        super().__init__()
        cfg.check_range(lo, hi)
        self.cfg, self.lo, self.hi = cfg, lo, hi
        meta = torch.device("meta")
        if self.is_first:
            self.embed = _Embedding(cfg.vocab_size, cfg.hidden, device=meta)
        self.layers = nn.ModuleDict({str(i): Block(cfg, meta) for i in range(lo, hi)})
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, meta)
            self.lm_head = _linear(cfg.hidden, cfg.vocab_size, meta)
        target = torch.device("cpu" if device is None else device)
        if target.type != "meta":
            self.to_empty(device=target)
        # the autocast dtype of the run's --precision (core.model.precision; None: fp32)
        self.compute_dtype: torch.dtype | None = None
        # rotary tables: a plain attribute, not a buffer, so the state_dict holds parameters only
        self._rope_cpu = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def is_first(self) -> bool:
        return self.lo == 0

    @property
    def is_last(self) -> bool:
        return self.hi == self.cfg.layers

    def extra_repr(self) -> str:
        return f"model={self.cfg.name!r}, layers=[{self.lo}, {self.hi})"

    def _rope(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._rope_cache:
            self._rope_cache[device] = tuple(t.to(device) for t in self._rope_cpu)
        cos, sin = self._rope_cache[device]
        return cos[:seq], sin[:seq]

    def check_input(self, x: torch.Tensor) -> None:
        """ValueError with a clear message unless `x` is a valid input of this slice."""
        cfg = self.cfg
        if self.is_first:
            if x.dtype != torch.long or x.dim() != 2:
                raise ValueError(f"the first slice takes token ids LongTensor [B, S], got {x.dtype} {list(x.shape)}")
        elif not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != cfg.hidden:
            raise ValueError(
                f"slice [{self.lo}, {self.hi}) takes hidden states float [B, S, {cfg.hidden}], "
                f"got {x.dtype} {list(x.shape)}"
            )
        if x.shape[0] < 1 or not 1 <= x.shape[1] <= cfg.seq_len:
            raise ValueError(f"input shape {list(x.shape)}: need B >= 1 and 1 <= S <= seq_len {cfg.seq_len}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        if self.compute_dtype is None:
            return self._forward(x)
        with torch.autocast(x.device.type, dtype=self.compute_dtype):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.is_first else x
        cos, sin = self._rope(x.shape[1], h.device)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.is_last:
            h = self.lm_head(self.norm(h))
        return h


def init_state(cfg: ModelConfig, lo: int, hi: int, seed: int) -> dict[str, torch.Tensor]:
    """The initial fp32 CPU parameters of slice [lo, hi), each drawn from its own generator seeded by
    (seed, name), so they do not depend on the cut. Norm weights are 1; the embedding, the LM head and
    the input projections are N(0, 0.02); the output projections of each block's residual branches
    (attn.wo, mlp.w2) are N(0, 0.02 / sqrt(2 * layers)) (GPT-2's scaling)."""
    out_std = INIT_STD / math.sqrt(2 * cfg.layers)
    state = {}
    for name, shape in param_shapes(cfg, lo, hi).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
            continue
        std = out_std if name.endswith(("attn.wo.weight", "mlp.w2.weight")) else INIT_STD
        gen = torch.Generator(device="cpu").manual_seed(stable_seed("hivepipe-init", seed, name))
        state[name] = torch.empty(shape).normal_(0.0, std, generator=gen)
    return state


def build_slice(cfg: ModelConfig, lo: int, hi: int, seed: int, device: torch.device | str = "cpu") -> StageSlice:
    """Slice [lo, hi) with its initial parameters (`init_state`), on `device`."""
    return slice_from_state(cfg, lo, hi, init_state(cfg, lo, hi, seed), device)


def slice_from_state(cfg: ModelConfig, lo: int, hi: int, state: dict, device: torch.device | str = "cpu") -> StageSlice:
    """Slice [lo, hi) holding the parameters `state` (moved to `device`, nothing else allocated)."""
    model = StageSlice(cfg, lo, hi, device="meta")
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True)
    return model


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the cross-entropy of `logits` [..., vocab] against `labels` [...], in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
