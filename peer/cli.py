"""`peer`: the single entry point. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; heavy imports (torch, hivemind) stay inside `run`
so that `peer plan` and `--help` start fast."""

from __future__ import annotations

import argparse
import importlib
import sys

from peer.errors import NetworkError, UsageError
from peer.runtime import setup_logging

# name -> (module, one-line help)
COMMANDS = {
    "reference": ("peer.reference", "single-process training with the swarm's exact update rule"),
    "plan": ("peer.plan_cmd", "lay out a cluster into pipeline stages (or score a plan)"),
    "simulate": (
        "peer.simulate_cmd",
        "predict a swarm of thousands of volunteers: tokens/s, the limit, servers needed",
    ),
    "serve": ("peer.serve", "run a reliable parameter server (frontal or backward) for one stage"),
    "keygen": ("peer.keygen", "make a run key, which a run's servers share (--run-key) and which signs its records"),
    "join": ("peer.join", "join a run as a volunteer and pull tasks"),
    "swarm": ("peer.swarm", "run a whole swarm (DHT, servers, volunteers) on this machine"),
    "model-file": ("peer.model_file", "write the planner's model file for a model preset"),
    "export": ("peer.export", "write a trained model as a Transformers LlamaForCausalLM folder"),
    "generate": ("peer.generate", "write text with a trained model (hivepipe checkpoint or Transformers folder)"),
    "data": ("peer.data_cmd", "prepare a training corpus: tokenized, memory-mapped, with a held-out split"),
    "summary": ("peer.summary_cmd", "print a finished run's summary from its servers' checkpoint folders"),
}


def _available_commands():
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue  # command not part of this build
            raise
        yield name, module, help_text


def _shown(action) -> bool:
    d = action.default
    return bool(action.option_strings) and d is not None and d is not False and d != [] and d != argparse.SUPPRESS


class _ShowDefaults(argparse.HelpFormatter):
    """Every option's help line ends with its default (also options that have no help text)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or not _shown(action):  # (a help text that says its default already)
            return text
        return f"{text} (default: %(default)s)"


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.help is None and _shown(action):
            action.help = "default: %(default)s"  # argparse prints no line for an option without help


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peer", description="hivepipe peer: train large models on volunteered machines"
    )
    from peer import version

    parser.add_argument("--version", action="version", version=f"hivepipe {version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, help_text in _available_commands():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_ShowDefaults)
        p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logs")
        module.add_arguments(p)
        _say_defaults(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def main(argv=None) -> int:
    try:
        parser = build_parser()
    except ImportError as e:  # a command's module cannot load: an install that is broken or stale
        print(
            f"peer: error: a command cannot load: {type(e).__name__}: {e} (reinstall the package: "
            'pip install -e ".[dev]" in its repository)',
            file=sys.stderr,
        )
        return 1
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    try:
        return int(args._run(args) or 0)
    except UsageError as e:
        # the reason first and alone: a refusal of a value (argparse's own syntax errors print the
        # usage, before this is reached), with where the flags are described
        print(f"peer {args.command}: error: {e}", file=sys.stderr)
        print(f"(peer {args.command} --help lists the flags)", file=sys.stderr)
        return 2
    except NetworkError as e:
        print(f"peer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            print(f'peer {args.command}: error: this needs {e.name}: pip install -e ".[hf]"', file=sys.stderr)
            return 2
        return _fault(args, e)
    except Exception as e:  # a fault, not the user's input: one line (the traceback with -vv), exit 1
        return _fault(args, e)


# the optional dependencies (the `hf` extra) and what they are needed for
OPTIONAL = ("transformers", "tokenizers", "sentencepiece")


def _fault(args, e: BaseException) -> int:
    import logging

    logging.getLogger("hivepipe").debug("the traceback of the error below", exc_info=e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(f"peer {args.command}: error: {type(e).__name__}{': ' + text if text else ''}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
