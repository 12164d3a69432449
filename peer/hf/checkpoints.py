"""Reading a trained model back, whatever holds it: a `model.safetensors` that `peer reference` or
`peer swarm --checkpoint-out` wrote (architecture and tokenizer in its metadata), the servers'
checkpoint folders of a multi-host run (model.json beside the shards), or a Transformers directory.
Every reader checks the tensors against the architecture and raises CheckpointError naming what is
wrong."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from core.model.config import ModelConfig, get_preset, model_from_dict, param_shapes
from peer.hf.init import MODEL_JSON

CHECKPOINT_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model it claims to be (the message names the file,
    field or tensor)."""


@dataclass
class TrainedModel:
    cfg: ModelConfig
    state: dict  # hivepipe parameter name -> fp32 CPU tensor
    tokenizer: str  # "bytes", or a Transformers directory holding the tokenizer


def _model_of(record: dict | None, preset: str | None, where: str) -> tuple[ModelConfig, str]:
    if preset:
        try:
            return get_preset(preset), "bytes"
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    if record is None:
        raise CheckpointError(f"{where}: does not say which model it holds (no hivepipe metadata); give --model PRESET")
    try:
        return model_from_dict(record["config"]), str(record.get("tokenizer", "bytes"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: unreadable model record: {e}") from None


def check_state(state: dict, cfg: ModelConfig, where: str) -> dict:
    """`state` as fp32 CPU tensors if it is exactly `cfg`'s parameters (names, shapes, finite)."""
    import torch

    from core.protocol.fields import all_finite

    shapes = param_shapes(cfg, 0, cfg.layers)
    missing = [n for n in shapes if n not in state]
    if missing:
        raise CheckpointError(f"{where}: tensor(s) {', '.join(missing[:3])} missing (model {cfg.name!r})")
    extra = sorted(set(state) - set(shapes))
    if extra:
        raise CheckpointError(f"{where}: tensor(s) {', '.join(extra[:3])} are not parameters of model {cfg.name!r}")
    out = {}
    for n, shape in shapes.items():
        t = state[n]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{where}: tensor {n} has shape {list(t.shape)}, model {cfg.name!r} has {list(shape)}"
            )
        if not t.is_floating_point() or not all_finite(t):
            raise CheckpointError(f"{where}: tensor {n} is not finite floating point")
        out[n] = t.to(torch.float32).contiguous()
    return out


def read_checkpoint(path: str, preset: str | None = None) -> TrainedModel:
    """A `model.safetensors` (or a folder holding one) of `peer reference` / `peer swarm`."""
    from safetensors import safe_open

    file = os.path.join(path, CHECKPOINT_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: no such checkpoint file (expected a {CHECKPOINT_FILE} or a folder holding one)")
    try:
        with safe_open(file, framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{file}: not a safetensors file: {str(e)[:200]}") from None
    record = None
    if "config" in meta:
        try:
            record = {"config": json.loads(meta["config"]), "tokenizer": meta.get("tokenizer", "bytes")}
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{file}: metadata 'config' is not JSON: {e}") from None
    cfg, tokenizer = _model_of(record, preset, file)
    return TrainedModel(cfg, check_state(state, cfg, file), tokenizer)


def read_server_checkpoints(directories: list[str], preset: str | None = None) -> TrainedModel:
    """The model the servers' checkpoint folders of a run hold together (every stage's shards)."""
    from parameter_server.checkpoint import read_model

    record = None
    for d in directories:
        if not os.path.isdir(d):
            raise CheckpointError(f"--checkpoint-dirs: {d} is not a folder")
        path = os.path.join(d, MODEL_JSON)
        if record is None and os.path.exists(path):
            try:
                with open(path) as f:
                    record = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: {e}") from None
    try:
        state, _ = read_model(directories)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    cfg, tokenizer = _model_of(record, preset, " ".join(directories))
    return TrainedModel(cfg, check_state(state, cfg, "the checkpoint folders"), tokenizer)


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json"))


def read_any(path: str, preset: str | None = None) -> TrainedModel:
    """A hivepipe checkpoint or a Transformers directory (config.json + safetensors)."""
    if is_hf_dir(path):
        from peer.hf.llama import HFModelDir, HFModelError

        try:
            hf = HFModelDir.open(path)
            return TrainedModel(hf.cfg, hf.read_slice(0, hf.cfg.layers), os.path.abspath(path))
        except HFModelError as e:
            raise CheckpointError(str(e)) from None
    return read_checkpoint(path, preset)


def load_model_tokenizer(ref: str):
    """The tokenizer a checkpoint names: the byte tokenizer, or the one of a Transformers directory."""
    from peer.hf.tokenizer import byte_tokenizer, load_tokenizer

    if ref == "bytes":
        return byte_tokenizer()
    try:
        return load_tokenizer(ref)
    except ValueError as e:
        raise CheckpointError(f"the model's tokenizer: {e} (give --tokenizer DIR)") from None
