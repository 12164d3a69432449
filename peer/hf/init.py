"""`--init-from HF_DIR` for `peer reference`, `peer serve` and `peer swarm`: the model's architecture,
its initial parameters (each process reads only its slice) and its tokenizer for `--data`.

Without `--init-from` everything is as before: a preset (`--model`), parameters from `init_state`,
the byte vocabulary. Transformers is imported only when a tokenizer is needed."""

from __future__ import annotations

import json
import os

from peer.errors import UsageError

MODEL_JSON = "model.json"  # beside a server's checkpoint: the architecture and tokenizer `peer export` needs


def add_arguments(group) -> None:
    group.add_argument(
        "--init-from",
        default=None,
        metavar="HF_DIR",
        help="start from a local Transformers LlamaForCausalLM directory (safetensors and its "
        "tokenizer) instead of a preset: --model is ignored, --data goes through its tokenizer",
    )
    group.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help="training window in tokens with --init-from (default: the model's max_position_embeddings, at most 1024)",
    )


def resolve_model(args):
    """(ModelConfig, the checked HFModelDir or None) from --model or --init-from; UsageError naming
    what is wrong."""
    from core.model.config import get_preset

    if getattr(args, "init_from", None):
        from peer.hf.llama import HFModelDir, HFModelError

        if args.seq_len is not None and args.seq_len < 1:
            raise UsageError(f"--seq-len must be >= 1, got {args.seq_len}")
        try:
            hf = HFModelDir.open(args.init_from, seq_len=args.seq_len)
        except HFModelError as e:
            raise UsageError(f"--init-from: {e}") from None
        return hf.cfg, hf
    if getattr(args, "seq_len", None) is not None:
        raise UsageError("--seq-len goes with --init-from (a preset has its own)")
    try:
        return get_preset(args.model), None
    except ValueError as e:
        raise UsageError(str(e)) from None


def corpus_tokenizer(hf, progress: bool = True):
    """The CorpusTokenizer of the model's own tokenizer (None for a preset: bytes)."""
    if hf is None:
        return None
    from peer.hf.tokenizer import CorpusTokenizer, load_tokenizer

    try:
        tokenizer = load_tokenizer(hf.path)
    except ValueError as e:
        raise UsageError(f"--init-from: {e}") from None
    return CorpusTokenizer(tokenizer, hf.cfg.vocab_size, progress=progress)


def load_training_corpus(data, cfg, hf, progress: bool = True):
    """The run's corpus: bytes for a preset, the model's token ids with --init-from."""
    from core.model.data import load_corpus

    try:
        return load_corpus(data, seq_len=cfg.seq_len, tokenizer=corpus_tokenizer(hf, progress))
    except ValueError as e:
        raise UsageError(str(e)) from None


def initial_state(cfg, lo: int, hi: int, seed: int, hf) -> dict:
    """Slice [lo, hi)'s starting parameters: read from the directory, or drawn by `init_state`."""
    if hf is None:
        from core.model.transformer import init_state

        return init_state(cfg, lo, hi, seed)
    from peer.hf.llama import HFModelError

    try:
        return hf.read_slice(lo, hi)
    except HFModelError as e:
        raise UsageError(f"--init-from: {e}") from None


def model_record(cfg, hf) -> dict:
    """What a checkpoint needs beside its tensors for `peer export`: the architecture and where the
    tokenizer is ("bytes" for a preset, the Transformers directory it started from otherwise)."""
    return {"config": cfg.to_dict(), "tokenizer": "bytes" if hf is None else os.path.abspath(hf.path)}


def write_model_json(directory: str, cfg, hf) -> None:
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{MODEL_JSON}.{os.getpid()}.tmp")  # the servers of a local swarm share a folder
    with open(tmp, "w") as f:
        json.dump(model_record(cfg, hf), f, indent=2)
    os.replace(tmp, os.path.join(directory, MODEL_JSON))
