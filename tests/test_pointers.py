"""Every pointer the code gives a reader resolves: a path (`peer/volunteer/worker.py`,
`docs/trust.md`) names a file of the repository, and a dotted name (`peer.host.server.ServerHost`,
`parameter_server.shard`) names a module, or a module's top-level name, that exists. A file moved
or a class renamed leaves no comment or docstring pointing at nothing."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("peer", "parameter_server", "taskpool", "scheduler")
PATH = re.compile(
    r"(?<![\w/.])((?:peer|parameter_server|taskpool|scheduler|scripts|tests|docs)/[\w/.-]*\w\.(?:py|md|json|png))"
)
DOTTED = re.compile(r"(?<![\w./])((?:peer|parameter_server|taskpool|scheduler)(?:\.[A-Za-z_]\w*)+)")


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


@lru_cache(maxsize=None)
def top_level_names(path: Path) -> frozenset[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(e.id for e in ast.walk(t) if isinstance(e, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def dangling(line: str) -> list[str]:
    out = [m for m in PATH.findall(line) if not (ROOT / m).exists()]
    if line.lstrip().startswith(("import ", "from ")):
        return out
    for name in DOTTED.findall(line):
        parts = name.split(".")
        k = len(parts)
        while k and module_file(parts[:k]) is None:
            k -= 1
        if k == 0:
            out.append(f"{name} (no such module)")
        elif (
            k < len(parts) and not parts[k].startswith("__") and parts[k] not in top_level_names(module_file(parts[:k]))
        ):
            out.append(f"{name} ({parts[k]} is not in {'.'.join(parts[:k])})")
    return out


def test_every_path_and_dotted_name_in_the_code_resolves():
    bad = []
    for package in (*PACKAGES, "scripts"):
        for f in sorted((ROOT / package).rglob("*.py")):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                bad += [f"{f.relative_to(ROOT)}:{i}: {x}" for x in dangling(line)]
    assert not bad, "pointers to nothing:\n" + "\n".join(bad)


def test_a_moved_file_or_a_renamed_name_is_seen():
    assert dangling("# (the worker's own rule, peer/volunteer/nowhere.py)") == ["peer/volunteer/nowhere.py"]
    assert dangling("`peer.host.server.ServerHost` runs it") == []
    assert dangling("see peer.host.server.NoSuchHost") == [
        "peer.host.server.NoSuchHost (NoSuchHost is not in peer.host.server)"
    ]
    assert dangling("peer.nowhere.thing") == ["peer.nowhere.thing (nowhere is not in peer)"]
