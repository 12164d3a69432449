"""The dashboard in a terminal: the snapshot as rich tables, refreshed in place. Must not read the
DHT (the Watcher does)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from core.protocol.values import format_duration

if TYPE_CHECKING:
    from peer.dashboard.reader import Watcher


def fmt(x: Any, spec: str = ".3g", none: str = "-", unit: str = "") -> str:
    if x is None:
        return none
    if isinstance(x, float):
        return format(x, spec) + unit
    return f"{x}{unit}"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 100:
        return f"{seconds:.1f}s"
    if seconds < 6000:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


STATE_STYLE = {"online": "green", "joining": "yellow", "offline": "dim", "finished": "blue", "unreachable": "bold red"}
STATUS_STYLE = {
    "ok": "bold green",
    "finished": "bold cyan",
    "blocked": "bold red",
    "stopped": "bold red",
    "not_found": "bold red",
    "unreachable": "bold red",
    "error": "bold red",
}


def summary_lines(snap: dict) -> list[str]:
    """The run's progress as short plain lines (the terminal header)."""
    p = snap["progress"]
    steps = f"{fmt(p['step'])}/{fmt(p['steps'])}"
    loss = fmt(p["last_loss"], ".4f") + (f" (batch {p['loss_batch']})" if p["loss_batch"] is not None else "")
    plan = fmt(p["predicted_seconds_per_step"], ".3g", unit=" s")
    left = "-" if p.get("seconds_left") is None else format_duration(p["seconds_left"])
    extra = []  # what a run with --eval-every or --clip-grad-norm adds
    if p.get("eval_version") is not None:
        extra.append(f"held-out loss {fmt(p['eval_loss'], '.4f')} (version {p['eval_version']})")
    if p.get("grad_norm_batch") is not None:
        extra.append(f"gradient norm {fmt(p['grad_norm'], '.4g')} (batch {p['grad_norm_batch']})")
    return [
        f"step {steps}   loss {loss}   tokens/s {fmt(p['tokens_per_second'], '.0f')}   left {left}",
        *(["   ".join(extra)] if extra else []),
        f"s/step {fmt(p['seconds_per_step'], '.3g')} measured, {plan} planned   "
        f"micro-batches {fmt(p['microbatches_applied'])}/{fmt(p['microbatches_expected'])}",
        f"volunteers {p['volunteers_live']} live, {p['volunteers_joined']} joined, {p['volunteers_lost']} lost, "
        f"{p.get('volunteers_banned', 0)} banned ({p.get('checks', 0)} checks, ban reach {fmt(p.get('ban_reach'))})",
    ]


def render_terminal(snap: dict):
    """A rich renderable of the snapshot, readable at 80 columns."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = []
    h = snap["health"]
    title = Text.assemble(
        ("hivepipe ", "bold"),
        (f"run {snap['run_id']}", "bold magenta"),
        "  ",
        (h["status"].upper().replace("_", " "), STATUS_STYLE.get(h["status"], "bold")),
    )
    if snap.get("config"):
        c = snap["config"]
        title.append(f"  model {c['model']}, {c['stages']} stages, batch {c['batch_size']}x{c['seq_len']}", "dim")
    parts.append(title)
    for line in summary_lines(snap):
        parts.append(Text(line))
    if h.get("finished"):
        f = h["finished"]
        said = f"finished at step {f['step']}, loss {fmt(f['loss'], '.4f')}"
        if f.get("eval_loss") is not None:
            said += f", held-out loss {fmt(f['eval_loss'], '.4f')}"
        parts.append(Text(said, "bold cyan"))
    if h.get("unseen_for") is not None:
        parts.append(
            Text(
                f"the run's records not found for {h['unseen_for']:.0f} s: its servers away or unreachable", "bold red"
            )
        )
    if h.get("stopped"):
        parts.append(Text(h["stopped"], "bold red"))
    for b in h["blocking"]:
        parts.append(Text(f"BLOCKING stage {b['stage']}: {b['reason']}", "bold red"))
    for w in h["warnings"]:
        parts.append(Text(f"warning: {w}", "yellow"))
    for e in snap["errors"]:
        parts.append(Text(f"error: {e}", "red"))
    for s in snap["stages"]:
        layers = "?" if s["layers"] is None else f"{s['layers'][0]}-{s['layers'][1]}"
        head = (
            f"stage {s['index']}  layers {layers}  v{fmt(s['version'])}  "
            f"{fmt(s['tokens_per_second'], '.0f')} tok/s  compute {fmt(s['compute'], '.3g')}"
        )
        table = Table(
            title=head,
            title_justify="left",
            title_style="bold blue" if not s["blocking"] else "bold red",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            padding=0,
            show_edge=False,
        )
        # fixed widths: 71 characters and 7 one-character separators fit 80 columns
        for name, width, justify in (
            ("role", 5, "left"),
            ("device", 9, "left"),
            ("peer", 8, "left"),
            ("state", 11, "left"),
            ("ver|cmp", 7, "right"),
            ("q/l/done/rq/dup|thr", 19, "left"),
            ("oldest", 6, "right"),
            ("seen", 6, "right"),
        ):
            table.add_column(name, width=width, justify=justify, no_wrap=True, overflow="ellipsis")
        for role, short_role in (("frontal", "front"), ("backward", "back")):
            for e in s[role]:
                pl = e["pool"]
                tasks = "/".join(fmt(pl[f]) for f in ("queued", "leased", "done", "requeued", "duplicates"))
                table.add_row(
                    short_role,
                    e["device"],
                    e["short"],
                    Text(e["state"], STATE_STYLE.get(e["state"], "")),
                    "-" if e["version"] is None else f"v{e['version']}",
                    tasks,
                    fmt_age(pl["oldest_task_age"]) if pl["queued"] else "-",
                    fmt_age(e["last_seen"]),
                )
        for v in s["volunteers"]:
            thr = f"{fmt(v['throughput'], '.2f')}/s {fmt(v['tasks_done'])} done"
            table.add_row(
                "vol",
                v["device"],
                v["short"],
                Text(v["state"], STATE_STYLE.get(v["state"], "")),
                fmt(v["compute"], ".3g"),
                thr,
                "",
                fmt_age(v["last_seen"]),
            )
        parts.append(table)
        for role in ("frontal", "backward"):  # what a server that does not serve says it does
            for e in s[role]:
                if e.get("says") and not e["says"].startswith("serving"):
                    parts.append(Text(f"  {e['device']}: {e['says']}", "yellow"))
    if snap["malformed"]:
        parts.append(Text(f"malformed records ({len(snap['malformed'])}):", "bold yellow"))
        for m in snap["malformed"]:
            where = "?" if m["stage"] is None else m["stage"]
            parts.append(Text(f"  stage {where} peer {m['short']}: {m['reason']}", "yellow"))
    return Group(*parts)


def live_view(watcher: "Watcher", refresh: float) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        with Live(render_terminal(watcher.current()), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(refresh)
                live.update(render_terminal(watcher.poll()), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0
