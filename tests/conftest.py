"""Shared fixtures and helpers for hotswap tests (owned by the foundation; reuse freely).

Databases
    `db_url`      parametrized: "sqlite" (a file in tmp_path) always, and "postgres" when
                  $HOTSWAP_TEST_POSTGRES_URL is set (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test).
                  Each postgres test gets a FRESH database `hotswap_t_<random>` created on that server
                  and dropped afterwards. When the variable is set and the server is unreachable the
                  test FAILS (it never silently skips).
    `registry`    a migrated `daemon.registry.Registry` on `db_url`.

Running the real daemon
    `daemon_factory` fixture -> `start(**config) -> DaemonProcess`. It writes a config TOML in
    a tmp dir (state_dir, [database] url, one [[sources]] on a watch folder, listen on port 0),
    starts `python -m daemon.cli daemon -c <file>` as a subprocess and waits until it wrote
    `<state_dir>/daemon.json` (pid + API URL). All started daemons are killed at teardown.

        d = daemon_factory(db_url)                       # watch folder: d.watch_dir
        d = daemon_factory(db_url, sources=[{"path": str(p), "quiet_period_s": 0.5}],
                           checks={"enabled": ["manifest", "headers", "crc32c"]},
                           env={"HOTSWAP_TEST_VERIFY_DELAY_S": "5"}, hooked=True)
        d.wait_status("step-1", "verified")              # polls version_history; returns the row
        d.history()                                      # version_history rows (dicts), oldest first
        d.get("/status").json()                          # httpx call to the daemon's API
        d.kill() / d.stop(); d.restart(); d.log()        # SIGKILL / SIGTERM; same config again
        d = daemon_factory(db_url, wait=False); d.launch(); ...; d.wait_started()   # start several at once

    `hooked=True` starts it from tests/hooked_daemon.py instead (the same daemon, with the test
    observers its HOTSWAP_TEST_* environment variables ask for; production reads none of them).

    `make_config_file(path, **sections)` writes a TOML file from dicts (used by the factory).
    `wait_until(fn, timeout, interval, what)` polls until fn() is truthy, returns its value.
    `hotswap_cli(*args, cwd=..., env=...)` runs `python -m daemon.cli ARGS` and returns the
    CompletedProcess (text mode).
    `publish_tiny(dir, seed, version=None, shards=1)` makes a tiny Llama checkpoint + manifest.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from support_wait import free_port, free_ports, wait_until  # noqa: F401 - the one copy, re-exported

REPO = Path(__file__).resolve().parents[1]
POSTGRES_ENV = "HOTSWAP_TEST_POSTGRES_URL"
BACKENDS = ["sqlite"] + (["postgres"] if os.environ.get(POSTGRES_ENV) else [])

T = TypeVar("T")


# --------------------------------------------------------------------------- parallel runs

# Under pytest-xdist (`./scripts/test.sh` runs the suite with `-n`), every test module is one unit of
# work (its module-scoped fixtures start once, in one worker process), and modules that must share a
# process share a unit: the real vLLM tests reuse one server per process (support_vllm), and two
# vLLM servers at once would each starve on a 2-core machine.
# The fleet modules that run several real daemons and workers each go one after another in one
# unit too: two of them at once put a dozen busy processes on two cores.
# The vLLM unit runs alone, after every other unit: while a CPU vLLM server serves (its engine core and
# worker poll each other), the whole 2-core machine stalled for minutes in CI rehearsals (load average
# 24-31, a 15 s RCU stall in dmesg, a top sampler stuck 5 minutes), and the daemon tests running beside
# it missed their 90 s and 300 s waits; outside that window the load average was 4-6.
ALONE = frozenset({"vllm"})
XDIST_GROUPS = {"test_vllm_api.py": "vllm", "test_vllm_daemon.py": "vllm", "test_adapters_vllm.py": "vllm",
                "test_vllm_engine_death.py": "vllm",
                "test_fleet_daemons.py": "fleet-daemons", "test_fleet_converge_daemons.py": "fleet-daemons",
                "test_fleet_stages_daemons.py": "fleet-daemons", "test_fleet_late_joiner_s3.py": "fleet-daemons",
                "test_fleet_fingerprints_daemons.py": "fleet-daemons",
                "test_fleet_trust_daemons.py": "fleet-daemons"}
# The longest units go first, so no worker is left with a long one at the end (measured with
# `--durations=0`: the duration table in tests/README.md).
LONGEST_FIRST = ("test_rollout_faults.py", "test_rollout_e2e.py", "test_daemon_e2e.py",
                 "test_supervise_daemon.py", "test_ops_daemon.py", "test_migration_lock.py",
                 "fleet-daemons", "test_sglang_daemon.py", "test_worker_identity.py",
                 "test_broadcast.py", "test_restart_rollout.py", "test_adapters_daemon.py")  # fmt: skip

# The quick tier (`./scripts/test.sh -m quick`, CONTRIBUTING.md) is declared by its modules
# (`pytestmark = pytest.mark.quick`): pure logic, fakes, files and single short-lived processes.


def _unit(nodeid: str) -> str:
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return XDIST_GROUPS.get(name, name)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # a scheduler of our own rather than `--dist loadgroup`, whose xdist_group marks pytest 9.2
    # no longer carries into the node ids xdist schedules by
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            for scope in [s for s in self.workqueue if s in ALONE]:  # every other unit first
                self.workqueue.move_to_end(scope)
            if next(iter(self.workqueue)) not in ALONE:
                super()._assign_work_unit(node)
                return
            # Only the alone unit is left. A worker runs its last test only once it is given more
            # work or told to shut down, so: every worker but one shuts down, and the last one
            # takes the unit once the others have finished (remove_node below asks it again).
            others = [n for n in self.assigned_work if n is not node]
            if any(not n.shutting_down for n in others):
                node.shutdown()
            elif not others:
                super()._assign_work_unit(node)

        def remove_node(self, node: Any) -> str | None:
            crashed = super().remove_node(node)
            if self.workqueue and not crashed:  # a worker finished: the one left may take the alone unit
                for other in self.assigned_work:
                    self._reschedule(other)
            return crashed

    return ModuleUnits(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        u = _unit(item.nodeid)
        return LONGEST_FIRST.index(u) if u in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a module's tests keep their order and stay together


# --------------------------------------------------------------------------- helper threads


class ThreadErrors:
    """Exceptions raised in threads while a test runs (threading.excepthook). pytest alone only
    warns about them, so an assert inside a poller thread would leave the test green."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        self._previous = threading.excepthook

    def hook(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            with self._lock:
                self.errors.append((args.thread.name if args.thread else "?", args.exc_value))
        self._previous(args)

    def check(self) -> None:
        """Raise the first exception a thread raised (naming how many there were)."""
        with self._lock:
            errors = list(self.errors)
        if errors:
            name, exc = errors[0]
            raise AssertionError(f"{len(errors)} exception(s) in helper threads; the first, in {name}: "
                                 f"{type(exc).__name__}: {exc}") from exc  # fmt: skip


@pytest.fixture
def thread_errors() -> Iterator[ThreadErrors]:
    """Ask for it in a test that starts threads: an exception in any of them fails the test (after
    its body ran, in `pytest_runtest_call`), with the thread's name and traceback."""
    collector = ThreadErrors()
    threading.excepthook = collector.hook
    try:
        yield collector
    finally:
        threading.excepthook = collector._previous


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    result = yield
    collector = getattr(item, "funcargs", {}).get("thread_errors")
    if isinstance(collector, ThreadErrors):
        collector.check()
    return result


# --------------------------------------------------------------------------- skips under CI

# CI (`.ci/run` sets HOTSWAP_CI=1) lists every skip at the end (-rs) and fails the run on any skip
# but these: CI has no GPU. A behaviour under test is never skipped for being hard to observe.
EXPECTED_CI_SKIPS = ("needs a CUDA device",)
_unexpected_skips: list[str] = []


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.skipped or not os.environ.get("HOTSWAP_CI") or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if not any(expected in reason for expected in EXPECTED_CI_SKIPS):
        _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _unexpected_skips:
        terminalreporter.section("skips CI does not allow (tests/conftest.py EXPECTED_CI_SKIPS)", red=True)
        for line in _unexpected_skips:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexpected_skips and not hasattr(session.config, "workerinput") and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --------------------------------------------------------------------------- databases


def _postgres_database(server_url: str) -> Iterator[str]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    name = f"hotswap_t_{secrets.token_hex(6)}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # unreachable server with the variable set: fail, never skip
        admin.dispose()
        pytest.fail(f"{POSTGRES_ENV}={server_url} is set but PostgreSQL is not usable: {exc}", pytrace=False)
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database, for what runs on PostgreSQL only (fleet mode); the modules
    using it skip without POSTGRES_ENV."""
    yield from _postgres_database(os.environ[POSTGRES_ENV])


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'registry.db'}"
    else:
        yield from _postgres_database(os.environ[POSTGRES_ENV])


@pytest.fixture
def registry(db_url: str) -> Iterator[Any]:
    from daemon.registry import Registry

    reg = Registry(db_url)
    reg.upgrade()
    yield reg
    reg.close()


# --------------------------------------------------------------------------- helpers


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def make_config_file(path: Path, **sections: Any) -> Path:
    """Write TOML: a dict value is a [table], a list of dicts is an [[array of tables]]."""
    lines: list[str] = []
    for name, body in sections.items():
        if body is None:
            continue
        tables = body if isinstance(body, list) else [body]
        for table in tables:
            lines.append(f"[[{name}]]" if isinstance(body, list) else f"[{name}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
            lines.append("")
    path.write_text("\n".join(lines))
    return path


def hotswap_cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "HOTSWAP_CONFIG"}
    full_env.update({"PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.main", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def publish_tiny(directory: Path, seed: int = 0, version: str | None = None, shards: int = 1) -> Any:
    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    make_tiny_checkpoint(directory, seed=seed, shards=shards)
    return publish(directory, version=version)


# --------------------------------------------------------------------------- the real daemon


class DaemonProcess:
    def __init__(
        self,
        workdir: Path,
        config_path: Path,
        db_url: str,
        watch_dir: Path,
        state_dir: Path,
        env: dict[str, str],
        hooked: bool = False,
    ) -> None:
        self.hooked = hooked
        self.module = "daemon.cli.main"  # the CLI module `python -m` runs (a previous release: daemon.cli)
        self.workdir = workdir
        self.config_path = config_path
        self.db_url = db_url
        self.watch_dir = watch_dir
        self.state_dir = state_dir
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.api_url: str | None = None
        self._log_path = workdir / "daemon.log"
        self._registry: Any = None

    def start(self, timeout: float = 90.0) -> DaemonProcess:
        self.launch()
        return self.wait_started(timeout)

    def launch(self) -> None:
        """Start the process and return at once (`wait_started` waits for its daemon.json)."""
        (self.state_dir / "daemon.json").unlink(missing_ok=True)
        log = open(self._log_path, "ab")  # noqa: SIM115 - lives as long as the process
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("HOTSWAP_CONFIG", None)
        entry = "tests.hooked_daemon" if self.hooked else self.module
        self.proc = subprocess.Popen(
            [sys.executable, "-m", entry, "daemon", "-c", str(self.config_path)],
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def wait_started(self, timeout: float = 90.0) -> DaemonProcess:
        runtime = self.state_dir / "daemon.json"

        def ready() -> dict[str, Any] | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                doc = json.loads(runtime.read_text())
            except (OSError, ValueError):
                return None
            return doc if doc.get("pid") == self.proc.pid else None  # type: ignore[union-attr]

        doc = wait_until(ready, timeout, 0.05, "the daemon to write daemon.json")
        self.api_url = doc["api_url"]
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> DaemonProcess:
        self.stop()
        return self.start()

    def log(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")
        except OSError:
            return ""

    def get(self, path: str, **kw: Any) -> Any:
        import httpx

        assert self.api_url, "the daemon API is off"
        return httpx.get(self.api_url + path, timeout=10, **kw)

    @property
    def registry(self) -> Any:
        if self._registry is None:
            from daemon.registry import Registry

            self._registry = Registry(self.db_url)
        return self._registry

    def history(self) -> list[dict[str, Any]]:
        from daemon.registry import queries as q

        with self.registry.session() as s:
            return q.history(s, newest_first=False)

    def row(self, version: str) -> dict[str, Any] | None:
        return next((r for r in self.history() if r["version"] == version), None)

    def wait_status(
        self, version: str, status: str | tuple[str, ...], timeout: float = 90.0
    ) -> dict[str, Any]:
        wanted = (status,) if isinstance(status, str) else status

        def check() -> dict[str, Any] | None:
            if not self.alive():
                raise AssertionError(f"daemon died:\n{self.log()[-4000:]}")
            r = self.row(version)
            return r if r is not None and r["status"] in wanted else None

        try:
            return wait_until(check, timeout, 0.05, f"{version} to be {'/'.join(wanted)}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; history={self.history()}\nlog:\n{self.log()[-3000:]}") from None

    def close(self) -> None:
        self.kill()
        if self._registry is not None:
            self._registry.close()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(
        db_url: str,
        *,
        sources: list[dict[str, Any]] | None = None,
        checks: dict[str, Any] | None = None,
        daemon: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        wait: bool = True,
        hooked: bool = False,
    ) -> DaemonProcess:
        n = len(started)
        workdir = tmp_path / f"daemon{n}"
        workdir.mkdir()
        watch = workdir / "checkpoints"
        state = workdir / "state"
        cfg = make_config_file(
            workdir / "config.toml",
            daemon={"state_dir": str(state), "listen": "127.0.0.1:0", "log_level": "debug", **(daemon or {})},
            database={"url": db_url},
            sources=sources if sources is not None else [{"path": str(watch), "rescan_interval_s": 5.0}],
            checks=checks,
            **(extra or {}),
        )
        d = DaemonProcess(workdir, cfg, db_url, watch, state, env or {}, hooked)
        started.append(d)
        return d.start() if wait else d

    yield start
    for d in started:
        d.close()


@pytest.fixture
def moto_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A moto S3 server subprocess on loopback (tests/support_s3.py), boto3's credentials in the
    environment: the one moto fixture."""
    from support_s3 import serve_moto

    yield from serve_moto(monkeypatch)
