"""`peer summary DIR`: the run's end as its servers wrote it. At the last step every server writes
`DEVICE.run-summary.json` into its checkpoint folder (`peer.host.report.RunReport.write_summary`):
the run, its steps, the last loss and held-out loss it knows, tokens/s over its last versions,
micro-batches applied, and what each volunteer gave it (tasks completed there, checks of its work
passed there, banned or not). This command reads every such file in the folders it is given (one
folder may hold several servers' files: `peer swarm` puts them all in WORK/checkpoints) and prints
the run once: each volunteer's tasks and checks summed over the servers, banned if any server banned
it. Torch-free: it reads JSON only."""

from __future__ import annotations

import glob
import json
import os

from peer.errors import UsageError

SUFFIX = ".run-summary.json"
FORMAT = 1  # the file's "format": a reader refuses a file of another format, naming it


def add_arguments(p) -> None:
    p.add_argument("dirs", nargs="+", metavar="DIR", help="checkpoint folders of the run's servers")
    p.add_argument("--json", action="store_true", help="print the merged summary as JSON")


def write_summary(directory: str, device: str, summary: dict) -> str:
    """Write a server's summary (atomically: a reader never sees half a file); its path."""
    path = os.path.join(directory, f"{device}{SUFFIX}")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(summary, format=FORMAT), f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


def read_summaries(dirs: list[str]) -> list[dict]:
    """Every server summary in `dirs`; UsageError naming a folder that is not one, a folder without
    any, or a file that is not a summary of this format."""
    found = []
    for d in dirs:
        if not os.path.isdir(d):
            raise UsageError(f"{d}: not a folder")
        paths = sorted(glob.glob(os.path.join(glob.escape(d), f"*{SUFFIX}")))
        if not paths:
            raise UsageError(f"{d}: no *{SUFFIX} (a server writes its own at the run's last step)")
        for path in paths:
            try:
                with open(path) as f:
                    rec = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise UsageError(f"{path}: not readable as JSON ({e})") from None
            if not isinstance(rec, dict) or rec.get("format") != FORMAT:
                raise UsageError(f"{path}: not a run summary of format {FORMAT}")
            for key, kind in (("run_id", str), ("device", str), ("steps", int), ("volunteers", dict)):
                if not isinstance(rec.get(key), kind):
                    raise UsageError(f"{path}: field {key!r} missing or not a {kind.__name__}")
            found.append(rec)
    return found


def merge(summaries: list[dict]) -> dict:
    """One run's summary from its servers': UsageError when they are of different runs."""
    runs = sorted({s["run_id"] for s in summaries})
    if len(runs) > 1:
        raise UsageError(f"the summaries are of {len(runs)} runs ({', '.join(runs)}): give one run's folders")
    last = [s for s in summaries if s.get("last_stage")] or summaries
    with_eval = [s for s in summaries if s.get("eval_loss") is not None]
    volunteers: dict[str, dict] = {}
    for s in summaries:
        for peer, v in s["volunteers"].items():
            m = volunteers.setdefault(peer, {"device": None, "tasks": 0, "checks_passed": 0, "banned": None})
            m["device"] = m["device"] or v.get("device")
            m["tasks"] += int(v.get("tasks", 0))
            m["checks_passed"] += int(v.get("checks_passed", 0))
            m["banned"] = m["banned"] or v.get("banned")
    rates = [s["tokens_per_second"] for s in summaries if s.get("tokens_per_second") is not None]
    applied: dict[int, int] = {}  # stage -> micro-batches applied (every server of a stage applies them all)
    for s in summaries:
        if isinstance(s.get("stage"), int) and isinstance(s.get("microbatches_applied"), int):
            applied[s["stage"]] = max(applied.get(s["stage"], 0), s["microbatches_applied"])
    return {
        "run_id": runs[0],
        "steps": max(s["steps"] for s in summaries),
        "servers": sorted(s["device"] for s in summaries),
        "loss": last[0].get("loss"),
        "eval_loss": with_eval[0]["eval_loss"] if with_eval else None,
        "eval_version": with_eval[0].get("eval_version") if with_eval else None,
        "tokens_per_second": min(rates) if rates else None,  # the pipeline runs at its slowest stage's pace
        "microbatches_applied": sum(applied.values()) if applied else None,  # summed over the stages
        "volunteers": dict(sorted(volunteers.items(), key=lambda kv: -kv[1]["tasks"])),
    }


def summary_text(m: dict) -> str:
    def num(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [
        f"run {m['run_id']}: finished at step {m['steps']}, loss {num(m['loss'], '.4f')}"
        + (f", held-out loss {m['eval_loss']:.4f} (version {m['eval_version']})" if m["eval_loss"] is not None else "")
        + f", {num(m['tokens_per_second'], ',.0f')} tokens/s",
        f"servers ({len(m['servers'])}): {' '.join(m['servers'])}",
        f"volunteers ({len(m['volunteers'])}):",
        f"  {'peer':<14} {'device':<12} {'tasks':>7} {'checks':>7}  banned",
    ]
    for peer, v in m["volunteers"].items():
        short = peer if len(peer) <= 14 else "..." + peer[-11:]
        lines.append(
            f"  {short:<14} {(v['device'] or '-')[:12]:<12} {v['tasks']:>7} {v['checks_passed']:>7}  "
            f"{'yes: ' + v['banned'] if v['banned'] else 'no'}"
        )
    return "\n".join(lines)


def run(args) -> int:
    merged = merge(read_summaries(args.dirs))
    print(json.dumps(merged, indent=2) if args.json else summary_text(merged))
    return 0
