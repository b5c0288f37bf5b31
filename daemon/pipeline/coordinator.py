"""The coordinator: follows each checkpoint through the pipeline, one named step at a time.

    discover  (sources: a committed checkpoint arrives via `intake`)
    register  -> `discovered` row (fast, in the caller's thread: detection latency stays low)
    fetch     -> `fetching` -> a local directory, when it was registered without one (its source
                 downloads or receives it); failures reject it, or re-queue it when they pass
    verify    -> `verifying` -> `verified` | `rejected` | `deferred` | `duplicate`, one `checks` row per check
    then      `on_verified(checkpoint_id)`: stage and roll out (daemon.rollout.service.submit)

Fetch and verify run on one worker thread fed by a queue, oldest first. Every status change
is committed (with an `events` row, through daemon.registry.status) before the next step
starts, so a daemon killed at any point resumes on start: `resume_unfinished()` re-queues
checkpoints left in `discovered`/`fetching`/`verifying`. A version is registered once: the
`version` column is unique and re-discovery of a known version is a no-op.

`observers` are told of each status the coordinator commits (after the commit); production
registers none, a test entry point uses them to hold the daemon mid-verify.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from sqlalchemy.orm import Session
from structlog.stdlib import BoundLogger

from daemon.checks import CHECK_PROCESS, CheckResult, CheckSettings, VerifyReport, VerifyStager, run_checks
from daemon.common import DaemonMetrics, bind_version, get_logger
from daemon.pipeline import deltas, rediscovery
from daemon.pipeline.deferrals import MemoryDeferrals
from daemon.pipeline.kinds import record_kind
from daemon.pipeline.warmup import warm_up
from daemon.registry import UNFINISHED, CheckpointStatus, Registry, hosts, status, unreachable
from daemon.registry import queries as q
from daemon.sources import DiscoveredCheckpoint, FetchError, FetchItem, Source

log = get_logger(__name__)
DB_RETRY_S = 5.0
C = CheckpointStatus
PROGRESS_LOG_S = 5.0  # a fetch logs its progress at most this often

StatusObserver = Callable[[int, CheckpointStatus], None]
OnVerified = Callable[[int], None]


class Coordinator:
    def __init__(
        self,
        registry: Registry,
        check_settings: CheckSettings,
        metrics: DaemonMetrics | None = None,
        *,
        sources: Mapping[str, Source] | None = None,
        on_verified: OnVerified | None = None,
        observers: Iterable[StatusObserver] = (),
    ) -> None:
        self.registry = registry
        self.check_settings = check_settings
        self.metrics = metrics or DaemonMetrics()
        self.sources: dict[str, Source] = dict(sources or {})  # by label, for the fetch step
        self.on_verified = on_verified  # the step after verify (stage + roll out); None: verify only
        self.observers = list(observers)
        self.memory_deferrals = MemoryDeferrals()  # out of memory defers a version, a few times in a row
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._warming = threading.Event()
        self._retries: set[threading.Timer] = set()
        self._retries_lock = threading.Lock()
        # Run first on the coordinator's thread (e.g. importing torch for the forward check):
        # importing transformers from two threads at once can fail, so the checks never
        # race a background import.
        self.warmup: Callable[[], None] | None = None
        self._heartbeat: Callable[[], object] | None = None  # systemd's watchdog ping
        # (version, device) -> where the crc32c pass stages the weights (ipc: the loader), or None
        self.verify_stager: Callable[[str, str], VerifyStager | None] | None = None
        self._heartbeat_s = 0.0
        self.delta_dir = Path("deltas")  # where delta checkpoints are rebuilt (the service: <state_dir>/deltas)
        self.recycle_rebuilt = True  # a rebuild may overwrite a stale rebuilt version's files (daemon.pipeline.deltas)

    # -- plumbing -------------------------------------------------------------------------

    def start(self) -> None:
        self.resume_unfinished()
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        with self._retries_lock:
            for timer in self._retries:
                timer.cancel()
            self._retries.clear()
        self._queue.put(None)
        if self._thread is not None:  # never waits for the warm-up (daemon.pipeline.warmup)
            self._thread.join(0.2 if self.warming() else timeout)

    def warming(self) -> bool:
        """The warm-up (the forward check's imports) is still running."""
        return self._warming.is_set()

    def set_heartbeat(self, beat: Callable[[], object], interval_s: float) -> None:
        """Call `beat` from this loop at least every `interval_s` while it is not stuck in a step."""
        self._heartbeat, self._heartbeat_s = beat, interval_s
        # a check in the check process is bounded by its limit: the loop waiting on it pings on
        CHECK_PROCESS.beat, CHECK_PROCESS.beat_s = beat, interval_s

    def idle(self) -> bool:
        """Nothing queued and nothing being verified (for tests and benchmarks)."""
        return self._queue.unfinished_tasks == 0

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        if self.warmup is not None:
            warm_up(self.warmup, self._heartbeat, self._heartbeat_s, self._warming)
            if self._stopping.is_set():
                return
        while True:
            if self._heartbeat is not None:
                self._heartbeat()
            try:
                checkpoint_id = self._queue.get(timeout=self._heartbeat_s or None)
            except queue.Empty:
                continue
            try:
                if checkpoint_id is None or self._stopping.is_set():
                    return
                self.process(checkpoint_id)
            except Exception as exc:
                if checkpoint_id is not None and unreachable(exc):
                    # the registry is down, read-only or full: the checkpoint is not lost, it is
                    # processed again (from the status it has) once the database takes writes
                    log.warning("processing a checkpoint waits for the database", checkpoint_id=checkpoint_id,
                                error=" ".join(str(exc).split())[:300], retry_s=DB_RETRY_S)  # fmt: skip
                    self._retry_later(checkpoint_id, DB_RETRY_S)
                else:
                    log.exception("processing a checkpoint failed", checkpoint_id=checkpoint_id)
            finally:
                self._queue.task_done()

    def _moved(self, checkpoint_id: int, to: CheckpointStatus) -> None:
        for observer in self.observers:
            observer(checkpoint_id, to)

    def _retry_later(self, checkpoint_id: int, delay_s: float) -> None:
        def fire() -> None:
            with self._retries_lock:
                self._retries.discard(timer)
            if not self._stopping.is_set():
                self._queue.put(checkpoint_id)

        timer = threading.Timer(delay_s, fire)
        timer.daemon = True
        with self._retries_lock:
            self._retries.add(timer)
        timer.start()

    # -- step: discover -> register -----------------------------------------------------

    def intake(self, item: DiscoveredCheckpoint) -> int | None:
        """Called by sources: register the checkpoint and queue it for verification.

        Returns the checkpoint id to verify (new, or a known one to look at again), else None.
        """
        ckpt_id = self.register(item)
        if ckpt_id is not None:
            self._queue.put(ckpt_id)
        return ckpt_id

    def register(self, item: DiscoveredCheckpoint) -> int | None:
        vlog = bind_version(log, item.version, source=item.source)
        fp = rediscovery.fingerprint(item.directory)
        with self.registry.session() as s:
            ckpt = status.create(
                s,
                version=item.version,
                source=item.source,
                uri=item.uri,
                local_path=str(item.directory) if item.directory is not None else None,
                commit_signal=item.signal,
                discovered_at=item.detected_at,
                detail={"fingerprint": fp} if fp else None,
            )
            ckpt_id = ckpt.id if ckpt is not None else None
            again = None
            if ckpt is None and (known := q.get_checkpoint(s, item.version)) is not None:
                known_id = known.id
                if item.directory is not None and hosts.local_path(s, known.id) is None:
                    # registered by another host of the fleet: this host's copy of the same version
                    hosts.record_copy(s, known, str(item.directory), fp)
                    vlog.info("known to the fleet; this host's copy recorded", directory=str(item.directory))
                    return None
                again = rediscovery.handle(s, known, item)
        if ckpt_id is None:
            if again is None or again.outcome == "unchanged":
                vlog.info("already registered; ignored", uri=item.uri)
                return None
            if again.outcome == "reverify":
                vlog.info("looking again", uri=item.uri, reason=again.message)
                self._moved(known_id, C.DISCOVERED)
                return known_id  # intake queues it
            vlog.warning("version label already registered" if again.outcome == "conflict" else "changed after verify",
                         uri=item.uri, reason=again.message)  # fmt: skip
            return None
        latency_ms = (time.monotonic() - item.detected_monotonic) * 1000.0
        self.metrics.discovered(item.signal)
        vlog.info("discovered", uri=item.uri, signal=item.signal, register_ms=round(latency_ms, 2))
        return ckpt_id

    def resume_unfinished(self) -> list[str]:
        """Queue checkpoints a previous run left in `discovered`/`fetching`/`verifying`."""
        with self.registry.session() as s:
            pending = [(c.id, c.version, c.status) for c in q.unfinished_checkpoints(s)]
        for ckpt_id, version, st in pending:
            bind_version(log, version).info("resuming unfinished checkpoint", status=st)
            self._queue.put(ckpt_id)
        return [v for _, v, _ in pending]

    def retry_deferred(self) -> list[str]:
        """Re-queue `deferred` checkpoints whose headroom check now passes (memory freed).

        Only the headroom check runs here (cheap: headers + one memory reading); a
        checkpoint that passes it goes back to `discovered` and through every check again.
        """
        with self.registry.session() as s:
            deferred = [(c.id, c.version, c.local_path) for c in q.checkpoints_with_status(s, C.DEFERRED)]
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
                if ckpt is None or ckpt.status != C.DEFERRED:
                    continue
                status.move(s, ckpt, C.DISCOVERED, "retrying: headroom is available again")
            self._moved(ckpt_id, C.DISCOVERED)
            bind_version(log, version).info("deferred checkpoint re-queued: headroom available")
            self._queue.put(ckpt_id)
            requeued.append(version)
        return requeued

    def reverify(self, version: str, why: str = "re-verification requested by an operator") -> str:
        """Send a settled version back through every check (`hotswap reverify`). Returns its
        status before; raises LookupError (unknown) or ValueError (serving, or being verified)."""
        with self.registry.session() as s:
            ckpt_id, was = rediscovery.request_reverify(s, version, why)
        self._moved(ckpt_id, C.DISCOVERED)
        bind_version(log, version).info("reverify requested", was=was)
        self._queue.put(ckpt_id)
        return was

    # -- the pipeline, one checkpoint --------------------------------------------------------

    def process(self, checkpoint_id: int) -> None:
        """fetch -> rebuild (a delta) -> verify -> on_verified."""
        if not self.fetch(checkpoint_id) or not self.rebuild(checkpoint_id):
            return
        if self.verify(checkpoint_id) and self.on_verified is not None:
            self.on_verified(checkpoint_id)

    # -- step: fetch -----------------------------------------------------------------------

    def fetch(self, checkpoint_id: int) -> bool:
        """Make sure the checkpoint has a local directory. True when verification may go on.

        A checkpoint registered with its directory (a local folder, a finished push) has nothing
        to fetch; otherwise its source fetches it, under the `fetching` status.
        """
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            if ckpt is None or ckpt.status not in UNFINISHED:
                return False
            if ckpt.local_path or ckpt.status == C.VERIFYING:
                return True
            item = FetchItem(ckpt.id, ckpt.version, ckpt.uri)
            label = ckpt.source
            status.move(s, ckpt, C.FETCHING, f"fetching from {label}")
        self._moved(checkpoint_id, C.FETCHING)
        vlog = bind_version(log, item.version, source=label)
        source = self.sources.get(label)
        if source is None:
            return self._fetch_failed(checkpoint_id, FetchError(f"its source {label!r} is not configured"), vlog)
        vlog.info("fetching", uri=item.uri)
        t0 = last = time.monotonic()

        def progress(done: int, total: int | None) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= PROGRESS_LOG_S:
                last = now
                vlog.info("fetch progress", bytes=done, of=total, seconds=round(now - t0, 1))

        try:
            directory = source.fetch(item, progress)
        except FetchError as exc:
            return self._fetch_failed(checkpoint_id, exc, vlog)
        except Exception as exc:  # a bug or an OS fault in a source still ends the step with the cause
            return self._fetch_failed(checkpoint_id, FetchError(f"{type(exc).__name__}: {exc}"), vlog)
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            if ckpt is None:
                return False
            ckpt.local_path = str(directory)
        vlog.info("fetched", directory=str(directory), seconds=round(time.monotonic() - t0, 2))
        return True

    def _fetch_failed(self, checkpoint_id: int, exc: FetchError, vlog: BoundLogger) -> bool:
        retry = exc.retry_after_s
        to = C.DISCOVERED if retry is not None else C.REJECTED
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            if ckpt is None:
                return False
            message = f"fetch failed: {exc.reason}" + (f"; trying again in {retry:g} s" if retry is not None else "")
            if ckpt.status == to:
                status.note(s, ckpt, message)
            else:
                status.move(s, ckpt, to, message)
        self._moved(checkpoint_id, to)
        vlog.warning("fetch failed", reason=exc.reason, retry_s=retry)
        if retry is not None:
            self._retry_later(checkpoint_id, retry)
        return False

    def rebuild(self, checkpoint_id: int) -> bool:
        """A delta checkpoint: rebuilt from its base (daemon.pipeline.deltas); True when verify may go on."""
        go_on, version, err = deltas.run_step(self.registry, checkpoint_id, self.delta_dir, self.metrics.fetched,
                                              self.check_settings, self.recycle_rebuilt)
        return go_on if err is None else self._fetch_failed(checkpoint_id, err, bind_version(log, version))

    # -- step: verify --------------------------------------------------------------------

    def verify(self, checkpoint_id: int) -> bool:
        """Run the checks; True when the checkpoint is `verified` (and not a duplicate)."""
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            if ckpt is None or ckpt.status not in UNFINISHED:
                return False
            q.clear_checks(s, ckpt.id)  # an interrupted earlier attempt starts over
            status.move(s, ckpt, C.VERIFYING)
            version, directory = ckpt.version, Path(ckpt.local_path or "")
            reference = self._reference_dir(s)
        self._moved(checkpoint_id, C.VERIFYING)
        vlog = bind_version(log, version)
        vlog.info("verifying", directory=str(directory), reference=str(reference) if reference else None)

        t0 = time.perf_counter()
        stager = self.verify_stager(version, self.check_settings.forward_device) if self.verify_stager else None
        report = self._run_checks(checkpoint_id, directory, reference, vlog, stager)
        duration_ms = (time.perf_counter() - t0) * 1000.0
        self.metrics.verified(report, duration_ms)
        outcome = self._record_outcome(checkpoint_id, report, duration_ms, vlog)
        self._moved(checkpoint_id, outcome)
        return outcome == C.VERIFIED

    def _run_checks(
        self,
        checkpoint_id: int,
        directory: Path,
        reference: Path | None,
        vlog: BoundLogger,
        stager: VerifyStager | None = None,
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

        return run_checks(directory, self.check_settings, reference=reference, on_result=on_result, stager=stager)

    def _record_outcome(
        self, checkpoint_id: int, report: VerifyReport, duration_ms: float, vlog: BoundLogger
    ) -> CheckpointStatus:
        with self.registry.session() as s:
            ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
            assert ckpt is not None
            ckpt.digest = report.digest
            record_kind(ckpt, report)
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
                failed, reason = self.memory_deferrals.verdict(checkpoint_id, report)
                status.move(s, ckpt, failed, reason, duration_ms=duration_ms)
                vlog.warning(failed.value, reason=reason, ms=round(duration_ms, 1))
                return failed
            self.memory_deferrals.forget(checkpoint_id)
            same = q.find_same_digest(s, report.digest, ckpt.id) if report.digest else None
            if same is not None:
                status.move(
                    s,
                    ckpt,
                    C.DUPLICATE,
                    f"same content (digest {report.digest}) as {same.version}",
                    duration_ms=duration_ms,
                )
                vlog.info("duplicate", of=same.version, digest=report.digest)
                return C.DUPLICATE
            status.move(s, ckpt, C.VERIFIED, None, duration_ms=duration_ms)
            vlog.info("verified", digest=report.digest, bytes=report.total_bytes, ms=round(duration_ms, 1))
            return C.VERIFIED

    def _reference_dir(self, s: Session) -> Path | None:
        """The serving version's directory, for the compat and forward checks."""
        alias = hosts.alias_row(s, "serving")
        path = hosts.local_path(s, alias.checkpoint_id) if alias is not None else None  # this host's copy
        if not path or not Path(path).is_dir():
            return None
        return Path(path)

