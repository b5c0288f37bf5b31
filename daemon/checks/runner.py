"""The verify stage: run the enabled checks in order, stop at the first failure.

With the checks isolated (the default), the forward canary runs in the check process while
finite scans here; the results are still reported in order and end at the first failure."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from daemon.checks.base import (
    CHECK_NAMES,
    REQUIRES,
    CheckContext,
    CheckFailed,
    CheckResult,
    CheckSettings,
    CheckSkipped,
    VerifyReport,
    VerifyStager,
    deferred_for_memory,
    memory_short,
)
from daemon.checks.isolation import CHECK_PROCESS, ISOLATED
from daemon.checks.lookup import resolve
from daemon.formats import is_adapter
from daemon.manifest import ManifestFile


def run_checks(
    directory: Path,
    settings: CheckSettings,
    *,
    reference: Path | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    recorded: Iterable[Any] | None = None,
    stager: VerifyStager | None = None,
) -> VerifyReport:
    """Run every enabled check on `directory`; `reference` is the serving version's directory.

    Each result goes to `on_result` as soon as it is known (the coordinator writes a
    `checks` row). A failing check stops the run: the report is not ok, and `deferred`
    says whether to retry later (headroom) rather than reject.

    `recorded`: the file digests an earlier verify recorded for this version (anything with
    path, bytes, crc32c, hash_alg, hash, e.g. its `checkpoint_files` rows), for a re-verify:
    the file list and bytes must still match them, with or without a manifest.

    `stager`: the crc32c pass stages the weights there (the ipc loader) instead of in this
    process; told the outcome at the end (export the version, or drop it).
    """
    ctx = CheckContext(Path(directory), settings, Path(reference) if reference else settings.reference_dir)
    rows = [ManifestFile(r.path, r.bytes, r.crc32c or "", r.hash or "", r.hash_alg) for r in recorded or ()]
    ctx.recorded = rows or None  # nothing recorded (e.g. crc32c was off then): nothing to hold it to
    ctx.stager = None if stager is None or (settings.stage_device == "off" and stager.holds_bytes) else stager
    if settings.isolate_checks and "forward" in settings.enabled:  # its view opened while the loader reads
        ctx.premap = CHECK_PROCESS.premap
    results: list[CheckResult] = []
    failure: CheckResult | None = None
    completed = False
    try:
        failure = _run_all(ctx, settings, results, on_result)
        completed = True
    finally:
        if ctx.staged is not None:  # pass or fail, this process's view of the copy goes
            ctx.staged.release()
            ctx.staged = None
        if ctx.stager is not None:  # the loader's copy: exported only if every check passed
            ctx.stager.finish(completed and failure is None and ctx.hashed, list(ctx.files), ctx.digest)
    return VerifyReport(
        ok=failure is None,
        deferred=failure is not None and failure.deferred,
        results=results,
        reason=None if failure is None else f"{failure.name}: {failure.detail['reason']}",
        digest=ctx.digest,
        total_bytes=ctx.total_bytes,
        tensor_count=len(ctx.table) if ctx.table is not None else 0,
        files=list(ctx.files),
        manifest=ctx.manifest,
    )


def _run_one(name: str, adapter: bool, ctx: CheckContext, settings: CheckSettings) -> dict[str, Any]:
    """A check whose cost follows the input runs in the check process, under its time limit
    (daemon.checks.isolation); the others here."""
    if settings.isolate_checks and name in ISOLATED:
        return CHECK_PROCESS.run(name, adapter, ctx, settings.check_time_limit_s)
    if settings.isolate_checks and ctx.table is None and name in ("finite", "headroom"):
        # they read the header table: with headers and compat off (or headroom alone, as the
        # deferred retry runs it), the parse happens there too, bounded; the table comes back
        CHECK_PROCESS.run("headers", adapter, ctx, settings.check_time_limit_s)
    return resolve(name, adapter)(ctx)


def _attempt(name: str, adapter: bool, ctx: CheckContext, settings: CheckSettings, passed: set[str]) -> CheckResult:
    """Run one check; its result, whatever it raised."""
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    deferred = skipped = False
    try:
        missing = [n for n in REQUIRES.get(name, ()) if n not in passed]
        if missing:  # settings refuse this; a caller that changed `enabled` later still gets no pass
            raise CheckFailed(f"needs the {missing[0]!r} check, which did not run")
        detail = _run_one(name, adapter, ctx, settings)
        ok = True
    except CheckSkipped as exc:
        detail = {"skipped": exc.reason, **exc.detail}
        ok, skipped = True, True
    except CheckFailed as exc:
        detail = {"reason": exc.reason, **exc.detail}
        ok, deferred = False, exc.deferred
    except Exception as exc:  # a bug or an OS fault in a check must still reject, with the cause
        if memory_short(exc):  # but not a host or GPU short of memory: that defers
            failed = deferred_for_memory(name, exc)
            detail, deferred = {"reason": failed.reason, **failed.detail}, True
        else:
            detail = {"reason": f"{name} check crashed: {type(exc).__name__}: {exc}", "internal_error": True}
        ok = False
    return CheckResult(name, ok, detail, started, (time.perf_counter() - t0) * 1000.0, deferred, skipped)


OVERLAPPED = ("finite", "headroom", "forward")  # the forward runs beside finite (see _overlapped)


def _overlaps(settings: CheckSettings) -> bool:
    return settings.isolate_checks and "forward" in ISOLATED and {"finite", "forward"} <= set(settings.enabled)


def _overlapped(adapter: bool, ctx: CheckContext, settings: CheckSettings, passed: set[str]) -> list[CheckResult]:
    """finite, headroom, forward, with the forward canary (in the check process) running while
    finite scans in this one: on a GPU each is a few tens of ms of a different resource (issue 41).

    The outcome is what running them in order gives: the results come in that order and end at
    the first failure, and a forward whose result would not have been reached is not reported.
    Headroom is decided first, since the forward must not build a model on a host it says is
    short of memory: when it fails, the forward does not start. The forward is always waited
    for before this returns, so the staged copy it reads is released only after it."""
    headroom = _attempt("headroom", adapter, ctx, settings, passed) if "headroom" in settings.enabled else None
    with ThreadPoolExecutor(1, thread_name_prefix="forward-check") as pool:
        # its own context: the check process writes back the header table, which finite reads
        forward = None
        if headroom is None or headroom.ok:
            forward = pool.submit(_attempt, "forward", adapter, copy.copy(ctx), settings, passed)
        finite = _attempt("finite", adapter, ctx, settings, passed)
        done = forward.result() if forward is not None else None  # waited for even when finite failed
    if not finite.ok:
        return [finite]
    return [r for r in (finite, headroom, done) if r is not None]


def _run_all(
    ctx: CheckContext,
    settings: CheckSettings,
    results: list[CheckResult],
    on_result: Callable[[CheckResult], None] | None,
) -> CheckResult | None:
    passed: set[str] = set()
    adapter = is_adapter(ctx.directory)
    overlap = _overlaps(settings)
    for name in CHECK_NAMES:
        if name not in settings.enabled or (overlap and name in OVERLAPPED[1:]):
            continue
        if overlap and name == OVERLAPPED[0]:
            found: Iterable[CheckResult] = _overlapped(adapter, ctx, settings, passed)
        else:
            found = (_attempt(name, adapter, ctx, settings, passed),)
        for result in found:
            if result.ok and not result.skipped:
                passed.add(result.name)
            results.append(result)
            if on_result is not None:
                on_result(result)
            if not result.ok:
                return result
    return None
