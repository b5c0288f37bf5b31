"""The SQL the documentation tells operators to run, read from README.md and docs/ itself (so a
query edited there is the query tested): every statement of a ```sql block, and every quoted
`SELECT ...` a shell block passes to sqlite3 or psql."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_FENCED = re.compile(r"```(\w*)\n(.*?)```", re.S)
_QUOTED_SELECT = re.compile(r"""(["'])\s*(SELECT\b.*?)\1""", re.S | re.I)


def documented_queries() -> list[tuple[str, str]]:
    """[(where, query)]: the page (relative to the repository) and the query on one line."""
    out: list[tuple[str, str]] = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for lang, body in _FENCED.findall(page.read_text()):
            found = body.split(";") if lang == "sql" else [m.group(2) for m in _QUOTED_SELECT.finditer(body)]
            out += [(str(page.relative_to(REPO)), " ".join(q.split())) for q in found if q.strip()]
    return out
