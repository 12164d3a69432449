"""`peer model-file`: write the planner's model file (docs/cost-model.md) for a model preset.

The FLOPs per token per layer are those of this architecture (see
core.model.config.flops_per_token_per_layer): 6 x params_per_layer + 12 x seq_len x hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from core.model.config import PRESETS, get_preset, planner_model_file
from peer.errors import UsageError
from peer.reference import DEFAULTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULTS["model"], help=f"model preset: {', '.join(PRESETS)} (default {DEFAULTS['model']})"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULTS["batch_size"],
        help=f"sequences per batch (default {DEFAULTS['batch_size']})",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=DEFAULTS["micro_batches"],
        help=f"micro-batches per batch; must divide the batch size (default {DEFAULTS['micro_batches']})",
    )
    parser.add_argument(
        "--bytes-per-value",
        type=int,
        default=2,
        help="bytes of one activation or parameter value on the wire and in memory (default 2)",
    )
    parser.add_argument(
        "-o", "--output", metavar="MODEL.json", help="where to write the file (default: standard output)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        model = planner_model_file(get_preset(args.model), args.batch_size, args.micro_batches, args.bytes_per_value)
    except ValueError as e:
        raise UsageError(str(e)) from None
    text = json.dumps(model, indent=2) + "\n"
    if not args.output or args.output == "-":
        sys.stdout.write(text)
        return 0
    if os.path.isdir(args.output):
        raise UsageError(f"-o {args.output!r} is a folder")
    try:
        with open(args.output, "w") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"cannot write {args.output!r}: {e.strerror}") from None
    return 0
