"""`hotswap config check FILE`: validate a config file without starting anything.

Everything `hotswap daemon` would refuse at start is reported, one line per problem: unknown
sections and keys, wrong types and values (each section and each `[[sources]]` table is parsed
on its own, so one bad section does not hide the next), then what the start-up preflight looks at
(daemon.process.preflight: ports free, token, TLS and key files present and usable, required
folders there). Nothing is created, bound for longer than a test bind, migrated or launched.
Exit codes: 0 no problem, 2 one or more problems (printed to stdout, one per line).
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from daemon.common import CONFIG_ENV

# Sections another section's checks read (a non-loopback listen needs [api] TLS; [fleet] enabled
# needs a PostgreSQL [database]): parsed along with each section, when they parse on their own.
_CONTEXT = ("daemon", "api", "database")


def add_parser(sub: Any) -> None:
    cfg = sub.add_parser("config", help="check a config file without starting anything")
    csub = cfg.add_subparsers(title="config commands", metavar="CONFIGCOMMAND")
    check = csub.add_parser(
        "check",
        help="validate FILE: unknown keys, types, files that must exist, ports free (one line per problem)",
        description="Validate a config file as `hotswap daemon -c FILE` would at start, without starting "
        "anything. Prints one line per problem and exits 2, or `FILE: ok` and exits 0.",
    )
    check.add_argument("file", metavar="FILE", nargs="?", default=None,
                       help=f"the config TOML (default: ${CONFIG_ENV})")  # fmt: skip
    check.set_defaults(func=check_cmd)


def check_cmd(args: argparse.Namespace) -> int:
    import os

    path = args.file or os.environ.get(CONFIG_ENV)
    if not path:
        print(f"hotswap config check: name a FILE (or set ${CONFIG_ENV})")
        return 2
    problems, config = config_problems(Path(path))
    for line in problems:
        print(f"hotswap: error: {' '.join(line.split())}")
    if problems:
        return 2
    assert config is not None
    workers = f"{len(config.workers)} worker(s)" if config.workers else "no [[workers]]: the daemon only verifies"
    print(f"{path}: ok ({len(config.sources)} source(s), {workers})")
    return 0


def config_problems(path: Path) -> tuple[list[str], Any]:
    """Every problem of the file, one line each; the parsed config when there is none."""
    from daemon.config import ConfigError, load_config
    from daemon.process import preflight_problems

    try:
        config = load_config(path)
    except ConfigError as whole:
        return _section_problems(path) or [str(whole)], None
    return preflight_problems(config), config


def _section_problems(path: Path) -> list[str]:
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []  # load_config's own message says it best
    source = str(path)
    context = {k: doc[k] for k in _CONTEXT if k in doc and _parses({k: doc[k]}, source)}
    out: list[str] = []
    for name, value in doc.items():
        if name == "sources" and isinstance(value, list):
            for i, table in enumerate(value):
                out += [p.replace("sources[0]", f"sources[{i}]", 1) for p in _problems({**context, "sources": [table]}, source)]
            continue
        out += [p for p in _problems({**context, name: value}, source) if p not in out]
    return out


def _problems(doc: dict[str, Any], source: str) -> list[str]:
    from daemon.config import ConfigError, parse_config

    try:
        parse_config(doc, source)
    except ConfigError as exc:
        return exc.problems
    return []


def _parses(doc: dict[str, Any], source: str) -> bool:
    return not _problems(doc, source)
