"""The coordinator: follows each checkpoint through the pipeline, one named step at a time.

    discover  (sources: a committed directory arrives via `intake`)
    register  -> `discovered` row (fast, in the caller's thread: detection latency stays low)
    verify    -> `verifying` -> `verified` | `rejected` | `deferred` | `duplicate`, one `checks` row per check
    [stage -> roll out]  later steps plug in through `after_verify` (see `PostVerifyStep`)

Verification runs on one worker thread fed by a queue, oldest first. Every status
change is committed (with an `events` row) before the next step starts, so a
daemon killed at any point resumes on start: `resume_unfinished()` re-queues
checkpoints left in `discovered`/`verifying`. A version is registered once:
the `version` column is unique and re-discovery of a known version is a no-op.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sqlalchemy.orm import Session
from structlog.stdlib import BoundLogger

from daemon.checks import CheckResult, CheckSettings, VerifyReport, run_checks
from daemon.logging import bind_version, get_logger
from daemon.metrics import DaemonMetrics
from daemon.registry import Registry
from daemon.registry import queries as q
from daemon.registry.models import Alias, Checkpoint
from daemon.sources.commit import DiscoveredCheckpoint

# Test-only: seconds the verify step sleeps after marking a checkpoint `verifying`,
# so a test can SIGKILL the daemon mid-verify deterministically. Never set in production.
TEST_VERIFY_DELAY_ENV = "HOTSWAP_TEST_VERIFY_DELAY_S"

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class VerifiedCheckpoint:
    """What later steps (stage, roll out) get: a checkpoint that passed every check."""

    checkpoint_id: int
    version: str
    directory: Path
    digest: str | None
    total_bytes: int
    tensor_count: int


class PostVerifyStep(Protocol):
    """A step after verify (the rollout package adds "stage" and "roll out").

    Called on the coordinator's thread, in order; exceptions are logged and stop the
    remaining steps for that checkpoint (its status is whatever the step last wrote).
    """

    name: str

    def __call__(self, ckpt: VerifiedCheckpoint) -> None: ...


@dataclass
class _NamedStep:
    name: str
    fn: Callable[[VerifiedCheckpoint], None]

    def __call__(self, ckpt: VerifiedCheckpoint) -> None:
        self.fn(ckpt)


class Coordinator:
    def __init__(
        self,
        registry: Registry,
        check_settings: CheckSettings,
        metrics: DaemonMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.check_settings = check_settings
        self.metrics = metrics or DaemonMetrics()
        self.after_verify: list[PostVerifyStep] = []
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.test_verify_delay_s = float(os.environ.get(TEST_VERIFY_DELAY_ENV, "0") or 0)
        # Run first on the coordinator's thread (e.g. importing torch for the forward check):
        # importing transformers from two threads at once can fail, so the checks never
        # race a background import.
        self.warmup: Callable[[], None] | None = None

    # -- plumbing -------------------------------------------------------------------------

    def add_step(self, name: str, fn: Callable[[VerifiedCheckpoint], None]) -> None:
        """Append a post-verify step (e.g. `add_step("stage", stager.stage)`)."""
        self.after_verify.append(_NamedStep(name, fn))

    def start(self) -> None:
        self.resume_unfinished()
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def idle(self) -> bool:
        """Nothing queued and nothing being verified (for tests and benchmarks)."""
        return self._queue.unfinished_tasks == 0

    def _run(self) -> None:
        if self.warmup is not None:
            try:
                self.warmup()
            except Exception:
                log.exception("warm-up failed")
        while True:
            checkpoint_id = self._queue.get()
            try:
                if checkpoint_id is None or self._stopping.is_set():
                    return
                self.process(checkpoint_id)
            except Exception:
                log.exception("processing a checkpoint failed", checkpoint_id=checkpoint_id)
            finally:
                self._queue.task_done()

    # -- step: discover -> register -----------------------------------------------------

    def intake(self, item: DiscoveredCheckpoint) -> int | None:
        """Called by sources: register the checkpoint and queue it for verification.

        Returns the new checkpoint id, or None when the version is already known.
        """
        ckpt_id = self.register(item)
        if ckpt_id is not None:
            self._queue.put(ckpt_id)
        return ckpt_id

    def register(self, item: DiscoveredCheckpoint) -> int | None:
        vlog = bind_version(log, item.version, source=item.source)
        with self.registry.session() as s:
            ckpt = q.register_discovered(
                s,
                version=item.version,
                source=item.source,
                uri=item.uri,
                local_path=str(item.directory),
                commit_signal=item.signal,
                discovered_at=item.detected_at,
            )
            ckpt_id = ckpt.id if ckpt is not None else None
        if ckpt_id is None:
            vlog.info("already registered; ignored", directory=str(item.directory))
            return None
        latency_ms = (time.monotonic() - item.detected_monotonic) * 1000.0
        self.metrics.discovered(item.signal)
        vlog.info(
            "discovered", directory=str(item.directory), signal=item.signal, register_ms=round(latency_ms, 2)
        )
        return ckpt_id

    def resume_unfinished(self) -> list[str]:
        """Queue checkpoints a previous run left in `discovered`/`verifying`."""
        with self.registry.session() as s:
            pending = [(c.id, c.version, c.status) for c in q.unfinished_checkpoints(s)]
        for ckpt_id, version, status in pending:
            bind_version(log, version).info("resuming unfinished checkpoint", status=status)
            self._queue.put(ckpt_id)
        return [v for _, v, _ in pending]

    def retry_deferred(self) -> list[str]:
        """Re-queue `deferred` checkpoints whose headroom check now passes (memory freed).

        Only the headroom check runs here (cheap: headers + one memory reading); a
        checkpoint that passes it goes back to `discovered` and through every check again.
        """
        with self.registry.session() as s:
            deferred = [(c.id, c.version, c.local_path) for c in q.checkpoints_with_status(s, "deferred")]
        if not deferred:
            return []
        probe = dataclasses.replace(self.check_settings, enabled=("headroom",))
        requeued: list[str] = []
        for ckpt_id, version, local_path in deferred:
            report = run_checks(Path(local_path or ""), probe)
            if not report.ok:
                continue
            with self.registry.session() as s:
                ckpt = q.get_checkpoint_by_id(s, ckpt_id)
                if ckpt is None or ckpt.status != "deferred":
                    continue
                q.set_status(s, ckpt, "discovered", "retrying: headroom is available again")
            bind_version(log, version).info("deferred checkpoint re-queued: headroom available")
            self._queue.put(ckpt_id)
            requeued.append(version)
        return requeued

    # -- step: verify --------------------------------------------------------------------

    def process(self, checkpoint_id: int) -> None:
        verified = self.verify(checkpoint_id)
        if verified is not None:
            self.deliver(verified)

    def verify(self, checkpoint_id: int) -> VerifiedCheckpoint | None:
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            if ckpt is None or ckpt.status not in q.UNFINISHED_STATUSES:
                return None
            q.clear_checks(s, ckpt.id)  # an interrupted earlier attempt starts over
            q.set_status(s, ckpt, "verifying")
            version, directory = ckpt.version, Path(ckpt.local_path or "")
            reference = self._reference_dir(s)
        vlog = bind_version(log, version)
        vlog.info("verifying", directory=str(directory), reference=str(reference) if reference else None)
        if self.test_verify_delay_s > 0:
            time.sleep(self.test_verify_delay_s)

        t0 = time.perf_counter()
        report = self._run_checks(checkpoint_id, directory, reference, vlog)
        duration_ms = (time.perf_counter() - t0) * 1000.0
        self.metrics.verified(report, duration_ms)
        return self._record_outcome(checkpoint_id, directory, report, duration_ms, vlog)

    def _run_checks(
        self, checkpoint_id: int, directory: Path, reference: Path | None, vlog: BoundLogger
    ) -> VerifyReport:
        def on_result(result: CheckResult) -> None:
            with self.registry.session() as s:
                q.add_check(
                    s,
                    checkpoint_id,
                    name=result.name,
                    ok=result.ok,
                    detail=result.detail,
                    started_at=result.started_at,
                    duration_ms=result.duration_ms,
                    deferred=result.deferred,
                    status=result.status,
                )
            vlog.info(
                "check",
                check=result.name,
                ok=result.ok,
                ms=round(result.duration_ms, 2),
                reason=result.detail.get("reason"),
            )

        return run_checks(directory, self.check_settings, reference=reference, on_result=on_result)

    def _record_outcome(
        self, checkpoint_id: int, directory: Path, report: VerifyReport, duration_ms: float, vlog: BoundLogger
    ) -> VerifiedCheckpoint | None:
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            assert ckpt is not None
            ckpt.digest = report.digest
            ckpt.total_bytes = report.total_bytes or None
            ckpt.tensor_count = report.tensor_count or None
            if report.manifest is not None:
                ckpt.step = report.manifest.step
                ckpt.parent = report.manifest.parent
            if report.files:
                q.replace_files(
                    s,
                    ckpt,
                    [(f.path, f.bytes, f.crc32c or None) for f in report.files],
                    hashes={f.path: (f.hash_alg, f.hash) for f in report.files if f.hash and f.hash_alg},
                )
            if not report.ok:
                status = "deferred" if report.deferred else "rejected"
                q.set_status(s, ckpt, status, report.reason, duration_ms=duration_ms)
                vlog.warning(status, reason=report.reason, ms=round(duration_ms, 1))
                return None
            same = q.find_same_digest(s, report.digest, ckpt.id) if report.digest else None
            if same is not None:
                q.set_status(
                    s,
                    ckpt,
                    "duplicate",
                    f"same content (digest {report.digest}) as {same.version}",
                    duration_ms=duration_ms,
                )
                vlog.info("duplicate", of=same.version, digest=report.digest)
                return None
            q.set_status(s, ckpt, "verified", None, duration_ms=duration_ms)
            vlog.info("verified", digest=report.digest, bytes=report.total_bytes, ms=round(duration_ms, 1))
            return VerifiedCheckpoint(
                ckpt.id, ckpt.version, directory, report.digest, report.total_bytes, report.tensor_count
            )

    def _reference_dir(self, s: Session) -> Path | None:
        """The serving version's directory, for the compat and forward checks."""
        alias = s.get(Alias, "serving")
        if alias is None:
            return None
        ref: Checkpoint | None = s.get(Checkpoint, alias.checkpoint_id)
        if ref is None or not ref.local_path or not Path(ref.local_path).is_dir():
            return None
        return Path(ref.local_path)

    # -- steps after verify: stage -> roll out (plugged in by the rollout package) --------

    def deliver(self, ckpt: VerifiedCheckpoint) -> None:
        for step in self.after_verify:
            slog = bind_version(log, ckpt.version, step=step.name)
            try:
                step(ckpt)
            except Exception:
                slog.exception("step failed; later steps skipped")
                return
