"""The CLI reference: every `hotswap` command's --help, printed by its own argument parser.

Commands parsed by `daemon.cli.main` and those it delegates (daemon.cli.main.DELEGATED) are
all run with `--help` in-process, at a fixed width, and their output is the page.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable

WIDTH = "100"


def commands() -> list[str]:
    """Every command line that has a --help, top level first."""
    from daemon.cli.main import DELEGATED, _parser

    out = [""]
    parser = _parser()
    for action in parser._subparsers._group_actions if parser._subparsers else []:  # type: ignore[union-attr]
        for name, sub in getattr(action, "choices", {}).items():
            if name in DELEGATED:
                continue
            out.append(name)
            for inner in sub._subparsers._group_actions if sub._subparsers else []:
                out += [f"{name} {n}" for n in getattr(inner, "choices", {})]
    out += list(DELEGATED)
    out.append("fleet target")
    return out


def help_text(command: str, main: Callable[[list[str]], int] | None = None) -> str:
    from daemon.cli.main import main as cli_main

    run = main or cli_main
    buf = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            run([*command.split(), "--help"])
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return buf.getvalue().rstrip()


def markdown() -> str:
    lines = []
    for command in commands():
        title = f"hotswap {command}".strip()
        lines += [f"## `{title}`", "", "```text", help_text(command), "```", ""]
    return "\n".join(lines)
