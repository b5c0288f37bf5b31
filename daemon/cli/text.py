"""Values as terminal text: one printable line (`safe`), a byte count (`fmt_bytes`)."""

from __future__ import annotations

from typing import Any


def safe(value: Any) -> str:
    """A value as one printable line: control characters (ESC, newlines, ...) escaped."""
    text = "" if value is None else str(value)
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def fmt_bytes(n: int | None) -> str:
    if not n:
        return ""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return str(n)
