"""hivepipe's transformer <-> a Transformers `LlamaForCausalLM` directory: the architecture (config.json),
the parameter names, and reading one stage's tensors out of the directory's safetensors files.

hivepipe's model is a Llama (RMSNorm, rotate-half rotary attention, SwiGLU, no biases), so the
conversion is a renaming; what the architecture does not have (biases, rope scaling, another
activation, another model type) is refused naming the config field. Tied embeddings are read (the
LM head starts as a copy of the embedding) and trained untied: the embedding lives on the first
stage and the head on the last, which may be different hosts; an export writes them untied.

Reads only config.json and safetensors (no Transformers import), so a server with its stage's
layers reads just those tensors (safetensors opens a file without reading the rest).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from core.model.config import ModelConfig, param_shapes

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SEQ_LEN = 1024  # a training window when --seq-len is not given (max_position_embeddings can be 128k)

# hivepipe name (per layer i) <-> Transformers name
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
}
_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


class HFModelError(ValueError):
    """A directory that is not a Transformers Llama model hivepipe can train: the message names the
    file, field or tensor."""


def to_hf_name(name: str) -> str:
    """hivepipe parameter name -> Transformers LlamaForCausalLM name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise KeyError(f"not a hivepipe parameter name: {name!r}")


def _get(config: dict, key: str, kind, path: str):
    if key not in config:
        raise HFModelError(f"{path}: missing field {key!r}")
    value = config[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise HFModelError(f"{path}: field {key!r} must be {kinds[0].__name__}, got {value!r}")
    return value


def config_from_hf(config: dict, *, name: str, seq_len: int | None = None, path: str = CONFIG_FILE) -> ModelConfig:
    """The ModelConfig of a Transformers Llama config.json (a dict); HFModelError naming the field
    for anything hivepipe's architecture does not have. `seq_len` is the training window (default:
    max_position_embeddings, at most DEFAULT_MAX_SEQ_LEN)."""
    model_type = config.get("model_type")
    if model_type != "llama":
        raise HFModelError(
            f"{path}: field 'model_type' is {model_type!r}; only 'llama' (LlamaForCausalLM) is supported"
        )
    archs = config.get("architectures")
    if archs is not None and archs != ["LlamaForCausalLM"]:
        raise HFModelError(f"{path}: field 'architectures' is {archs!r}; only ['LlamaForCausalLM'] is supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise HFModelError(f"{path}: field 'hidden_act' is {act!r}; only 'silu' (SwiGLU) is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False):
            raise HFModelError(f"{path}: field {flag!r} is true; biases are not supported")
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise HFModelError(f"{path}: field 'rope_parameters' must be a map, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFModelError(f"{path}: field 'rope_parameters.rope_type' is {rope_type!r}; rope scaling is not supported")
    if config.get("rope_scaling"):
        raise HFModelError(f"{path}: field 'rope_scaling' is {config['rope_scaling']!r}; rope scaling is not supported")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise HFModelError(f"{path}: field 'rope_theta' must be a positive number, got {theta!r}")
    hidden = _get(config, "hidden_size", int, path)
    heads = _get(config, "num_attention_heads", int, path)
    kv_heads = config.get("num_key_value_heads") or heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int):
        raise HFModelError(f"{path}: field 'num_key_value_heads' must be int, got {kv_heads!r}")
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != hidden:
        raise HFModelError(
            f"{path}: field 'head_dim' is {head_dim}, not hidden_size / num_attention_heads "
            f"({hidden} / {heads}); only that head size is supported"
        )
    max_pos = _get(config, "max_position_embeddings", int, path)
    if seq_len is None:
        seq_len = min(max_pos, DEFAULT_MAX_SEQ_LEN)
    elif seq_len > max_pos:
        raise HFModelError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    eps = config.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise HFModelError(f"{path}: field 'rms_norm_eps' must be a positive number, got {eps!r}")
    try:
        return ModelConfig(
            name=name,
            vocab_size=_get(config, "vocab_size", int, path),
            hidden=hidden,
            layers=_get(config, "num_hidden_layers", int, path),
            heads=heads,
            ffn_hidden=_get(config, "intermediate_size", int, path),
            seq_len=seq_len,
            rope_theta=float(theta),
            norm_eps=float(eps),
            kv_heads=kv_heads,
        )
    except ValueError as e:
        raise HFModelError(f"{path}: {e}") from None


def hf_config_kwargs(cfg: ModelConfig) -> dict:
    """`LlamaConfig(**kwargs)` for `cfg`'s architecture, embeddings untied (see the module's docstring)."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


@dataclass
class HFModelDir:
    """A checked Transformers Llama directory: its architecture and where each tensor is."""

    path: str
    cfg: ModelConfig
    tied: bool  # the LM head is the embedding (no lm_head.weight in the files)
    where: dict[str, str]  # Transformers tensor name -> safetensors file path

    @classmethod
    def open(cls, path: str, *, seq_len: int | None = None) -> "HFModelDir":
        """Check `path` (config.json, safetensors files, every tensor's presence and shape) without
        reading any tensor's values; HFModelError naming what is wrong."""
        if not os.path.isdir(path):
            raise HFModelError(
                f"{path}: not a directory (a Transformers model directory holds config.json and model.safetensors)"
            )
        cfg_path = os.path.join(path, CONFIG_FILE)
        try:
            with open(cfg_path) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise HFModelError(f"{path}: no {CONFIG_FILE}: not a Transformers model directory") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFModelError(f"{cfg_path}: cannot be read as JSON: {e}") from None
        if not isinstance(config, dict):
            raise HFModelError(f"{cfg_path}: expected a JSON object")
        name = os.path.basename(os.path.normpath(path)) or "hf"
        cfg = config_from_hf(config, name=f"hf:{name}", seq_len=seq_len, path=cfg_path)
        where = _tensor_files(path)
        tied = bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in where
        model = cls(path=path, cfg=cfg, tied=tied, where=where)
        model._check_shapes()
        return model

    def _check_shapes(self) -> None:
        from safetensors import safe_open

        wanted = {to_hf_name(n): s for n, s in param_shapes(self.cfg, 0, self.cfg.layers).items()}
        if self.tied:
            wanted.pop("lm_head.weight")
        missing = sorted(set(wanted) - set(self.where))
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise HFModelError(
                f"{self.path}: tensor(s) {', '.join(missing[:3])}{more} missing from the safetensors files"
            )
        by_file: dict[str, list[str]] = {}
        for hf_name in wanted:
            by_file.setdefault(self.where[hf_name], []).append(hf_name)
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for hf_name in names:
                    shape = tuple(f.get_slice(hf_name).get_shape())
                    if shape != tuple(wanted[hf_name]):
                        raise HFModelError(
                            f"{file}: tensor {hf_name} has shape {list(shape)}, the config says {list(wanted[hf_name])}"
                        )

    def read_slice(self, lo: int, hi: int) -> dict:
        """hivepipe's state dict of layers [lo, hi) (with the embedding when lo == 0, the final norm and
        head when hi == layers) as fp32 CPU tensors, reading only those tensors."""
        import torch
        from safetensors import safe_open

        from core.protocol.fields import all_finite

        names = param_shapes(self.cfg, lo, hi)
        source = {
            n: ("model.embed_tokens.weight" if n == "lm_head.weight" and self.tied else to_hf_name(n)) for n in names
        }
        by_file: dict[str, list[str]] = {}
        for n, hf_name in source.items():
            by_file.setdefault(self.where[hf_name], []).append(n)
        state = {}
        for file, ours in by_file.items():
            with safe_open(file, framework="pt") as f:
                for n in ours:
                    t = f.get_tensor(source[n]).to(torch.float32)
                    if not all_finite(t):
                        raise HFModelError(f"{file}: tensor {source[n]} holds NaN or infinite values")
                    # a tied head is a copy of the embedding: trained apart from it (see above)
                    state[n] = t.clone() if n == "lm_head.weight" and self.tied else t.contiguous()
        return {n: state[n] for n in names}


def _tensor_files(path: str) -> dict[str, str]:
    """Transformers tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, WEIGHTS_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a map")
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFModelError(f"{index}: not a safetensors index: {e}") from None
        where = {}
        for name, file in weight_map.items():
            full = os.path.join(path, str(file))
            if not os.path.isfile(full):
                raise HFModelError(f"{index}: names {file}, which is not in {path}")
            where[name] = full
        return where
    if not os.path.isfile(single):
        found = [f for f in sorted(os.listdir(path)) if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"))]
        hint = f" (found {', '.join(found)}: only safetensors weights are read; convert them)" if found else ""
        raise HFModelError(f"{path}: no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")
    try:
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as e:
        raise HFModelError(f"{single}: not a safetensors file: {e}") from None
