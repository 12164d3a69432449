"""Helpers shared by scripts/bench_swarm.py and scripts/bench_churn.py: running `peer` commands as
child processes (and always stopping them), markdown tables, the load average, and this machine's
FLOP/s on a model preset.

Every table these benchmarks print carries the 1/5/15-minute load average at the time it was
measured: the machine has 2 cores shared with other jobs, so wall-clock numbers carry that noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def swarm_bench_parser(doc: str, *, steps: int, volunteers: int = 4) -> argparse.ArgumentParser:
    """The flags of a benchmark that runs `peer swarm` a few times: --model, --steps, --volunteers,
    --out (its report's folder) and --work (its runs' logs)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--volunteers", type=int, default=volunteers)
    p.add_argument("--out", type=Path, default=REPO / "docs")
    p.add_argument("--work", type=Path, default=None, help="keep the runs' logs here (default: a temporary folder)")
    return p


def work_folder(path: Path | None, prefix: str) -> Path:
    """--work, made when missing, or a fresh temporary folder."""
    work = path or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work


def out_folder(parser, path: Path) -> Path:
    """`--out` of a benchmark that writes a report and its plots into a folder: refused at once when
    it names a file (found after an 8-minute run otherwise), made when missing."""
    if path.exists() and not path.is_dir():
        parser.error(f"--out {path} is a file: it names the folder the report and its plots go to")
    path.mkdir(parents=True, exist_ok=True)
    return path


def spin() -> None:
    """A process that only burns a core: CPU load beside a benchmark or the stress tier."""
    while True:
        pass


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


def process_tree(pid: int) -> list:
    """The psutil process `pid` and all its descendants; [] once it is gone."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return [proc] + proc.children(recursive=True)
    except psutil.Error:
        return []


class CpuSampler:
    """The processor seconds of a process tree, sampled every `period` seconds in a thread of its
    own (psutil): `samples` [(unix time, {pid: (kind, cpu seconds)})]. Kinds: the training processes
    ('server', 'volunteer', from their command lines), their hivemind DHT processes ('DHT process': a
    training process's child that is neither a p2p daemon nor torch's shared-memory manager), 'p2p
    daemon', and the rest ('launcher': `peer swarm`, its zygote and DHT node, torch's managers)."""

    def __init__(self, pid: int, period: float = 0.25):
        import threading

        self.pid, self.period = pid, period
        self.samples: list[tuple[float, dict]] = []
        self.owners: dict[
            int, str
        ] = {}  # pid -> the training process it works for ('server', 'volunteer') or 'launcher'
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _kind(proc, training: dict) -> str:
        name = proc.name()
        if name == "p2pd":
            return "p2p daemon"
        if name.startswith("torch_shm"):
            return "launcher"
        cmd = " ".join(proc.cmdline())
        if proc.ppid() in training:
            return "DHT process"
        words = cmd.split()
        after = words[words.index("peer.cli") + 1 :] if "peer.cli" in words else []
        command = next((w for w in after if not w.startswith("-")), None)  # (`peer.cli -v serve ...`)
        if command == "serve":
            return "server"
        if command == "join":
            return "volunteer"
        return "launcher"

    @staticmethod
    def _owner(proc, kinds: dict) -> str:
        """The training process a process works for: itself, or its nearest ancestor that is a server
        or a volunteer (its DHT process, their p2p daemons); 'launcher' otherwise."""
        for p in [proc] + proc.parents():
            if kinds.get(p.pid) in ("server", "volunteer"):
                return kinds[p.pid]
        return "launcher"

    def seconds_by_owner(self, begin: float, finish: float) -> dict[str, float]:
        """seconds_by_kind, summed by whom each process works for (`_owner`)."""
        out: dict[str, float] = {}
        for pid, cpu in self._per_pid(begin, finish).items():
            who = self.owners.get(pid, "launcher")
            out[who] = out.get(who, 0.0) + cpu
        return out

    def _per_pid(self, begin: float, finish: float) -> dict[int, float]:
        before: dict[int, float] = {}
        last: dict[int, float] = {}
        for t, sample in self.samples:
            if t <= begin:
                before.update({pid: cpu for pid, (_, cpu) in sample.items()})
            if t <= finish:
                last.update({pid: cpu for pid, (_, cpu) in sample.items()})
        return {pid: max(cpu - before.get(pid, 0.0), 0.0) for pid, cpu in last.items()}

    def _run(self) -> None:
        import psutil

        kinds: dict[int, str] = {}
        while not self._stop.is_set():
            tree = process_tree(self.pid)
            if not tree:
                return
            now, sample = time.time(), {}
            for proc in tree:
                try:
                    with proc.oneshot():
                        # a child forked from the zygote may be seen before it takes its command line:
                        # what looked like the launcher's is looked at again
                        if kinds.get(proc.pid, "launcher") == "launcher":
                            training = {p: k for p, k in kinds.items() if k in ("server", "volunteer")}
                            kinds[proc.pid] = self._kind(proc, training)
                        t = proc.cpu_times()
                        sample[proc.pid] = (kinds[proc.pid], t.user + t.system)
                        if self.owners.get(proc.pid, "launcher") == "launcher":
                            self.owners[proc.pid] = self._owner(proc, kinds)
                except psutil.Error:
                    pass
            self.samples.append((now, sample))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def seconds_by_kind(self, begin: float, finish: float) -> dict[str, float]:
        """Processor seconds each kind used between unix times `begin` and `finish` (a process's last
        sample at or before each end of the window; one born inside it counts from 0)."""
        before: dict[int, float] = {}
        last: dict[int, tuple[str, float]] = {}
        for t, sample in self.samples:
            if t <= begin:
                before.update({pid: cpu for pid, (_, cpu) in sample.items()})
            if t <= finish:
                last.update(sample)
        out: dict[str, float] = {}
        for pid, (kind, cpu) in last.items():
            out[kind] = out.get(kind, 0.0) + max(cpu - before.get(pid, 0.0), 0.0)
        return out


def run_peer(
    argv: list[str], log_path: Path, timeout: float, sample_cpu: bool = False, alongside=None
) -> CpuSampler | None:
    """`python -m peer.cli ARGV` in the repository, output to `log_path`; RuntimeError with the log's
    tail if it fails or runs past `timeout` seconds (it is stopped either way). With `sample_cpu`, the
    CpuSampler of its process tree. `alongside(log_path)`, called once the command started, may start
    a process of its own (an attacker) and return it: it is stopped when the command ends."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sampler = side = None
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "peer.cli", *argv],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        if sample_cpu:
            sampler = CpuSampler(proc.pid)
        try:
            if alongside is not None:
                side = alongside(log_path)
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _stop(proc)
            if side is not None:
                _stop(side)
            if sampler is not None:
                sampler.stop()
    if rc != 0:
        tail = log_path.read_bytes()[-2000:].decode(errors="replace")
        why = f"ran past {timeout:.0f} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"peer {' '.join(argv[:1])} {why}; see {log_path}:\n{tail}")
    return sampler


def run_reference(model: str, steps: int, work: Path, timeout: float = 900) -> dict:
    out = work / "reference.json"
    load_before = loadavg()
    run_peer(
        ["reference", "--model", model, "--steps", str(steps), "--summary-json", str(out), "--no-progress"],
        work / "reference.log",
        timeout,
    )
    summary = json.loads(out.read_text())
    summary["load"] = load_before
    return summary


def train_run_reference(
    model: str, steps: int, on_step=None, recipe=None, summary: dict | None = None, precision: str = "fp32"
) -> dict:
    """`peer reference`'s final parameters, in this process, with the settings every benchmark's
    swarm runs with (batch 16 in 4 micro-batches, the delayed update, lr 2e-3, seed 0); `on_step`
    as peer.reference.train_reference takes it; `recipe` a core.protocol.recipe.Recipe at lr 2e-3
    (None: the default one); `precision` the run's. `summary`, a dict, receives the run's summary."""
    from core.model.config import get_preset
    from core.model.data import load_corpus
    from peer.reference import train_reference

    cfg = get_preset(model)
    state, info = train_reference(
        cfg,
        load_corpus(None, seq_len=cfg.seq_len),
        steps=steps,
        seed=0,
        batch_size=16,
        micro_batches=4,
        delay=1,
        lr=2e-3,
        recipe=recipe,
        precision=precision,
        progress=False,
        on_step=on_step,
    )
    if summary is not None:
        summary.update(info)
    return state


def run_swarm(
    name: str, args: list[str], work: Path, timeout: float = 900, sample_cpu: bool = False, alongside=None
) -> dict:
    """One `peer swarm` with ARGS; its summary dict plus `load` (at its start) and `run_seconds` (the
    whole command: startup, training, assembling the model, teardown); with `sample_cpu`, `cpu`: the
    processor seconds of each kind of process during the training (CpuSampler; from the summary's
    training_started_at for wall_seconds). The servers' checkpoints are deleted afterwards; the
    logs stay under WORK/NAME."""
    run_dir = work / name
    summary_path = work / f"{name}.json"
    load_before = loadavg()
    t0 = time.perf_counter()
    try:
        sampler = run_peer(
            ["swarm", *args, "--summary-json", str(summary_path), "--work-dir", str(run_dir), "--no-progress"],
            work / f"{name}.log",
            timeout,
            sample_cpu=sample_cpu,
            alongside=alongside,
        )
    finally:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    summary = json.loads(summary_path.read_text())
    summary["load"] = load_before
    summary["run_seconds"] = time.perf_counter() - t0
    if sampler is not None:
        start = summary["training_started_at"]
        summary["cpu"] = sampler.seconds_by_kind(start, start + summary["wall_seconds"])
        summary["cpu_by_owner"] = sampler.seconds_by_owner(start, start + summary["wall_seconds"])
    return summary


def rel_l2(a: dict, b: dict) -> float:
    """Relative L2 distance of parameter dicts `a` from `b` (over b's names)."""
    num = sum(float((a[k] - b[k]).double().square().sum()) for k in b)
    den = sum(float(b[k].double().square().sum()) for k in b)
    return (num / den) ** 0.5


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

    from core.model.config import flops_per_token_per_layer, get_preset
    from core.model.transformer import build_slice, loss_sum

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
