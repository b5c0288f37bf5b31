"""The daemon process: one build function wires the pipeline, `Daemon` starts and stops it in order.

    build_daemon(config) -> Daemon, read top to bottom as the pipeline:
        discover   sources ([[sources]], by type from daemon.sources) -> coordinator.intake
        register   -> fetch -> verify      the coordinator (daemon.pipeline.coordinator)
        stage      -> roll out -> watch     the rollout service (daemon.rollout), when [[workers]] exist
        plus the scheduler's periodic jobs and the HTTP API (daemon.api.app)

`run_daemon` first runs `daemon.process.preflight` (API port free, token and key files usable, required
source folders present: one line and exit 2, before anything is created or launched).
`Daemon.start()`: migrate the database, then start each part in that order (the rollout
service first: it makes the seed and recovers a killed daemon's rollout before checkpoints
flow), then write `<state_dir>/daemon.json` (pid and API URL, for the CLI and tests) and tell
systemd READY=1. The state directory is made (or tightened, with a warning) 0700 before anything
is written in it, and every file the daemon creates there is 0600 (daemon.common.private). Each started part pushes its stop onto a stack; `Daemon.stop()` pops it:
every thread and job stops in reverse order, and is waited for. SIGTERM/SIGINT stop it cleanly.

`Observers` are the daemon's test seam: callbacks after each recorded worker transition and
checkpoint status. Production passes none; tests/hooked_daemon.py passes some.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler

from daemon.api import (
    ApiServer,
    ApiState,
    RegistryCollector,
    RolloutMetrics,
    broadcast_router,
    create_app,
    fleet_router,
    readiness_router,
    reverify,
    rollout_router,
    version_bytes,
    whoami_router,
)
from daemon.checks import CHECK_PROCESS, FORWARD_IMPORTS
from daemon.common import (
    ControlGuard,
    DaemonMetrics,
    Problem,
    StateDirLock,
    TokenFileError,
    build_guard,
    configure_logging,
    get_logger,
    private_dir,
    systemd,
    write_private,
)
from daemon.config import Config, ConfigError
from daemon.controller import PollCollector, RolloutService
from daemon.fleet import fetch_here
from daemon.pipeline import Coordinator, StatusObserver, deltas
from daemon.process import (
    HealthMonitor,
    ProblemCollector,
    Reloadable,
    ReloadResult,
    port_error,
    reload_config,
    run_preflight,
)
from daemon.registry import Registry, redact_url, retention
from daemon.registry import queries as q
from daemon.rollout import TransitionObserver
from daemon.sources import Source, build_source
from daemon.webhooks import start_webhooks

# What the forward check imports on first use (~3 s on a laptop CPU).
_FORWARD_MODULES = (
    "torch",
    "safetensors.torch",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "daemon.checks.forward",
)

log = get_logger(__name__)


@dataclass
class Observers:
    transitions: list[TransitionObserver] = field(default_factory=list)  # worker state machine moves
    statuses: list[StatusObserver] = field(default_factory=list)  # checkpoint statuses the coordinator commits


@dataclass
class Daemon:
    config: Config
    registry: Registry
    metrics: DaemonMetrics
    scheduler: BackgroundScheduler
    coordinator: Coordinator
    sources: list[Source]
    rollout: RolloutService | None
    api: ApiServer | None = None
    guard: ControlGuard | None = None  # the control token check (start() makes it): for every state-changing route
    stop_event: threading.Event = field(default_factory=threading.Event)
    reload_event: threading.Event = field(default_factory=threading.Event)  # SIGHUP
    ready_event: threading.Event = field(default_factory=threading.Event)  # between READY=1 and STOPPING=1
    api_state: ApiState | None = None
    health: HealthMonitor | None = None  # every problem, from every probe (daemon.process.health)
    state_lock: StateDirLock | None = None  # taken by run_daemon before anything else, else by start()
    _stops: list[tuple[str, Callable[[], None]]] = field(default_factory=list)

    @property
    def runtime_file(self) -> Path:
        return self.config.runtime_file

    def start(self) -> None:
        cfg = self.config
        was = private_dir(cfg.state_dir)  # 0700: the registry, tokens and logs are in it
        if was is not None:
            log.warning("state directory was open to other users; tightened to 0700", path=str(cfg.state_dir),
                        mode=f"{was:04o}")  # fmt: skip
        if self.state_lock is None:  # before anything touches the state: a second daemon here exits 2
            self.state_lock = StateDirLock(cfg.state_dir)
            self.state_lock.acquire()
        self._started("state lock", self.state_lock.release)
        try:
            self.guard = build_guard(cfg.state_dir, cfg.api.tokens, hosts=cfg.api.allowed_hosts)
        except TokenFileError as exc:
            raise ConfigError(str(exc)) from None
        log.info("starting", config=cfg.source_file, database=redact_url(cfg.database_url), pid=os.getpid())
        self.registry.upgrade()
        self._started("registry", self.registry.close)
        self.metrics.track_statuses(self._status_counts)
        self.metrics.registry.register(RegistryCollector(self.registry))
        if cfg.webhooks:  # before anything records an event: each webhook event gets its outbox row
            self._started("webhooks", start_webhooks(self.registry, cfg.webhooks, self.metrics.registry).stop)
        if "forward" in cfg.checks.enabled:
            self.coordinator.warmup = _preload_forward_check
        self._started("check process", CHECK_PROCESS.stop)  # started by the first check (or the warm-up)
        if self.rollout is not None:  # stage -> roll out -> watch
            rollout = self.rollout
            self.rollout.start(self.scheduler)
            self.metrics.registry.register(PollCollector(rollout.poller))
            # managed workers keep serving across a daemon restart (adopted on the next start)
            keep = cfg.daemon.keep_workers_on_stop
            self._started("rollout", lambda: rollout.stop(stop_managed=not keep))
        interval = cfg.daemon.watchdog_interval_s or systemd.watchdog_interval_s()
        if interval:
            # pinged from the coordinator's own loop: a stuck pipeline stops the pings and
            # systemd restarts the daemon (a scheduler thread would ping on regardless)
            self.coordinator.set_heartbeat(self._watchdog_ping, interval)
        self.coordinator.start()  # register -> fetch -> verify
        self._started("coordinator", self.coordinator.stop)
        self.scheduler.start()
        self._started("scheduler", lambda: self.scheduler.shutdown(wait=True))
        for source in self.sources:  # discover
            source.start()
            self._started(f"source {source.label}", source.stop)
        agent = self.rollout.fleet_agent if self.rollout is not None else None  # fleet mode: host_behind
        self.health = HealthMonitor(self.registry, lambda: self.sources, self.rollout,
                                    extra=[agent.problems] if agent is not None else [],
                                    state_dir=self.config.state_dir)  # watch
        self.metrics.registry.register(ProblemCollector(self.health))
        self.scheduler.add_job(self.health.tick, "interval", seconds=self.health.interval_s, id="health",
                               max_instances=1, coalesce=True, next_run_time=datetime.now(UTC))  # fmt: skip
        self._add_jobs()
        listen = cfg.daemon.listen_host_port
        if listen is not None:
            try:
                self.api = ApiServer(self._app(), *listen, cfg.api.tls_certfile, cfg.api.tls_keyfile)
            except OSError as exc:  # taken since the preflight looked
                raise ConfigError(port_error(cfg.source_file, cfg.daemon.listen, exc)) from None
            self.api.start()
            self._started("api", self.api.stop)
        self._write_runtime_file()
        self._started("runtime file", lambda: self.runtime_file.unlink(missing_ok=True))
        systemd.ready(f"watching {len(self.sources)} source(s)")
        self.ready_event.set()
        log.info("ready", api=self.api.url if self.api else None, sources=[s.label for s in self.sources])
        if self.rollout is None:
            log.warning("verify only: no [[workers]] in the config, so checkpoints are verified and recorded but "
                        "rolled out nowhere (add a [[workers]] table, or run without -c for the managed worker)",
                        config=cfg.source_file)  # fmt: skip

    def stop(self) -> None:
        """Stop everything `start` started, newest first, waiting for each."""
        self.ready_event.clear()
        systemd.stopping()
        log.info("stopping")
        while self._stops:
            name, stop = self._stops.pop()
            try:
                stop()
            except Exception:
                log.exception("stopping failed", part=name)
        log.info("stopped")

    def _watchdog_ping(self) -> None:
        # only between READY=1 and STOPPING=1, as systemd reads them: the warm-up's pings
        # (daemon.pipeline.warmup) can begin before the daemon is ready and outlast its stop
        if self.ready_event.is_set():
            systemd.watchdog_ping()

    def _started(self, name: str, stop: Callable[[], None]) -> None:
        self._stops.append((name, stop))

    def _add_jobs(self) -> None:
        cfg = self.config
        # a checkpoint deferred for lack of memory is retried once its headroom check passes
        self.scheduler.add_job(self.coordinator.retry_deferred, "interval", seconds=cfg.checks.deferred_retry_s,
                               id="retry-deferred", max_instances=1, coalesce=True)  # fmt: skip
        # directories a source created (a download cache) may go; serving, last good, pinned never
        self.scheduler.add_job(self.prune, "interval", seconds=cfg.daemon.retention_interval_s, id="retention",
                               max_instances=1, coalesce=True)  # fmt: skip
        if cfg.database.retention_days > 0:  # old events and checks rows (daemon.registry.retention)
            self.scheduler.add_job(self.prune_history, "interval", seconds=cfg.database.retention_interval_s,
                                   id="history-retention", max_instances=1, coalesce=True)  # fmt: skip

    def _app(self) -> Any:
        assert self.guard is not None  # start() made it
        state = ApiState(self.registry, self.metrics, sources=[s.describe() for s in self.sources],
                         describe_sources=lambda: [s.describe() for s in self.sources],
                         queue_depth=self.coordinator.queue_depth, problems=self.health_problems,
                         guard=self.guard, webhooks=self.config.webhooks,
                         window=self.rollout.window if self.rollout is not None else None)  # fmt: skip
        self.api_state = state
        app = create_app(state)
        app.include_router(reverify.router(self.coordinator, self.guard))
        app.include_router(whoami_router(self.guard))
        if self.config.fleet.enabled:  # fleet target, rollout pause/resume/abort under token roles
            app.include_router(fleet_router(self.registry, self.guard, self.config.fleet.signing_key))
        if self.rollout is not None:
            app.include_router(rollout_router(self.rollout, self.guard))
            app.include_router(broadcast_router(self.rollout, self.config.state_dir, self.guard,
                                               self.config.checks))  # trainer broadcast
            app.include_router(readiness_router(self.rollout))  # GET /ready, /v1/workers/{name}/ready
        return app

    def reload(self) -> ReloadResult:
        """SIGHUP: apply the config file's changes that can be applied while running (daemon.process.reload)."""
        def on_sources(sources: list[Source]) -> None:
            if self.api_state is not None:
                self.api_state.sources[:] = [s.describe() for s in sources]

        result = reload_config(Reloadable(self.config, self.coordinator, self.scheduler, self.sources,
                                          self.rollout.settings if self.rollout else None, on_sources))  # fmt: skip
        systemd.status("config reload refused: " + result.error if result.error else "config reloaded")
        return result

    def health_problems(self) -> list[Problem]:
        """What is wrong now (daemon.process.health); nothing before the monitor exists."""
        return self.health.check() if self.health is not None else []

    def prune(self) -> list[Path]:
        """The retention hook: let each source delete directories it created, except protected ones."""
        protected = self.protected_paths()
        removed: list[Path] = []
        for source in self.sources:
            try:
                removed += source.prune(protected)
            except Exception:
                log.exception("pruning failed", source=source.label)
        try:  # versions rebuilt from deltas (state_dir/deltas) that nothing needs any more
            with self.registry.session() as s:
                stale = deltas.stale_rebuilt(s, self.coordinator.delta_dir, protected)
        except Exception:
            log.exception("pruning rebuilt versions failed")
            stale = []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        if removed:
            log.info("pruned", directories=[str(p) for p in removed])
        return removed

    def prune_history(self) -> retention.Pruned | None:
        """The registry's retention job: events and checks rows older than `[database] retention_days`."""
        try:
            done = retention.prune(self.registry, self.config.database.retention_days)
        except Exception:  # the database blinked: the next turn tries again
            log.exception("pruning the registry history failed")
            return None
        if done.events or done.checks:
            log.info("pruned registry history", events=done.events, checks=done.checks,
                     older_than_days=self.config.database.retention_days)  # fmt: skip
        return done

    def protected_paths(self) -> frozenset[Path]:
        """Serving, last good and pinned, every checkpoint still on its way to a worker, and the bases
        that fetched delta checkpoints are to be rebuilt from."""
        with self.registry.session() as s:  # this host's copies (checkpoint_locations); recycling keeps them too
            return deltas.protected_paths(s, self.coordinator.delta_dir)

    def _status_counts(self) -> dict[str, int]:
        with self.registry.session() as s:
            return q.status_counts(s)

    def _write_runtime_file(self) -> None:
        doc: dict[str, Any] = {
            "pid": os.getpid(),
            "api_url": self.api.url if self.api else None,
            "database": redact_url(self.config.database_url),
            "config": self.config.source_file,
            "started_at": time.time(),
            "verify_only": self.rollout is None,  # no [[workers]]: checkpoints are verified, never rolled out
        }
        write_private(self.runtime_file, (json.dumps(doc) + "\n").encode())


def build_daemon(config: Config, observers: Observers | None = None) -> Daemon:
    """Every part of the daemon, constructed in pipeline order; nothing runs until `start()`."""
    seen = observers or Observers()
    registry = Registry(config.database_url, config.fleet.host or None)
    metrics = DaemonMetrics()
    scheduler = BackgroundScheduler(daemon=True)
    # register -> fetch -> verify: the coordinator (its queue is what the sources feed)
    coordinator = Coordinator(registry, config.checks, metrics, observers=seen.statuses)
    coordinator.delta_dir = config.state_dir / "deltas"  # delta checkpoints rebuilt into full versions
    coordinator.recycle_rebuilt = config.daemon.recycle_rebuilt  # over a stale rebuilt version's files
    # discover: one source per [[sources]] entry, by its type
    sources = [build_source(c, coordinator.intake, scheduler) for c in config.sources]
    coordinator.sources = {s.label: s for s in sources}  # the fetch step asks a checkpoint's source
    # stage -> roll out -> watch: only with [[workers]]; without, the daemon only verifies
    # pause windows, update times and bytes per transport, observed as workers move
    observe = RolloutMetrics(metrics.registry, lambda: config.rollout.transport, version_bytes(registry))
    transitions: list[TransitionObserver] = [*seen.transitions, observe]
    rollout = RolloutService.from_config(config, registry, transitions) if config.workers else None
    if rollout is not None:
        coordinator.on_verified = rollout.submit
        coordinator.verify_stager = rollout.stager.verify_stager  # ipc: verify reads into the loader
        if rollout.fleet_agent is not None:  # fleet mode: a version registered elsewhere is fetched here
            rollout.fleet_agent.fetch = lambda cid: fetch_here(
                registry, coordinator.sources, cid,
                lambda i, d, c: deltas.rebuild_copy(registry, i, d, coordinator.delta_dir, c,
                                                    coordinator.recycle_rebuilt), 0, metrics.fetched)  # fmt: skip
            rollout.fleet_agent.doing = lambda: rollout.state.current_job or (None if rollout.wait_ready(0) else "start-up")
    return Daemon(config, registry, metrics, scheduler, coordinator, sources, rollout)


def _preload_forward_check() -> None:
    # torch + transformers take seconds to import: load them on the coordinator's thread as
    # soon as it starts, so the first checkpoint's forward check does not pay for it (while
    # registration, on the source threads, is never held up).
    # The canary itself runs in the check process (daemon.checks.isolation): it imports the same.
    t0 = time.perf_counter()
    try:
        CHECK_PROCESS.start(FORWARD_IMPORTS)
        for module in _FORWARD_MODULES:
            importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the forward check itself reports it
        log.warning("preloading the forward check failed", error=str(exc))
        return
    log.debug("forward check preloaded", seconds=round(time.perf_counter() - t0, 2))


def run_daemon(config: Config, observers: Observers | None = None) -> int:
    lock = StateDirLock(config.state_dir)
    lock.check_free()  # a second daemon on this state dir: one line naming the holder (before its busy port)
    run_preflight(config)  # port, token and key files, required sources: one line, exit 2, nothing started
    lock.acquire()
    configure_logging(config.daemon.log_level)
    d = build_daemon(config, observers)
    d.state_lock = lock
    signal.signal(signal.SIGTERM, lambda *_: d.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: d.stop_event.set())
    signal.signal(signal.SIGHUP, lambda *_: d.reload_event.set())
    try:
        d.start()
    except BaseException:
        d.stop()
        raise
    try:
        while not d.stop_event.wait(0.5):
            if d.reload_event.is_set():
                d.reload_event.clear()
                d.reload()
    finally:
        d.stop()
    if d.coordinator.warming():
        log.info("stopped during the warm-up (not waited for)")
    return 0


def exit_now(code: int) -> None:
    """End the process at once, after a daemon stopped: everything is stopped and recorded, and
    the interpreter's own teardown (torch's native state, a warm-up thread still inside `import
    torch`) would take seconds more (`hotswap daemon` stops in under 3 s: bench/RESULTS.md)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
