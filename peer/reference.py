"""`peer reference`: single-process training with exactly the swarm's update rule, the yardstick
that every distributed run's parameters are compared with.

Batch t is `make_batch(corpus, seed, t, ...)`; its gradient follows core.model.optim (micro-batch
gradients of the summed loss, added in order and divided by the batch's tokens) and update u is
AdamW at the learning rate `Recipe.lr_at(u)` of the run's schedule (core.protocol.recipe).

Delayed parameter update (`delay=1`, the swarm's rule): the gradient of batch t is computed on the
parameters that include the updates of batches 0..t-2 only, and its update is applied after batch
t+1's gradient is computed; so g_0 and g_1 are both computed on the initial parameters, g_2 on
θ0+u_0, and so on. At the end the pending update is applied, so the final parameters include all
`steps` updates. `delay=0` is ordinary training. In general the gradient of batch t sees the updates
of batches 0..t-1-delay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.model.config import PRESETS, ModelConfig, check_micro_batches
from peer.errors import UsageError

if TYPE_CHECKING:  # torch stays out of `peer --help`
    import torch

    from core.model.data import Corpus
    from core.protocol.recipe import Recipe

CHECKPOINT_FILE = "model.safetensors"
DEFAULTS = dict(model="small", steps=50, seed=0, batch_size=16, micro_batches=4, delay=1, lr=2e-3, device="cpu")


@dataclass
class StepInfo:
    """What `on_step` gets for batch `step`, after its gradient is computed and before any update
    is applied in that step. `grads` is the batch gradient by parameter name (read it, do not modify
    it: it is the update still to be applied); `updates_applied` is how many updates the parameters
    it was computed on include; `model` holds those parameters."""

    step: int
    loss: float
    tokens: int
    updates_applied: int
    grads: dict
    model: object


def check_training_args(*, steps: int, batch_size: int, micro_batches: int, delay: int, lr: float) -> None:
    """ValueError with a clear message for arguments no run can use."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    check_micro_batches(batch_size, micro_batches)
    if delay not in (0, 1):
        raise ValueError(f"delay must be 0 (ordinary training) or 1 (delayed parameter update), got {delay}")
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")


@contextlib.contextmanager
def _deterministic(device: "torch.device"):
    """Deterministic algorithms and a forked global RNG for the run; the caller's settings are
    restored afterwards (tests and other code in the same process are not affected)."""
    import torch

    if device.type == "cuda":  # cuBLAS needs this before its first use to be deterministic
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was_on, was_warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fork_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)


def train_reference(
    cfg: ModelConfig,
    corpus: "Corpus",
    *,
    steps: int,
    seed: int,
    batch_size: int,
    micro_batches: int,
    delay: int,
    lr: float,
    recipe: "Recipe | None" = None,
    precision: str = "fp32",
    eval_every: int = 0,
    device: "torch.device | str" = "cpu",
    progress: bool = True,
    on_step: Callable[[StepInfo], None] | None = None,
    initial: dict | None = None,
) -> tuple[dict, dict]:
    """Train from `build_slice(cfg, 0, cfg.layers, seed)` (or from the full-model state `initial`)
    on batches 0..steps-1 of (corpus, seed), update u at `recipe.lr_at(u)` (None: the default recipe
    at the constant learning rate `lr`; given, its lr must be `lr`). `precision` bf16: each batch
    gradient is computed on the parameters rounded to bfloat16 under autocast, as the swarm's
    volunteers compute it (core.model.precision); the fp32 parameters take the update. `eval_every`
    N: the held-out loss of every N-th version and the last (`eval_losses` in the summary), on the
    run's fixed held-out windows (core.model.data.eval_windows), as the swarm's servers compute it.

    Returns (the final full-model state_dict as fp32 CPU tensors, a summary dict with steps,
    first_loss, last_loss, losses, wall_seconds, tokens_per_second and the run's settings). The loss
    of a step is the mean token cross-entropy of its batch on the parameters its gradient is computed
    on, i.e. before its own update."""
    import torch
    from tqdm import tqdm

    from core.model.data import eval_due, eval_windows, make_batch
    from core.model.optim import apply_update, batch_gradient, make_optimizer
    from core.model.precision import compute_dtype, rounded
    from core.model.transformer import build_slice, loss_sum, slice_from_state
    from core.protocol.recipe import Recipe

    check_training_args(steps=steps, batch_size=batch_size, micro_batches=micro_batches, delay=delay, lr=lr)
    recipe = Recipe(lr=lr) if recipe is None else recipe
    if recipe.lr != lr:
        raise ValueError(f"the recipe's lr {recipe.lr} is not the run's {lr}")
    recipe.check(steps)
    device = torch.device(device)
    tokens = batch_size * cfg.seq_len
    losses: list[float] = []
    with _deterministic(device):
        torch.manual_seed(seed)
        start = time.perf_counter()
        model = (
            build_slice(cfg, 0, cfg.layers, seed, device)
            if initial is None
            else slice_from_state(cfg, 0, cfg.layers, initial, device)
        )
        optimizer = make_optimizer(model.parameters(), recipe)
        dtype = compute_dtype(precision)
        # at bf16 the gradients come from a copy on the rounded parameters, the fp32 ones take the update
        compute = (  # (its own tensors: slice_from_state assigns, it does not copy)
            None
            if dtype is None
            else slice_from_state(cfg, 0, cfg.layers, {k: v.clone() for k, v in model.state_dict().items()}, device)
        )
        if compute is not None:
            compute.compute_dtype = dtype
        params_of = dict(model.named_parameters())
        evals: dict[int, float] = {}

        def computing():
            """The model a gradient or an evaluation runs on: the fp32 one, or at bf16 the copy, given
            the current parameters rounded."""
            if compute is None:
                return model
            with torch.no_grad():
                for name, p in compute.named_parameters():
                    p.copy_(rounded({name: params_of[name]}, precision)[name])
            return compute

        def evaluate(version: int) -> None:
            if not eval_due(version, eval_every, steps):
                return
            on = computing()
            x, y = eval_windows(corpus, seed, cfg.seq_len)
            with torch.no_grad():
                evals[version] = float(loss_sum(on(x.to(device)).float().cpu(), y)) / y.numel()
            if progress:
                bar.write(f"held-out loss at version {version}: {evals[version]:.4f}")

        pending: deque[dict] = deque()  # gradients whose updates are not applied yet, oldest first
        norms: list[float | None] = []  # each update's gradient norm before clipping (when it clips)
        applied = 0
        bar = tqdm(total=steps, desc=f"reference {cfg.name}", unit="step", file=sys.stderr, disable=not progress)
        for t in range(steps):
            inputs, labels = (x.to(device) for x in make_batch(corpus, seed, t, batch_size, cfg.seq_len))
            loss, grads = batch_gradient(computing(), inputs, labels, micro_batches)
            losses.append(loss)
            if on_step is not None:
                on_step(StepInfo(step=t, loss=loss, tokens=tokens, updates_applied=applied, grads=grads, model=model))
            pending.append(grads)
            while len(pending) > delay:
                norm = apply_update(
                    optimizer, model, pending.popleft(), recipe.lr_at(applied, steps), recipe.clip_grad_norm
                )
                norms.append(norm)
                applied += 1
                evaluate(applied)
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{(t + 1) * tokens / elapsed:.0f}")
            bar.update(1)
        while pending:  # the swarm applies the last pending update too
            norms.append(
                apply_update(optimizer, model, pending.popleft(), recipe.lr_at(applied, steps), recipe.clip_grad_norm)
            )
            applied += 1
            evaluate(applied)
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
        wall = time.perf_counter() - start
        bar.close()
    summary = {
        "steps": steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "wall_seconds": wall,
        "tokens_per_second": steps * tokens / wall,
        "losses": losses,
        "model": cfg.name,
        "params": cfg.param_count(),
        "seed": seed,
        "batch_size": batch_size,
        "micro_batches": micro_batches,
        "delay": delay,
        "lr": lr,
        "recipe": recipe.record(),
        "precision": precision,
        "eval_losses": {str(v): loss for v, loss in evals.items()},
        "grad_norms": norms if recipe.clip_grad_norm is not None else None,
        "device": str(device),
        "data": corpus.source,
        "data_fingerprint": corpus.fingerprint,
    }
    return state, summary


def save_checkpoint(directory: str, state: dict, cfg: ModelConfig, tokenizer: str = "bytes") -> str:
    """Write `state` (full-model names) to DIRECTORY/model.safetensors with the config and the
    tokenizer ("bytes", or the Transformers directory the run started from) as metadata."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CHECKPOINT_FILE)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        path,
        metadata={"model": cfg.name, "config": json.dumps(cfg.to_dict()), "tokenizer": tokenizer},
    )
    return path


# ---- CLI ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument(
        "--model", default=d["model"], help=f"model preset: {', '.join(PRESETS)} (default {d['model']})"
    )
    parser.add_argument("--steps", type=int, default=d["steps"], help=f"batches to train on (default {d['steps']})")
    parser.add_argument("--seed", type=int, default=d["seed"], help="seed of the initial parameters and of the batches")
    parser.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="text file or folder of them (default: the Python standard library's sources)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=d["batch_size"], help=f"sequences per batch (default {d['batch_size']})"
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=d["micro_batches"],
        help=f"micro-batches per batch; must divide the batch size (default {d['micro_batches']})",
    )
    parser.add_argument(
        "--delay",
        type=int,
        default=d["delay"],
        help="1: delayed parameter update, as the swarm does; 0: ordinary training (default 1)",
    )
    parser.add_argument("--lr", type=float, default=d["lr"], help=f"peak AdamW learning rate (default {d['lr']})")
    from core.protocol import recipe as recipe_flags

    recipe_flags.add_arguments(parser)
    recipe_flags.add_run_arguments(
        parser,
        eval_help="print the held-out loss of every N-th version and the last, on the run's 8 fixed held-out windows",
        precision_help="fp32 (default), or bf16: each gradient computed under autocast on the parameters rounded "
        "to bfloat16, as a --precision bf16 swarm's volunteers compute it",
    )
    parser.add_argument("--device", default=d["device"], help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--checkpoint-out", metavar="DIR", help=f"write DIR/{CHECKPOINT_FILE} (the full model, fp32)")
    parser.add_argument("--summary-json", metavar="PATH", help="write the run's summary (losses, timings) as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    from peer.hf import init as hf_init

    hf_init.add_arguments(parser.add_argument_group("starting from a Transformers model"))


def _prepare_output_folder(path: str, what: str) -> None:
    """Create the folder `path` (the last step of validation, after every other check passed, so
    bad input leaves nothing behind); UsageError if it cannot be created or written to."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{what}: cannot create folder {path!r}: {e.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"{what}: folder {path!r} is not writable")


def _check_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name!r}: CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r}: only cpu and cuda are supported")


def run(args: argparse.Namespace) -> int:
    from peer.hf import init as hf_init

    cfg, hf = hf_init.resolve_model(args)
    try:
        check_training_args(
            steps=args.steps, batch_size=args.batch_size, micro_batches=args.micro_batches, delay=args.delay, lr=args.lr
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    from core.protocol import recipe as recipe_flags

    try:
        recipe = recipe_flags.from_args(args, args.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_device(args.device)
    if args.summary_json and os.path.isdir(args.summary_json):
        raise UsageError(f"--summary-json {args.summary_json!r} is a folder")
    if args.checkpoint_out and os.path.exists(args.checkpoint_out) and not os.path.isdir(args.checkpoint_out):
        raise UsageError(f"--checkpoint-out {args.checkpoint_out!r} exists and is not a folder")

    corpus = hf_init.load_training_corpus(args.data, cfg, hf, progress=not args.no_progress)
    initial = hf_init.initial_state(cfg, 0, cfg.layers, args.seed, hf) if hf is not None else None
    if args.checkpoint_out:
        _prepare_output_folder(args.checkpoint_out, "--checkpoint-out")
    if args.summary_json:
        _prepare_output_folder(os.path.dirname(os.path.abspath(args.summary_json)), "--summary-json")

    state, summary = train_reference(
        cfg,
        corpus,
        steps=args.steps,
        seed=args.seed,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        delay=args.delay,
        lr=args.lr,
        recipe=recipe,
        precision=args.precision,
        eval_every=args.eval_every,
        device=args.device,
        progress=not args.no_progress,
        initial=initial,
    )
    if args.checkpoint_out:
        summary["checkpoint"] = save_checkpoint(
            args.checkpoint_out, state, cfg, hf_init.model_record(cfg, hf)["tokenizer"]
        )
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    print(
        f"{cfg.name} ({cfg.param_count():,} parameters), {summary['steps']} steps: loss {summary['first_loss']:.4f} -> "
        f"{summary['last_loss']:.4f} in {summary['wall_seconds']:.1f} s ({summary['tokens_per_second']:.0f} tokens/s)"
    )
    return 0
