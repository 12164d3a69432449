"""`peer export`: a trained model as a Transformers `LlamaForCausalLM` directory (config.json,
model.safetensors, generation_config.json and a tokenizer), loadable with
`AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)`.

Everything is checked and written into a temporary folder beside OUT, which is renamed to OUT at the
end: bad input leaves nothing behind, and an existing non-empty OUT is never touched."""

from __future__ import annotations

import os
import shutil
import tempfile

from peer.errors import UsageError


def add_arguments(p) -> None:
    p.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        metavar="CHECKPOINT",
        help="a model.safetensors of `peer reference --checkpoint-out` or `peer swarm --checkpoint-out` "
        "(or the folder holding it)",
    )
    p.add_argument(
        "--checkpoint-dirs",
        nargs="+",
        default=None,
        metavar="DIR",
        help="instead: the --checkpoint-dir folders of a run's servers, whose shards make the model",
    )
    p.add_argument("--hf", required=True, metavar="OUT", help="the Transformers model folder to write (new or empty)")
    p.add_argument(
        "--model",
        default=None,
        metavar="PRESET",
        help="the model preset, for a checkpoint that does not record its model",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="HF_DIR",
        help="copy the tokenizer of this Transformers folder (default: the one the checkpoint records: "
        "the byte vocabulary, or the --init-from folder the run started from)",
    )


def run(args) -> int:
    from peer.hf.checkpoints import CheckpointError, load_model_tokenizer, read_checkpoint, read_server_checkpoints

    if (args.checkpoint is None) == (args.checkpoint_dirs is None):
        raise UsageError("give either CHECKPOINT or --checkpoint-dirs")
    out = os.path.abspath(args.hf)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--hf {args.hf}: exists and is not an empty folder")
    try:
        model = (
            read_checkpoint(args.checkpoint, args.model)
            if args.checkpoint is not None
            else read_server_checkpoints(args.checkpoint_dirs, args.model)
        )
        tokenizer = load_model_tokenizer(args.tokenizer or model.tokenizer)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if len(tokenizer) > model.cfg.vocab_size:
        raise UsageError(
            f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary of {model.cfg.vocab_size}"
        )
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    except OSError as e:
        raise UsageError(f"--hf {args.hf}: cannot write there: {e.strerror}") from None
    try:
        write_hf_dir(tmp, model, tokenizer)
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"wrote {out}: LlamaForCausalLM {model.cfg.name!r} ({model.cfg.param_count():,} parameters), "
        f"tokenizer of {len(tokenizer)} tokens"
    )
    return 0


def write_hf_dir(path: str, model, tokenizer) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    from peer.hf.llama import hf_config_kwargs, to_hf_name

    special = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(**hf_config_kwargs(model.cfg), **special)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    GenerationConfig(**{k: v for k, v in special.items() if v is not None}).save_pretrained(path)
    save_file(
        {to_hf_name(n): t.contiguous() for n, t in model.state.items()},
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokenizer.save_pretrained(path)
