"""Helpers shared by scripts/bench_swarm.py and scripts/bench_churn.py: running `peer` commands as
child processes (and always stopping them), markdown tables, the load average, and this machine's
FLOP/s on a model preset.

Every table these benchmarks print carries the 1/5/15-minute load average at the time it was
measured: the machine has 2 cores shared with other jobs, so wall-clock numbers carry that noise.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def loadavg() -> str:
    """The 1, 5 and 15-minute load averages, as '1.02/2.10/3.00'."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class Report:
    """Markdown sections, printed as they come and written to a file at the end."""

    def __init__(self, title: str, intro: str = ""):
        self.parts = [f"# {title}\n", intro.strip() + "\n" if intro else ""]

    def add(self, text: str) -> None:
        print(text, flush=True)
        self.parts.append(text.rstrip() + "\n")

    def section(self, title: str, text: str = "") -> None:
        self.add(f"\n## {title}\n\n{text.strip()}\n" if text else f"\n## {title}\n")

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(p for p in self.parts if p))
        print(f"wrote {path}", flush=True)


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM (a `peer swarm` then stops every child it started), SIGKILL after `grace` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_peer(argv: list[str], log_path: Path, timeout: float) -> None:
    """`python -m peer.cli ARGV` in the repository, output to `log_path`; RuntimeError with the log's
    tail if it fails or runs past `timeout` seconds (it is stopped either way)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "peer.cli", *argv], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _stop(proc)
    if rc != 0:
        tail = log_path.read_bytes()[-2000:].decode(errors="replace")
        why = f"ran past {timeout:.0f} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"peer {' '.join(argv[:1])} {why}; see {log_path}:\n{tail}")


def run_reference(model: str, steps: int, work: Path, timeout: float = 900) -> dict:
    out = work / "reference.json"
    load_before = loadavg()
    run_peer(["reference", "--model", model, "--steps", str(steps), "--summary-json", str(out), "--no-progress"],
             work / "reference.log", timeout)
    summary = json.loads(out.read_text())
    summary["load"] = load_before
    return summary


def run_swarm(name: str, args: list[str], work: Path, timeout: float = 900) -> dict:
    """One `peer swarm` with ARGS; its summary dict plus `load` (at its start) and `run_seconds` (the
    whole command: startup, training, assembling the model, teardown). The servers' checkpoints are
    deleted afterwards; the logs stay under WORK/NAME."""
    run_dir = work / name
    summary_path = work / f"{name}.json"
    load_before = loadavg()
    t0 = time.perf_counter()
    try:
        run_peer(["swarm", *args, "--summary-json", str(summary_path), "--work-dir", str(run_dir), "--no-progress"],
                 work / f"{name}.log", timeout)
    finally:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    summary = json.loads(summary_path.read_text())
    summary["load"] = load_before
    summary["run_seconds"] = time.perf_counter() - t0
    return summary


def exactly_once(summary: dict) -> str:
    """'96/96' when every micro-batch of every stage was applied, else a loud mismatch."""
    got, want = summary["microbatches_applied"], summary["microbatches_expected"]
    return f"{got}/{want}" if got == want else f"**{got}/{want} MISMATCH**"


def model_flops_per_second(model: str, rows: int, repeats: int = 7) -> tuple[float, float]:
    """(FLOP/s, seconds) of one forward+backward of the whole `model` on `rows` sequences, on one
    thread (as every swarm process runs), median of `repeats`; FLOPs counted as the planner counts
    them: tokens x layers x flops_per_token_per_layer (the embedding and the head are not counted,
    so their time lowers the figure, as it lowers the swarm's)."""
    import torch

    from peer.model.config import flops_per_token_per_layer, get_preset
    from peer.model.transformer import build_slice, loss_sum

    cfg = get_preset(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = build_slice(cfg, 0, cfg.layers, seed=0)
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
        y = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
        times = []
        for i in range(repeats + 2):
            net.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss_sum(net(x), y).backward()
            if i >= 2:  # two warm-ups
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    seconds = statistics.median(times)
    flops = rows * cfg.seq_len * cfg.layers * flops_per_token_per_layer(cfg)
    return flops / seconds, seconds
