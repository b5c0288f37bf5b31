"""MkDocs hooks (mkdocs.yml `hooks:`): fill the generated parts of the pages at build time.

A page asks for a generated part with an HTML comment on a line of its own:

    <!-- gen:config -->                     every config key (tools.docsgen.config_ref)
    <!-- gen:cli -->                        every command's --help (tools.docsgen.cli_ref)
    <!-- gen:http -->                       every HTTP route (tools.docsgen.http_ref)
    <!-- gen:diagram:NAME -->               checkpoint-statuses | worker-states | worker-happy-path | process (SVG)
    <!-- gen:transitions:KIND -->           checkpoint | worker: the transition table as text

An unknown name fails the build (mkdocs build --strict turns the error into a failure anyway).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

MARKER = re.compile(r"^<!-- gen:([a-z-]+)(?::([a-z-]+))? -->$", re.MULTILINE)


def _diagram(name: str) -> str:
    from tools.docsgen import diagrams

    draw: dict[str, Callable[[], str]] = {"checkpoint-statuses": diagrams.checkpoint_statuses,
                                          "worker-states": diagrams.worker_states, "process": diagrams.process,
                                          "worker-happy-path": diagrams.worker_happy_path}  # fmt: skip
    return f'<div class="hotswap-diagram" markdown="0">{draw[name]()}</div>'


@functools.cache
def generated(kind: str, arg: str | None) -> str:
    from tools.docsgen import cli_ref, config_ref, diagrams, http_ref

    if kind == "config":
        return config_ref.markdown()
    if kind == "cli":
        return cli_ref.markdown()
    if kind == "http":
        return http_ref.markdown()
    if kind == "diagram" and arg:
        return _diagram(arg)
    if kind == "transitions" and arg in ("checkpoint", "worker"):
        return diagrams.transition_table(arg)
    raise ValueError(f"unknown generated part gen:{kind}{':' + arg if arg else ''}")


def on_config(config: Any) -> Any:
    """The daemon package and tools/ of this checkout, ahead of any installed copy (mkdocs restores
    sys.path after importing a hook, so this runs at build time, not import time)."""
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARKER.sub(lambda m: generated(m.group(1), m.group(2)), markdown)
