"""The training recipe a run shares: learning-rate schedule and AdamW's settings, as one value.

The schedule is a pure function of the update's index (the version it starts from: the update of
batch t makes version t+1 and uses `lr_at(t)`), so that every shard of every server, a replica that
replays a step, a server that re-runs a batch after a failover and `peer reference` all use the same
number for the same update, whoever applies it and whenever. The recipe is part of the run's config
record: a server started with another one refuses to join and names both values (peer.host.run_config
`differing_flags`).

Schedules, for `steps` updates, warm-up W, decay length D and peak `lr`:

- warm-up (any schedule): update u < W uses lr x (u + 1) / W, reaching lr at u = W - 1;
- constant: lr after the warm-up;
- cosine: min_lr + (lr - min_lr) x (1 + cos(pi p)) / 2, p = (u - W) / D, D = steps - W by default;
- linear: min_lr + (lr - min_lr) x (1 - p), the same p;
- wsd (warm-up, stable, decay): lr until the last D updates (D = 20% of steps by default), then
  min_lr + (lr - min_lr) x (1 - sqrt(p)), p = (u - (steps - D)) / D (the square-root decay of
  INTELLECT-1). Since the stable phase does not depend on where the run ends, a run to go on past
  its `--steps` is best trained with wsd and its decay given the run's final length.

p is kept in [0, 1]: after its decay a schedule stays at min_lr."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from core.protocol.values import finite_number

SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY_FRACTION = 0.2  # of the run's steps, the default decay length of wsd

# the recipe's fields -> the flag that sets each (every peer command that trains says it this way)
FLAGS = {
    "schedule": "--lr-schedule",
    "warmup_steps": "--warmup-steps",
    "min_lr": "--min-lr",
    "decay_steps": "--decay-steps",
    "betas": "--betas",
    "eps": "--eps",
    "weight_decay": "--weight-decay",
    "clip_grad_norm": "--clip-grad-norm",
}


@dataclass(frozen=True)
class Recipe:
    """The learning-rate schedule and AdamW's settings of a run (see the module's docstring)."""

    lr: float = 2e-3
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: int | None = None  # None: to the run's end (cosine, linear) or 20% of it (wsd)
    betas: tuple[float, float] = field(default=(0.9, 0.95))
    eps: float = 1e-8
    weight_decay: float = 0.01
    # the batch gradient's global L2 norm (over every parameter of every stage) is clipped to this,
    # as torch.nn.utils.clip_grad_norm_ over the whole model does; None: not clipped
    clip_grad_norm: float | None = None

    def check(self, steps: int) -> None:
        """ValueError naming the flag of the first setting no run of `steps` updates can use."""
        if not finite_number(self.lr) or self.lr <= 0:
            raise ValueError(f"--lr must be a positive number, got {self.lr!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.warmup_steps > steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} is more than the run's {steps} steps")
        if not finite_number(self.min_lr) or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr must be in [0, --lr {self.lr}], got {self.min_lr!r}")
        if self.decay_steps is not None and (
            not isinstance(self.decay_steps, int) or isinstance(self.decay_steps, bool) or self.decay_steps < 1
        ):
            raise ValueError(f"--decay-steps must be an integer >= 1, got {self.decay_steps!r}")
        if (
            not isinstance(self.betas, tuple)
            or len(self.betas) != 2
            or not all(finite_number(b) and 0 <= b < 1 for b in self.betas)
        ):
            raise ValueError(f"--betas must be two numbers in [0, 1), got {self.betas!r}")
        if not finite_number(self.eps) or self.eps <= 0:
            raise ValueError(f"--eps must be a positive number, got {self.eps!r}")
        if not finite_number(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be a number >= 0, got {self.weight_decay!r}")
        if self.clip_grad_norm is not None and (not finite_number(self.clip_grad_norm) or self.clip_grad_norm <= 0):
            raise ValueError(f"--clip-grad-norm must be a positive number, got {self.clip_grad_norm!r}")

    def decay_length(self, steps: int) -> int:
        """D: the updates over which the schedule goes from lr to min_lr (at least 1)."""
        if self.decay_steps is not None:
            return self.decay_steps
        if self.schedule == "wsd":
            return max(1, round(WSD_DECAY_FRACTION * steps))
        return max(1, steps - self.warmup_steps)

    def lr_at(self, update: int, steps: int) -> float:
        """The learning rate of update `update` (0-based: the one that makes version update + 1) of a
        run of `steps` updates."""
        w = self.warmup_steps
        if update < w:
            return self.lr * (update + 1) / w
        if self.schedule == "constant":
            return self.lr
        d = self.decay_length(steps)
        start = max(w, steps - d) if self.schedule == "wsd" else w
        p = min(1.0, max(0.0, (update - start) / d))
        span = self.lr - self.min_lr
        if self.schedule == "cosine":
            return self.min_lr + span * 0.5 * (1.0 + math.cos(math.pi * p))
        if self.schedule == "linear":
            return self.min_lr + span * (1.0 - p)
        return self.min_lr + span * (1.0 - math.sqrt(p))  # wsd

    def adamw(self) -> dict:
        """AdamW's keyword arguments but the learning rate."""
        return dict(betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    # ---- the run config's form ---------------------------------------------------------------

    def record(self) -> dict:
        """The recipe as the run's config record holds it (without lr, a field of its own there)."""
        d = asdict(self)
        d.pop("lr")
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_record(cls, lr: float, d) -> Recipe:
        """The recipe of a config record's `recipe` map (None: the defaults); ValueError naming the
        field for anything else. Not checked against a run's steps: call `check`."""
        if d is None:
            return cls(lr=lr)
        if not isinstance(d, dict):
            raise ValueError(f"recipe: expected a map, got {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"lr"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"recipe: unknown field {unknown[0]!r}")
        values = dict(d)
        if "betas" in values:
            betas = values["betas"]
            if not isinstance(betas, (list, tuple)):
                raise ValueError(f"recipe: field 'betas' must be a pair of numbers, got {betas!r}")
            values["betas"] = tuple(betas)
        recipe = cls(lr=lr, **values)
        for name in ("min_lr", "eps", "weight_decay") + (("clip_grad_norm",) if recipe.clip_grad_norm else ()):
            if not finite_number(getattr(recipe, name)):
                raise ValueError(f"recipe: field {name!r} must be a number, got {getattr(recipe, name)!r}")
        return recipe

    def differences(self, theirs: Recipe) -> list[str]:
        """`--flag theirs (here: ours)` for each setting `theirs` (the run's) sets otherwise."""
        out = []
        for name, flag in FLAGS.items():
            a, b = getattr(theirs, name), getattr(self, name)
            if a != b:
                out.append(f"{flag} {_show(name, a)} (here: {_show(name, b)})")
        return out

    def flags(self) -> list[str]:
        """The command-line flags that give this recipe (but --lr) to another peer command."""
        out = []
        for name, flag in FLAGS.items():
            value = getattr(self, name)
            if value is not None:
                out += [flag, _show(name, value)]
        return out


def clip_scale(max_norm: float, total_sumsq: float) -> float:
    """What a batch gradient whose squares sum to `total_sumsq` is multiplied by to clip its norm to
    `max_norm`: torch.nn.utils.clip_grad_norm_'s coefficient, max_norm / (norm + 1e-6), at most 1."""
    return min(1.0, max_norm / (math.sqrt(total_sumsq) + 1e-6))


def _show(name: str, value) -> str:
    if name == "betas":
        return ",".join(repr(float(b)) for b in value)
    return "none" if value is None else str(value)


def parse_betas(text: str) -> tuple[float, float]:
    """'0.9,0.95' -> (0.9, 0.95); ValueError naming the flag otherwise."""
    parts = text.split(",")
    try:
        betas = tuple(float(x) for x in parts)
    except ValueError:
        raise ValueError(f"--betas must be two numbers as B1,B2 (e.g. 0.9,0.95), got {text!r}") from None
    if len(betas) != 2:
        raise ValueError(f"--betas must be two numbers as B1,B2 (e.g. 0.9,0.95), got {text!r}")
    return betas


def add_arguments(group) -> None:
    """The recipe's flags, on an argparse parser or group (peer reference, serve and swarm)."""
    d = Recipe()
    group.add_argument(
        "--lr-schedule",
        default=d.schedule,
        choices=SCHEDULES,
        help="learning-rate schedule over the run's steps (default constant): cosine and linear decay "
        "to --min-lr by the last step, wsd stays at --lr until its last --decay-steps (20%% of the "
        "run by default), each after --warmup-steps of linear warm-up",
    )
    group.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up updates (default 0)")
    group.add_argument("--min-lr", type=float, default=d.min_lr, help="learning rate at the end of a decay (default 0)")
    group.add_argument(
        "--decay-steps",
        type=int,
        default=None,
        help="length of the decay in updates (default: the run after its warm-up; wsd: 20%% of the run)",
    )
    group.add_argument("--betas", default=",".join(str(b) for b in d.betas), help="AdamW's B1,B2 (default 0.9,0.95)")
    group.add_argument("--eps", type=float, default=d.eps, help="AdamW's eps (default 1e-8)")
    group.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="AdamW's decoupled weight decay (default 0.01)"
    )
    group.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        metavar="X",
        help="clip each batch gradient's global L2 norm (every parameter of every stage) to X, as "
        "torch.nn.utils.clip_grad_norm_ (default: no clipping)",
    )


def _non_negative(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def add_run_arguments(
    group,
    eval_help: str = "the held-out loss of every N-th version (and the last), on 8 fixed held-out windows (0: none)",
    precision_help: str = "the volunteers' compute: fp32 (exact, the default) or bf16 (autocast on parameters "
    "sent in bfloat16, fp32 masters and AdamW on the servers; docs/training.md)",
) -> None:
    """--eval-every and --precision, which every command that trains takes (peer reference, serve,
    swarm); the run config record holds both. A negative --eval-every is refused by argparse (exit 2)."""
    from core.protocol.records import PRECISIONS

    group.add_argument("--eval-every", type=_non_negative, default=0, metavar="N", help=eval_help)
    group.add_argument("--precision", default="fp32", choices=list(PRECISIONS), help=precision_help)


def from_args(args, steps: int) -> Recipe:
    """The recipe the parsed flags give (with args.lr), checked for a run of `steps` updates;
    ValueError naming the flag."""
    recipe = Recipe(
        lr=args.lr,
        schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        min_lr=args.min_lr,
        decay_steps=args.decay_steps,
        betas=parse_betas(args.betas),
        eps=args.eps,
        weight_decay=args.weight_decay,
        clip_grad_norm=args.clip_grad_norm,
    )
    recipe.check(steps)
    return recipe
