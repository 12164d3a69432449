"""Model configurations: the size presets, parameter shapes and counts, and the planner's model file.

Pure Python (no torch), so that `peer model-file` and `peer --help` start fast and the planner side
can read a preset without the model.

Parameter names are those of the full model's `state_dict` (a stage slice uses the same names):

    embed.weight                          [vocab, hidden]          (first slice only)
    layers.{i}.attn_norm.weight           [hidden]
    layers.{i}.attn.{wq,wo}.weight        [hidden, hidden]
    layers.{i}.attn.{wk,wv}.weight        [kv_heads * head_dim, hidden]  (grouped-query attention)
    layers.{i}.mlp_norm.weight            [hidden]
    layers.{i}.mlp.{w1,w3}.weight         [ffn_hidden, hidden]     (w1: gate, w3: up)
    layers.{i}.mlp.w2.weight              [hidden, ffn_hidden]     (down)
    norm.weight                           [hidden]                 (last slice only)
    lm_head.weight                        [vocab, hidden]          (last slice only; not tied)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

BYTE_VOCAB = 256


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-style transformer (RMSNorm, rotary causal attention, SwiGLU, no dropout)."""

    name: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    ffn_hidden: int
    seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as `heads`

    def __post_init__(self):
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        for field_name in ("vocab_size", "hidden", "layers", "heads", "ffn_hidden", "seq_len", "kv_heads"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {self.name!r}: {field_name} must be an integer >= 1, got {value!r}")
        for field_name in ("rope_theta", "norm_eps"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"model {self.name!r}: {field_name} must be a number > 0, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model {self.name!r}: rotary embeddings need an even head size, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections' outputs."""
        return self.kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Parameters of one transformer block: 4 attention projections, 3 MLP matrices, 2 norms."""
        h, f = self.hidden, self.ffn_hidden
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * f + 2 * h

    def check_range(self, lo: int, hi: int) -> None:
        """Raise ValueError unless [lo, hi) is a non-empty layer range of this model."""
        if not (0 <= lo < hi <= self.layers):
            raise ValueError(
                f"layer range [{lo}, {hi}) is not a non-empty part of [0, {self.layers}) of model {self.name!r}"
            )

    def param_count(self, lo: int = 0, hi: int | None = None) -> int:
        """Parameters of the slice [lo, hi) (default: the whole model)."""
        return sum(_numel(s) for s in param_shapes(self, lo, self.layers if hi is None else hi).values())

    def to_dict(self) -> dict:
        return asdict(self)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def param_shapes(cfg: ModelConfig, lo: int, hi: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the slice [lo, hi), in the module's state_dict order."""
    cfg.check_range(lo, hi)
    h, f, v = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {}
    if lo == 0:
        shapes["embed.weight"] = (v, h)
    for i in range(lo, hi):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (h,)
        shapes[p + "attn.wq.weight"] = (h, h)
        shapes[p + "attn.wk.weight"] = (cfg.kv_dim, h)
        shapes[p + "attn.wv.weight"] = (cfg.kv_dim, h)
        shapes[p + "attn.wo.weight"] = (h, h)
        shapes[p + "mlp_norm.weight"] = (h,)
        shapes[p + "mlp.w1.weight"] = (f, h)
        shapes[p + "mlp.w2.weight"] = (h, f)
        shapes[p + "mlp.w3.weight"] = (f, h)
    if hi == cfg.layers:
        shapes["norm.weight"] = (h,)
        shapes["lm_head.weight"] = (v, h)
    return shapes


PRESETS: dict[str, ModelConfig] = {
    cfg.name: cfg
    for cfg in (
        # tests: a forward+backward takes milliseconds on a CPU
        ModelConfig("tiny", BYTE_VOCAB, hidden=32, layers=4, heads=4, ffn_hidden=96, seq_len=32),
        # the demo: ~0.92M parameters, trains visibly in a few minutes on 2 CPU cores
        ModelConfig("small", BYTE_VOCAB, hidden=128, layers=4, heads=4, ffn_hidden=384, seq_len=128),
        # planning and GPUs
        ModelConfig("medium", BYTE_VOCAB, hidden=768, layers=14, heads=12, ffn_hidden=2048, seq_len=1024),
        ModelConfig("large", BYTE_VOCAB, hidden=1024, layers=24, heads=16, ffn_hidden=3328, seq_len=2048),
        # TinyLlama's widths (with full multi-head attention): ~1.13B parameters
        ModelConfig("1b", BYTE_VOCAB, hidden=2048, layers=22, heads=32, ffn_hidden=5632, seq_len=2048),
    )
}


def model_from_dict(d) -> ModelConfig:
    """A ModelConfig from its `to_dict()` (as a run's config record carries it); ValueError naming
    the field that is missing, unknown or wrong."""
    if not isinstance(d, dict):
        raise ValueError(f"model architecture: expected a map, got {type(d).__name__}")
    known = set(ModelConfig.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"model architecture: unknown fields {unknown}")
    missing = sorted(
        k for k in ("name", "vocab_size", "hidden", "layers", "heads", "ffn_hidden", "seq_len") if k not in d
    )
    if missing:
        raise ValueError(f"model architecture: missing fields {missing}")
    if not isinstance(d["name"], str):
        raise ValueError("model architecture: field 'name' must be a string")
    return ModelConfig(**d)


def run_model(model: str, arch: dict | None = None) -> ModelConfig:
    """The model of a run: its recorded architecture when it has one (a run started from a
    Transformers checkpoint), else the preset called `model`."""
    return model_from_dict(arch) if arch else get_preset(model)


def get_preset(name: str) -> ModelConfig:
    """The preset called `name`; ValueError listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}") from None


def flops_per_token_per_layer(cfg: ModelConfig) -> int:
    """Training FLOPs (forward + backward) per token for one block.

    `6 * params_per_layer + 12 * seq_len * hidden`:
    - every weight costs 2 FLOPs per token in the forward pass (multiply-add) and 4 in the backward
      pass (gradients of the input and of the weight), hence 6 per parameter (the 2 norm vectors are
      counted too; they are 0.1% of a block);
    - attention's two sequence-sized products, Q.K^T and softmax.V, cost 2 * seq_len * hidden each per
      token forward, so 4 * seq_len * hidden forward and 12 * seq_len * hidden forward + backward.
      The causal mask's saving (half of it) is not taken, as is usual for FLOP counts (PaLM, Megatron);
    - softmax, norms, rotary embeddings and activations (O(hidden) per token) are left out, and so
      are the embedding and the LM head, which are not per layer.
    For hidden h and ffn_hidden 8/3 h this is 72 h^2 + 12 S h, the cost model's default 72 h^2 plus
    attention.
    """
    return 6 * cfg.params_per_layer + 12 * cfg.seq_len * cfg.hidden


def check_micro_batches(batch_size: int, micro_batches: int) -> None:
    """ValueError unless a batch of `batch_size` rows cuts into `micro_batches` equal micro-batches."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if micro_batches < 1 or batch_size % micro_batches:
        raise ValueError(f"micro-batches {micro_batches} must be >= 1 and divide the batch size {batch_size}")


def planner_model_file(cfg: ModelConfig, batch_size: int, micro_batches: int, bytes_per_value: int = 2) -> dict:
    """The planner's model file (docs/cost-model.md) for training `cfg` on batches of
    `batch_size` sequences of cfg.seq_len tokens cut into `micro_batches` micro-batches."""
    check_micro_batches(batch_size, micro_batches)
    if bytes_per_value < 1:
        raise ValueError(f"bytes per value must be >= 1, got {bytes_per_value}")
    return {
        "layers": cfg.layers,
        "hidden": cfg.hidden,
        "bytes_per_value": bytes_per_value,
        "batch_tokens": batch_size * cfg.seq_len,
        "micro_batches": micro_batches,
        "flops_per_token_per_layer": flops_per_token_per_layer(cfg),
    }
