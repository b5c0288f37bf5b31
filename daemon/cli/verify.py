"""`hotswap verify DIR`: run the verify stage offline, show progress, print a table (or JSON).

Exit status: 0 when every check passes, 1 when the checkpoint is rejected, 3 when it
is deferred (headroom), 2 for usage and config errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from daemon.checks import (
    CHECK_NAMES,
    REQUIRES,
    CheckResult,
    CheckSettings,
    VerifyReport,
    dependency_problem,
    run_checks,
)

EXIT_OK, EXIT_REJECTED, EXIT_USAGE, EXIT_DEFERRED = 0, 1, 2, 3


def _key_pairs(values: list[str] | None, flag: str) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for v in values or []:
        key_id, sep, path = v.partition("=")
        if not sep or not key_id or not path:
            raise ValueError(f"{flag} expects KEY_ID=FILE, got {v!r}")
        out[key_id] = Path(path)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hotswap verify",
        description="Prove a checkpoint whole and sane (the daemon's verify stage, offline).",
    )
    ap.add_argument("directory", metavar="DIR", type=Path, help="the checkpoint directory to check")
    ap.add_argument("--reference", type=Path, help="serving version to check compatibility against")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    ap.add_argument("-c", "--config", type=Path, help="take [checks] settings from this daemon config")
    ap.add_argument(
        "--checks",
        help=f"comma-separated subset of: {','.join(CHECK_NAMES)} (checks they need are added: crc32c needs manifest)",
    )
    ap.add_argument("--skip", help="comma-separated checks to leave out (not one another enabled check needs)")
    ap.add_argument(
        "--allow-format1",
        action="store_true",
        default=None,
        help="accept a format-1 (CRC32C-only) manifest although signature keys are given",
    )
    ap.add_argument(
        "--hmac-key", action="append", metavar="KEY_ID=FILE", help="trusted HMAC key (repeatable)"
    )
    ap.add_argument(
        "--ed25519-key", action="append", metavar="KEY_ID=FILE", help="trusted Ed25519 public key"
    )
    ap.add_argument("--require-manifest", action="store_true", default=None,
                    help="fail a checkpoint without hotswap-manifest.json (as [checks] require_manifest)")
    ap.add_argument("--headroom-factor", type=float, help="host RAM needed: this x the staging bytes (default 1.5)")
    ap.add_argument(
        "--threads", type=int, help="hashing (CRC32C + strong hash) and finite-scan threads (default: one per core)"
    )
    ap.add_argument("--device", help="forward-pass device (cpu, cuda:0, ...)")
    ap.add_argument("--top1-min", type=float, help="minimum top-1 agreement with --reference")
    ap.add_argument("--kl-max", type=float, help="maximum mean KL(reference || new), nats")
    ap.add_argument("--no-restart", dest="restart", action="store_false", default=None,
                    help="fail a checkpoint whose shapes differ from --reference (as [rollout] restart_rollouts = "
                         "false); by default it passes as needing a restart rollout")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return ap


def _settings(args: argparse.Namespace) -> CheckSettings:
    base = CheckSettings()
    if args.config is not None:
        from daemon.config import ConfigError, load_config

        try:
            base = load_config(args.config).checks
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    changes: dict[str, Any] = {}
    if args.hmac_key:
        changes["hmac_keys"] = {**base.hmac_keys, **_key_pairs(args.hmac_key, "--hmac-key")}
    if args.ed25519_key:
        changes["ed25519_keys"] = {**base.ed25519_keys, **_key_pairs(args.ed25519_key, "--ed25519-key")}
    keys = bool(changes.get("hmac_keys", base.hmac_keys) or changes.get("ed25519_keys", base.ed25519_keys))
    require_manifest = bool(args.require_manifest or base.require_manifest)
    enabled = list(base.enabled)
    if args.checks:
        enabled = [c.strip() for c in args.checks.split(",") if c.strip()]
        unknown = set(enabled) - set(CHECK_NAMES)
        if unknown:
            raise ValueError(f"--checks: unknown check names {sorted(unknown)}; known: {list(CHECK_NAMES)}")
        # what a named check needs runs too, so nothing passes on nothing; keys need the bytes hashed
        needs = [n for name in enabled for n in REQUIRES.get(name, ())]
        needs += ["manifest", "crc32c"] if keys else ["manifest"] if require_manifest else []
        enabled += [n for n in needs if n not in enabled]
    if args.skip:
        skip = {c.strip() for c in args.skip.split(",")}
        unknown = skip - set(CHECK_NAMES)
        if unknown:
            raise ValueError(f"--skip: unknown check names {sorted(unknown)}; known: {list(CHECK_NAMES)}")
        for name in enabled:
            needed = [n for n in REQUIRES.get(name, ()) if n in skip]
            if needed and name not in skip:
                raise ValueError(
                    f"--skip {needed[0]}: the {name} check needs it (skip {name} too, or keep {needed[0]})"
                )
        enabled = [c for c in enabled if c not in skip]
        problem = dependency_problem(tuple(enabled), keys, require_manifest)
        if problem:
            raise ValueError(f"--skip {','.join(sorted(skip))}: {problem.removeprefix('checks.enabled: ')}")
    changes["enabled"] = tuple(n for n in CHECK_NAMES if n in enabled)
    for flag, field_name in [
        ("require_manifest", "require_manifest"),
        ("allow_format1", "allow_format1_manifest"),
        ("headroom_factor", "headroom_factor"),
        ("threads", "crc_threads"),
        ("device", "forward_device"),
        ("top1_min", "forward_top1_min"),
        ("kl_max", "forward_kl_max"),
        ("restart", "restart_rollouts"),
    ]:
        value = getattr(args, flag)
        if value is not None:
            changes[field_name] = value
    return replace(base, **changes)  # replace() re-runs __post_init__ validation


def _summary(result: CheckResult) -> str:
    d = result.detail
    if not result.ok:
        return str(d.get("reason", ""))
    if result.skipped:
        return str(d.get("skipped", ""))
    weak = f"; WEAK: {d['weak']}" if "weak" in d else ""
    if d.get("restart_rollout"):
        return f"needs a restart rollout: {d.get('note', '')}"
    if result.name == "crc32c":
        return (
            f"{d['files']} files, {d['bytes'] / 1e9:.3f} GB at {d.get('gb_per_s')} GB/s "
            f"({d.get('hash_alg')} + crc32c), compared with {d.get('compared')}, digest {d['digest']}{weak}"
        )
    parts = [f"{k}={v}" for k, v in d.items() if isinstance(v, str | int | float) and k not in ("reason", "weak")]
    text = ", ".join(parts)
    return (text if len(text) <= 110 else text[:107] + "...") + weak


def _not_run(settings: CheckSettings, report: VerifyReport) -> list[tuple[str, str]]:
    """(name, why) of each check that did not run: disabled, or after the first failure."""
    ran = {r.name for r in report.results}
    out = []
    for name in CHECK_NAMES:
        if name in ran:
            continue
        if name not in settings.enabled:
            out.append((name, "disabled"))
        elif not report.ok:
            out.append((name, "not reached (an earlier check failed)"))
    return out


def _report_json(directory: Path, report: VerifyReport, settings: CheckSettings) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {
        r.name: {
            "name": r.name,
            "status": r.status,
            "ok": r.ok,
            "deferred": r.deferred,
            "started_at": r.started_at.isoformat(),
            "duration_ms": round(r.duration_ms, 3),
            "detail": r.detail,
        }
        for r in report.results
    }
    for name, why in _not_run(settings, report):
        rows[name] = {"name": name, "status": "skipped", "ok": None, "detail": {"skipped": why}}
    return {
        "directory": str(directory),
        "ok": report.ok,
        "deferred": report.deferred,
        "reason": report.reason,
        "version": report.manifest.version if report.manifest else directory.name,
        "digest": report.digest,
        "total_bytes": report.total_bytes,
        "tensor_count": report.tensor_count,
        "results": [rows[n] for n in CHECK_NAMES if n in rows],  # every check, in run order
        "files": [
            {"path": f.path, "bytes": f.bytes, "crc32c": f.crc32c, "hash_alg": f.hash_alg, "hash": f.hash}
            for f in report.files
        ],
    }


_STYLE = {"pass": "[green]pass", "fail": "[red]FAIL", "deferred": "[yellow]deferred", "skipped": "[dim]skipped"}


def _print_table(directory: Path, report: VerifyReport, settings: CheckSettings) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(emoji=False, highlight=False)  # names are the user's: never markup or emoji codes
    table = Table(title=f"hotswap verify {escape(str(directory))}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("ms", justify="right")
    table.add_column("detail", overflow="fold")
    ran = {r.name: r for r in report.results}
    not_run = dict(_not_run(settings, report))
    for name in CHECK_NAMES:
        if name in ran:
            r = ran[name]
            table.add_row(name, _STYLE[r.status], f"{r.duration_ms:.1f}", escape(_summary(r)))
        elif name in not_run:
            table.add_row(name, _STYLE["skipped"], "", not_run[name])
    console.print(table)
    if report.ok:
        digest = report.digest or "not computed (the crc32c check did not run)"
        console.print(
            f"[green]verified[/]: digest {digest}, {report.total_bytes} bytes, {report.tensor_count} tensors"
        )
    else:
        word = "deferred" if report.deferred else "rejected"
        console.print(f"[{'yellow' if report.deferred else 'red'}]{word}[/]: {escape(report.reason or '')}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"hotswap verify: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.directory.is_dir():
        print(f"hotswap verify: {args.directory}: not a directory", file=sys.stderr)
        return EXIT_USAGE

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    steps = [n for n in CHECK_NAMES if n in settings.enabled]
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} checks"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=args.no_progress,
        transient=True,
    )
    with progress:
        task = progress.add_task(f"checking {steps[0] if steps else ''}", total=len(steps))

        def on_result(result: CheckResult) -> None:
            done = steps.index(result.name) + 1
            following = steps[done] if done < len(steps) else "done"
            progress.update(task, completed=done, description=f"checking {following}")

        report = run_checks(args.directory, settings, reference=args.reference, on_result=on_result)

    if args.json:
        print(json.dumps(_report_json(args.directory, report, settings), indent=2, default=str))
    else:
        _print_table(args.directory, report, settings)
    if report.ok:
        return EXIT_OK
    return EXIT_DEFERRED if report.deferred else EXIT_REJECTED


if __name__ == "__main__":
    raise SystemExit(main())
