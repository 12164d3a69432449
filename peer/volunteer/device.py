"""The device a stage worker computes on (a part of peer/volunteer/worker.py's StageWorker): its
passes run one at a time in a compute thread, each lasting as long as it would on the device the
worker emulates (`slowdown` times this CPU's processor time, as --volunteer-slowdown and link
profiles declare), and the compute it registers (rows per second) is measured the same way."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

_gc_clock = threading.local()


def _time_collections(phase: str, _info: dict) -> None:
    if phase == "start":
        _gc_clock.began = time.thread_time()
    elif getattr(_gc_clock, "began", None) is not None:
        _gc_clock.spent = getattr(_gc_clock, "spent", 0.0) + time.thread_time() - _gc_clock.began
        _gc_clock.began = None


gc.callbacks.append(_time_collections)


def pass_clock() -> float:
    """This thread's processor seconds, less what it spent collecting garbage (gc.callbacks time the
    collections in the thread that runs them). An emulated device stretches a pass by the processor
    time its arithmetic used: a full collection that happens to fall in a pass (0.1-0.2 s with the
    objects torch and hivemind hold) is the interpreter's, not the device's, and stretched x10 it
    would stall a step by 2 s."""
    return time.thread_time() - getattr(_gc_clock, "spent", 0.0)


class EmulatedDevice:
    """`torch_device` computing `slowdown` times slower than it does (1: as fast). `stats` gets the
    seconds its passes lasted under "compute_seconds"."""

    def __init__(self, torch_device: torch.device, slowdown: float = 1.0, stats: dict | None = None):
        self.torch_device, self.slowdown = torch_device, slowdown
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("compute_seconds", 0.0)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")

    def pass_seconds(self, elapsed: float, busy: float) -> float:
        """How long a pass that took `elapsed` seconds of wall time and `busy` of this thread's
        processor time (`pass_clock`: less its garbage collections) lasts on the emulated device. A
        slower device (slowdown > 1) lasts `slowdown` times the processor time it used (torch runs on
        this one thread), however long other processes kept it from a core; stretching the wall time
        would multiply their contention too (on 2 cores shared by a dozen processes, x10 of a pass
        slowed 1.5x is a device 1.5x slower than declared). On a GPU the wall time is what the
        kernels took."""
        if self.slowdown <= 1:
            return elapsed
        return max(elapsed, self.slowdown * (busy if self.torch_device.type == "cpu" else elapsed))

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` in the compute thread, lasting as long as it would on the emulated device."""

        def timed():
            t0, c0 = time.perf_counter(), pass_clock()
            result = fn()
            elapsed = time.perf_counter() - t0
            time.sleep(self.pass_seconds(elapsed, pass_clock() - c0) - elapsed)
            self.stats["compute_seconds"] += time.perf_counter() - t0
            return result

        return await asyncio.get_running_loop().run_in_executor(self.executor, timed)

    def measure(self, model, cfg, rows: int = 1, repeats: int = 5) -> float:
        """Rows per second of forward+backward of `model` (a stage slice of `cfg`) on this device (the
        compute power a client registers), as long as passes last on the emulated device: the fastest
        of `repeats` timed passes after a warm-up, since one pass can be preempted by other processes
        (a volunteer measured far slower than it is, beside others that measured on a quiet moment,
        is never given a task). On a CPU a pass counts no longer than the processor time this thread
        spent in it: the device's speed, not how many other processes shared its cores at that moment
        (a swarm's processes all measure while the others start)."""
        if model.is_first:
            x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len))
        else:
            x = torch.randn(rows, cfg.seq_len, cfg.hidden)
        x = x.to(self.torch_device)
        best = float("inf")
        for i in range(repeats + 1):
            t0, c0 = time.perf_counter(), pass_clock()
            out = model(x)
            out.float().sum().backward()
            model.zero_grad(set_to_none=True)
            if x.is_cuda:  # kernels run asynchronously: the pass ends when they do
                torch.cuda.synchronize(x.device)
            if i > 0:  # the first is a warm-up
                # as long as the pass lasts on the emulated device (pass_seconds), so that what it
                # registers is what it will deliver, however loaded the machine is while it measures
                elapsed, busy = time.perf_counter() - t0, pass_clock() - c0
                if not x.is_cuda:
                    elapsed = min(elapsed, busy)
                best = min(best, self.pass_seconds(elapsed, busy))
        return rows / max(best, 1e-6)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)


def measured_compute(run, layout, cfg, stage: int, torch_device: str, slowdown: float) -> float:
    """Rows per second of `stage`'s slice on this device (EmulatedDevice.measure), on a slice built
    for the measurement alone: a peer knows what it computes before its first record says it."""
    from core.model.transformer import build_slice

    lo, hi = layout.stages[stage].layers
    device = EmulatedDevice(torch.device(torch_device), slowdown)
    try:
        return device.measure(build_slice(cfg, lo, hi, run.seed, device=device.torch_device), cfg)
    finally:
        device.shutdown()
