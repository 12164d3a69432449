"""The README and docs/ are for users: every link resolves inside the repository, the README stays a
short front door, and neither narrates the work's history (git log does)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HISTORY = re.compile(r"\b[Ss]top \d+\b|\bstop-\d+\b|\bat [0-9a-f]{7,40}\b|\bissue #\d+")


def test_every_link_of_the_readme_and_docs_resolves_inside_the_repository():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+://|^mailto:|^#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or REPO not in path.parents and path != REPO:
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []


def test_the_readme_is_a_short_front_door_without_history():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "peer swarm" in text and "pytest" in text
    for page in PAGES:
        found = HISTORY.findall(page.read_text())
        assert found == [], (page.name, found[:5])


def test_peer_version_is_the_packages_and_the_changelog_has_it():
    import subprocess
    import sys

    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    out = subprocess.run([sys.executable, "-m", "peer.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"hivepipe {version}"
    assert f"## [{version}]" in (REPO / "CHANGELOG.md").read_text()


def test_every_exit_in_the_deploy_pages_failure_table_is_checked_by_a_test():
    """Each row of docs/deploy.md's "What each failure looks like" in which a command exits is checked
    by a test that causes that failure (tests/deploy_table.py `check_refusal`: the exit code and the
    first line of stderr against the page)."""
    from tests.deploy_table import refusal_rows

    rows = refusal_rows()
    assert len(rows) >= 9, rows  # (the table as the page has it: a parse that finds less lost rows)
    checked = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        checked |= set(re.findall(r'check_refusal\(\s*"([^"]+)"', path.read_text()))
    unknown = [c for c in checked if sum(cell.startswith(c) for cell in rows) != 1]
    assert unknown == [], f"check_refusal names no single row of the table: {unknown}"
    unchecked = [cell for cell in rows if not any(cell.startswith(c) for c in checked)]
    assert unchecked == [], f"rows of docs/deploy.md's failure table no test checks: {unchecked}"
