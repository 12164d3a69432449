"""The rows of docs/deploy.md's "What each failure looks like" in which a command exits: the exit code
and the message the page quotes. The tests that cause each of these failures check the command's exit
code and the first line of its stderr against the page (`check_refusal`), so that the page an operator
reads and what the commands say cannot drift apart; tests/test_docs.py checks that every such row is
checked by a test."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
HEADING = "## What each failure looks like"


def refusal_rows(text: str | None = None) -> dict[str, tuple[int, str | None]]:
    """{the row's first cell: (exit code, the quoted message or None)} of the rows whose second cell
    says that a command exits."""
    text = PAGE.read_text() if text is None else text
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("what", "---"):
            continue
        exits = re.search(r"exits (\d+)", cells[1])
        if exits is None:
            continue
        quoted = re.search(r'exits \d+[^"]*?: "([^"]+)"', cells[1])
        rows[cells[0]] = (int(exits.group(1)), quoted.group(1) if quoted else None)
    return rows


def row(what: str) -> tuple[str, int, str | None]:
    """The row whose first cell starts with `what`: (its first cell, exit code, message)."""
    found = [(k, *v) for k, v in refusal_rows().items() if k.startswith(what)]
    assert len(found) == 1, f"docs/deploy.md's failure table has {len(found)} rows starting {what!r}"
    return found[0]


def message_pattern(message: str, values: dict[str, str]) -> re.Pattern:
    """The page's message as a pattern: its example values (whole words) replaced by this test's,
    and each '...' standing for anything."""
    pieces = []
    for piece in message.split("..."):
        for example, actual in values.items():
            piece = re.sub(rf"(?<![\w-]){re.escape(example)}(?![\w-])", lambda _m, a=actual: a, piece)
        pieces.append(re.escape(piece))
    return re.compile(".*".join(pieces))


def check_refusal(what: str, returncode: int, stderr: str, values: dict[str, str] | None = None) -> None:
    """The command of row `what` exited with the page's code, and the first line of its stderr says
    the page's message (the reason first: no usage text or log line before it). `values`: {the page's
    example value: this test's}, e.g. {"demo": "life"}."""
    cell, code, message = row(what)
    first = stderr.strip().splitlines()[0] if stderr.strip() else ""
    assert returncode == code, f"{cell}: exit {returncode}, the page says {code}; stderr: {stderr[-2000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    if message is not None:
        pattern = message_pattern(message, values or {})
        assert pattern.search(first), f"{cell}: the first line of stderr is\n  {first}\nthe page says\n  {message}"
