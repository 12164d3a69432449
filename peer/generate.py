"""`peer generate`: text from a trained model (a hivepipe checkpoint or a Transformers directory), to
stdout: the prompt followed by what the model writes.

Greedy decoding picks the most likely token at every step, as Transformers' `generate(do_sample=False)`
does; sampling uses a temperature and nucleus (top-p) cut from a seeded generator. The model sees at
most its training window (seq_len tokens): a longer text keeps its last seq_len tokens."""

from __future__ import annotations

import sys

from peer.errors import UsageError


def add_arguments(p) -> None:
    p.add_argument(
        "source",
        metavar="CHECKPOINT_OR_HF_DIR",
        help="a model.safetensors of hivepipe (or its folder), or a Transformers LlamaForCausalLM folder",
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="always the most likely token (the default)")
    mode.add_argument("--temperature", type=float, default=None, metavar="T", help="sample at temperature T > 0")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample from the smallest set of tokens holding probability P (with --temperature; default 1.0)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--model", default=None, metavar="PRESET", help="for a checkpoint that does not record its model")
    p.add_argument("--tokenizer", default=None, metavar="HF_DIR", help="use this folder's tokenizer instead")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def run(args) -> int:
    from peer.hf.checkpoints import CheckpointError, load_model_tokenizer, read_any

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature is not None and not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_p != 1.0 and args.temperature is None:
        raise UsageError("--top-p goes with --temperature (greedy decoding takes the top token)")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device!r}: CUDA is not available here")
    try:
        model = read_any(args.source, args.model)
        tokenizer = load_model_tokenizer(args.tokenizer or model.tokenizer)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    prompt = tokenizer(args.prompt)["input_ids"]
    if not prompt:
        raise UsageError("--prompt gives no tokens")
    if max(prompt) >= model.cfg.vocab_size:
        raise UsageError(
            f"the tokenizer gives id {max(prompt)}, outside the model's vocabulary of {model.cfg.vocab_size}"
        )
    ids = generate(
        model.cfg,
        model.state,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        device=device,
        eos=getattr(tokenizer, "eos_token_id", None),
    )
    sys.stdout.write(tokenizer.decode(ids, skip_special_tokens=True) + "\n")
    sys.stdout.flush()
    return 0


def generate(
    cfg,
    state: dict,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    device="cpu",
    eos: int | None = None,
) -> list[int]:
    """`prompt` followed by up to `max_new_tokens` tokens (stopping after `eos`); greedy when
    `temperature` is None."""
    import torch

    from core.model.transformer import slice_from_state

    model = slice_from_state(cfg, 0, cfg.layers, state, device).eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            window = torch.tensor([ids[-cfg.seq_len :]], dtype=torch.long, device=device)
            logits = model(window)[0, -1].float().cpu()
            if temperature is None:
                nxt = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                if top_p < 1.0:
                    sorted_p, order = probs.sort(descending=True)
                    keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix reaching top_p
                    probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
                nxt = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
            ids.append(nxt)
            if eos is not None and nxt == eos:
                break
    return ids
