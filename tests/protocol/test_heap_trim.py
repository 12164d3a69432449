"""peer.runtime.trim_heap: what a long-lived server calls once a minute so that a burst of freed
tensors (rows held through a failover's pause) does not keep its RSS at the burst's high-water mark."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# in a fresh process: what earlier tests left in this one's heap changes where a burst lands
BURST = """
import json, sys
import psutil, torch
from peer.runtime import trim_heap
process = psutil.Process()
# 64 KiB each (under glibc's mmap threshold: they live in the heap), with small tensors kept between
# them, as a server's rows of later batches are: freeing the burst leaves the heap's top in use, so
# glibc keeps the freed pages itself
burst, kept = [], []
for i in range(4000):  # 250 MiB
    burst.append(torch.ones(16, 64, 16))
    if i % 50 == 0:
        kept.append(torch.ones(100))
del burst
freed = process.memory_info().rss
trimmed = process.memory_info().rss if sys.argv[1] == "no" else (trim_heap(), process.memory_info().rss)[1]
print(json.dumps({"freed": freed, "trimmed": trimmed, "kept": all(bool((k == 1).all()) for k in kept)}))
"""


def released(trim: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", BURST, "yes" if trim else "no"], capture_output=True, text=True, check=True
    ).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["kept"]
    return (r["freed"] - r["trimmed"]) / 2**20


def test_freed_small_tensors_go_back_to_the_system():
    from peer.runtime import trim_heap

    if not trim_heap():
        pytest.skip("no glibc malloc_trim on this system")
    assert released(trim=False) < 50  # glibc keeps them
    assert released(trim=True) > 200  # trim_heap hands them back
