"""`hotswap reverify VERSION`: send a settled version back through every check.

For a version whose files changed after its verdict (the daemon records that, see
daemon.pipeline.rediscovery) or a check that was fixed since. Any version except the serving one may
be verified again; it goes back to `discovered` and through fetch/verify like a new arrival
(a version that passes is then rolled out only if it is newer than the serving one).

With the daemon running, the request goes to its API (`POST /v1/checkpoints/reverify`, with
the control token from `<state_dir>/control.token`); without it, the registry is changed
directly and the daemon verifies it at its next start. The command then waits (`--timeout`)
for the verdict and prints it: exit 0 when verified, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from daemon.cli.control import NotRunning, post_control
from daemon.cli.read import read_config
from daemon.common import TokenFileError
from daemon.config import CONFIG_ENV, Config, ConfigError
from daemon.pipeline import OPERATOR_REVERIFY as WHY
from daemon.pipeline import request_reverify
from daemon.registry import UNFINISHED, Registry
from daemon.registry import queries as q

FAILED = ("rejected", "deferred", "duplicate", "unknown", *UNFINISHED)  # exit 1: its checks did not pass (yet)


def _through_daemon(config: Config, version: str, token_file: str | None) -> dict[str, Any]:
    return post_control(config, "/v1/checkpoints/reverify", {"version": version}, 30, token_file)


def _wait(reg: Registry, version: str, timeout_s: float) -> tuple[str, str | None]:
    deadline = time.monotonic() + timeout_s
    while True:
        with reg.session() as s:
            c = q.get_checkpoint(s, version)
            st, msg = (c.status, c.status_message) if c is not None else ("unknown", None)
        if st not in UNFINISHED or time.monotonic() >= deadline:
            return st, msg
        time.sleep(0.2)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hotswap reverify", description="Verify VERSION again, from the start.")
    p.add_argument("version", metavar="VERSION", help="the version label to verify again (not the serving one)")
    p.add_argument("-c", "--config", default=None, help=f"config TOML (default: ${CONFIG_ENV} or the embedded default)")
    p.add_argument("--state-dir", default=None, help="the daemon's state folder (its hotswap.db, daemon.json)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the verdict (0: do not wait)")
    p.add_argument("--token-file", metavar="FILE", default=None, help="a named token's file (default: control.token)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = read_config(args)
    except ConfigError as exc:
        print(f"hotswap: error: {exc}", file=sys.stderr)
        return 2
    reg = Registry(config.database_url, config.fleet.host or None)
    try:
        try:
            try:
                was = _through_daemon(config, args.version, args.token_file)["was"]
            except NotRunning:
                reg.upgrade()
                with reg.session() as s:
                    _, was = request_reverify(s, args.version, WHY)
                print(f"{args.version}: was {was}; queued: the daemon verifies it at its next start")
                return 0
        except (RuntimeError, LookupError, ValueError, TokenFileError) as exc:
            print(f"hotswap: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 1
        print(f"{args.version}: was {was}; the daemon is verifying it")
        if args.timeout <= 0:
            return 0
        st, msg = _wait(reg, args.version, args.timeout)
        print(f"{args.version}: {st}" + (f" ({msg})" if msg else ""))
        return 1 if st in FAILED else 0
    finally:
        reg.close()
