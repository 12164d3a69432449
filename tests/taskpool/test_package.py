"""The package itself: its public names, its imports, and the benchmark script."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import taskpool

ROOT = Path(__file__).resolve().parents[2]


def test_public_api_is_reexported():
    for name in ("TaskPool", "Task", "Lease", "Completion", "TaskPoolError"):
        assert name in taskpool.__all__ and hasattr(taskpool, name)


def test_import_uses_the_standard_library_only():
    code = (
        "import sys, taskpool; heavy = {'torch', 'numpy', 'hivemind', 'asyncio'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bench_script_runs_small(capsys):
    spec = importlib.util.spec_from_file_location("bench_taskpool", ROOT / "scripts" / "bench_taskpool.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tasks", "2000", "--clients", "10"]) == 0
    out = capsys.readouterr().out
    for row in ("add", "take+complete pairs", "expire", "client_left"):
        assert f"\n{row} " in out
    assert "pairs/s (target 200,000)" in out
