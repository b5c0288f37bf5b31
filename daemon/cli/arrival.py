"""How a version arrived, in words: full, or a delta of a base (daemon.delta) with what it cost and
what it changed. `hotswap history` (its "delta" column), `show` and `status` print these.

The figures are the registry's (migrations 0017 and 0022): `encoding`, `delta_base`, `fetched_bytes`,
`delta_ratio`, `tensors_changed`, `elements_changed`, `compacted_from`, `compacted_bytes`.
"""

from __future__ import annotations

from typing import Any

from daemon.cli.text import fmt_bytes, safe


def changed(row: dict[str, Any]) -> str:
    """'21 tensors, 2,184 elements changed', or '' when not recorded (a full version, an older delta)."""
    t, e = row.get("tensors_changed"), row.get("elements_changed")
    return f"{t:,} tensors, {e:,} elements changed" if t is not None and e is not None else ""


def delta_cell(row: dict[str, Any]) -> str:
    """The history column: 'v2 (2.1 %; 21 tensors, 2,184 elements changed)'; '' for a full version."""
    if row.get("encoding") != "delta" or not row.get("delta_base"):
        return ""
    what = "; ".join(x for x in (f"{100 * (row.get('delta_ratio') or 0):.1f} %", changed(row)) if x)
    return f"{safe(row['delta_base'])} ({what})"


def arrival_line(row: dict[str, Any]) -> str:
    """One line for `hotswap status`: how the version came in, its bytes fetched and what changed."""
    fetched = f"{fmt_bytes(row.get('fetched_bytes')) or '0 B'} fetched"
    if row.get("encoding") != "delta":
        return f"full, {fetched}"
    parts = [f"delta of {safe(row.get('delta_base') or '?')}",
             f"{fetched} ({100 * (row.get('delta_ratio') or 0):.2f} % of full)"]  # fmt: skip
    if changed(row):
        parts.append(changed(row))
    if row.get("compacted_from"):
        parts.append(
            f"compacted delta from {safe(row['compacted_from'])}: {fmt_bytes(row.get('compacted_bytes'))}"
        )
    return ", ".join(parts)


def arrival_lines(deltas: list[dict[str, Any]]) -> list[str]:
    """The status block: '  serving v3: delta of v2, ...' per serving / pending version recorded."""
    return [
        f"{'arrived:':<12} {safe(d.get('version'))} ({safe(d.get('role'))}): {arrival_line(d)}"
        for d in deltas
    ]
