"""`type = "local"`: a watched folder; every direct subdirectory of it is a checkpoint.

Filesystem events (watchdog: inotify on Linux) mark a checkpoint directory dirty;
one checker thread asks the `CommitDetector` about dirty directories shortly
after (coalescing bursts of writes into one look) and re-asks while a quiet
period runs. A periodic rescan (APScheduler) marks every not-yet-emitted
directory dirty as the safety net for missed events (overflowed inotify queues,
NFS, a folder that did not exist at start). Names starting with "." are ignored
so writers can build `.tmp-step-100/` and rename it into place.

An emitted directory is looked at again when its files change (size or mtime of any file,
compared with what was emitted): it is emitted again, and the coordinator decides (a
rejected checkpoint is verified again; a change under a known label is recorded). A
checkpoint directory that is, or holds, a symlink leading outside the watched folder is
refused (logged once with the link named) and never emitted, as is one whose version label (its
manifest's `version`, else the directory's name) cannot be a label (daemon.formats.names: a
newline, a control character, a slash, ...); both are shown under `refused` in /status.
"""

from __future__ import annotations

import heapq
import threading
import time
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit
from urllib.request import url2pathname

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import BaseScheduler
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from daemon.common import get_logger
from daemon.manifest import version_problem
from daemon.sources.base import Emit, FetchError, FetchItem, Progress, SourceType
from daemon.sources.commit import CommitDetector, Snapshot, commit_order, discovered, escapes, snapshot
from daemon.sources.settings import LocalSourceConfig

SETTLE_S = 0.05  # a directory that changed during its check is looked at again this much later
EMIT_RETRY_S = 1.0  # after a failed hand-over (database unreachable), look again this much later
COALESCE_S = 0.02  # how long after an event the directory is looked at (bursts become one look)

log = get_logger(__name__)


class _Handler(FileSystemEventHandler):
    def __init__(self, source: LocalSource) -> None:
        self.source = source

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        for raw in (event.src_path, getattr(event, "dest_path", "")):
            if raw:
                self.source.touch_path(Path(raw if isinstance(raw, str) else raw.decode()))


class LocalSource:
    """Watches one folder; calls `emit` once per committed checkpoint directory (a `Source`).

    Its checkpoints are local from the start, so `fetch` only confirms the directory, and
    `prune` never deletes anything: the folder belongs to the user.
    """

    config_type: ClassVar[type[LocalSourceConfig]] = LocalSourceConfig

    def __init__(self, config: LocalSourceConfig, emit: Emit, scheduler: BaseScheduler | None = None) -> None:
        self.config = config
        self.root = Path(config.path).expanduser().absolute()
        self.label = config.label
        self.emit = emit
        self.detector = CommitDetector(config.commit_signals, config.quiet_period_s, config.marker_names,
                                       commit_timeout_s=config.commit_timeout_s)  # fmt: skip
        self._scheduler = scheduler
        self._own_scheduler = scheduler is None
        self._observer: BaseObserver | None = None
        self._emitted: dict[Path, Snapshot] = {}  # what each emitted directory held when emitted
        self._refused: dict[Path, str] = {}  # symlinks out of the folder: reason, logged once
        self._due: list[tuple[float, str]] = []  # heap of (monotonic due time, directory name)
        self._scheduled: dict[str, float] = {}
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._missing_logged = False
        self._looks: dict[str, int] = {}  # directory name -> checks finished (what "nothing happened" waits on)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self.config.create:
            self.root.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name=f"source-{self.root.name}", daemon=True)
        self._thread.start()
        self._start_observer()
        if self._scheduler is None:
            self._scheduler = BackgroundScheduler(daemon=True)
        self._scheduler.add_job(
            self.rescan,
            "interval",
            seconds=self.config.rescan_interval_s,
            id=f"rescan:{self.root}",
            max_instances=1,
            coalesce=True,
            replace_existing=True,
        )
        if self._own_scheduler:
            self._scheduler.start()
        self.rescan()
        log.info(
            "source started",
            source=self.label,
            path=str(self.root),
            signals=self.config.commit_signals,
            rescan_s=self.config.rescan_interval_s,
        )

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
        if self._own_scheduler and self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.label, "path": str(self.root), "type": self.config.type}
        if self._refused:  # symlinks out of the folder, with the reason (also logged once)
            out["refused"] = {p.name: why for p, why in sorted(self._refused.items())}
        return out

    def health_problem(self) -> str | None:
        """Why this source cannot see new checkpoints right now (the daemon's /health), or None."""
        if self.root.is_dir():
            return None
        what = "is not a directory" if self.root.exists() else "does not exist"
        return f"watched folder {self.root} {what}"

    def fetch(self, item: FetchItem, progress: Progress) -> Path:
        """Nothing to fetch: the checkpoint was registered with its directory in the folder."""
        parts = urlsplit(item.uri)
        directory = Path(url2pathname(parts.path)) if parts.scheme == "file" else None
        if directory is None or not directory.is_dir():
            raise FetchError(f"{item.uri}: the checkpoint directory is gone from {self.root}")
        return directory

    def prune(self, protected: frozenset[Path]) -> list[Path]:
        return []  # the watched folder is the user's: the daemon deletes nothing in it

    def _start_observer(self) -> None:
        if self._observer is not None or not self.root.is_dir():
            return  # the rescan retries once the folder exists
        observer = Observer()
        observer.schedule(_Handler(self), str(self.root), recursive=True)
        observer.daemon = True
        observer.start()
        self._observer = observer

    # -- events ---------------------------------------------------------------------------

    def touch_path(self, path: Path) -> None:
        """A filesystem event at `path`: mark its checkpoint directory dirty."""
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            return
        if not rel.parts:
            return
        if len(rel.parts) == 1 and not path.exists() and not path.is_symlink():
            self._emitted.pop(path, None)  # removed: a new directory of that name is a new checkpoint
            self._refused.pop(path, None)
        self.mark_dirty(rel.parts[0], COALESCE_S)

    def mark_dirty(self, name: str, delay_s: float = 0.0) -> None:
        if name.startswith(".") or self._stop.is_set():
            return
        due = time.monotonic() + delay_s
        with self._cv:
            current = self._scheduled.get(name)
            if current is not None and current <= due:
                return
            self._scheduled[name] = due
            heapq.heappush(self._due, (due, name))
            self._cv.notify()

    def rescan(self) -> None:
        """The safety net: look at every directory (an emitted one only costs a stat per file)."""
        if not self.root.is_dir():
            if not self._missing_logged:  # once, not every rescan: /health keeps saying it
                log.warning("watched folder missing", source=self.label, path=str(self.root))
                self._missing_logged = True
            return
        if self._missing_logged:
            log.info("watched folder is back", source=self.label, path=str(self.root))
            self._missing_logged = False
            if self._observer is not None:  # it watched the folder that went away: watch the new one
                self._observer.stop()
                self._observer = None
        self._start_observer()
        try:
            names = commit_order(self.root)
        except OSError as exc:
            log.warning("cannot list watched folder", source=self.label, path=str(self.root), error=str(exc))
            return
        for i, name in enumerate(names):  # looked at (and registered) in the order they were committed
            self.mark_dirty(name, i * 1e-6)  # distinct due times: the heap breaks ties by name

    # -- checker thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                while not self._stop.is_set():
                    now = time.monotonic()
                    while self._due and self._scheduled.get(self._due[0][1]) != self._due[0][0]:
                        heapq.heappop(self._due)  # superseded entry
                    if self._due and self._due[0][0] <= now:
                        _, name = heapq.heappop(self._due)
                        del self._scheduled[name]
                        break
                    self._cv.wait(timeout=(self._due[0][0] - now) if self._due else None)
                else:
                    return
            try:
                self._look(name)
            finally:
                with self._cv:
                    self._looks[name] = self._looks.get(name, 0) + 1

    def looks(self, name: str) -> int:
        """How many checks of directory `name` have finished (emitted or not): a caller that must
        show nothing was emitted waits for the next check instead of sleeping."""
        with self._cv:
            return self._looks.get(name, 0)

    def _look(self, name: str) -> None:
        directory = self.root / name
        try:
            now = snapshot(directory)
            if self._emitted.get(directory) == now:
                return  # emitted, and nothing changed since
            why = escapes(directory, self.root)
            if why is not None:
                self._refuse(directory, why)
                return
            decision = self.detector.check(directory)
        except Exception:  # a broken directory must not stop the source
            log.exception("commit check failed", source=self.label, directory=str(directory))
            return
        if decision.committed and snapshot(directory) != now:
            # its files changed while it was checked (a manifest renamed in mid-look): what was
            # checked is not what `now` describes, and emitting it would emit it again at the
            # next look; look once more when it holds still
            self.mark_dirty(name, SETTLE_S)
            return
        if decision.committed and (why := version_problem(decision.version)) is not None:
            self._refuse(directory, f"{name!r}: its version label cannot be used: {why}")
            return  # looked at again when its files change (a fixed manifest)
        self._refused.pop(directory, None)
        if decision.committed:
            again = directory in self._emitted
            self._emitted[directory] = now
            item = discovered(self.label, directory, decision)
            log.debug(
                "committed",
                source=self.label,
                directory=str(directory),
                signal=decision.signal,
                version=decision.version,
                again=again,
            )
            try:
                self.emit(item)
            except Exception:
                # Not recorded (e.g. the database is down): try again shortly.
                self._emitted.pop(directory, None)
                log.exception("recording a discovered checkpoint failed; retrying", version=item.version,
                              retry_s=EMIT_RETRY_S)
                self.mark_dirty(name, EMIT_RETRY_S)
            return
        if decision.reason:
            log.debug("not committed yet", directory=str(directory), reason=decision.reason)
        if decision.recheck_after_s is not None:
            self.mark_dirty(name, decision.recheck_after_s)

    def _refuse(self, directory: Path, why: str) -> None:
        """Never emitted; logged once per reason; shown by `describe`."""
        if self._refused.get(directory) != why:
            self._refused[directory] = why
            log.warning("checkpoint refused", source=self.label, directory=str(directory), reason=why)


# What daemon.sources.SOURCE_TYPES["local"] names; mypy checks it against the protocol.
_TYPE: SourceType = LocalSource
