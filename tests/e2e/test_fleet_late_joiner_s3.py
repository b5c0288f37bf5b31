"""A late joiner with no copy of the fleet target converges by fetching it from S3 (issue 28).

Real PostgreSQL, two real fleet daemons, real reference workers, a real moto S3 server on
loopback and real safetensors checkpoints. Both hosts watch the same bucket prefix through a
`[[sources]]` entry labelled `bucket` (each its own cache dir). host-0 registers, fetches and
deploys v1, then v2; `hotswap fleet target v1` holds the fleet on v1 while the bucket's newest
is v2. host-1 then joins with an empty cache:
- its own listing of the prefix sees v1 and v2 but registers and fetches neither (both are
  known to the fleet: a source's re-discovery of a known S3 version brings no copy);
- its fleet agent finds the target v1 missing on this host and fetches it through its own
  `bucket` source (`daemon.fleet.fetch.fetch_here`), records that as host-1's location and
  converges: its worker serves v1 from host-1's cache dir, and `hotswap status --fleet` shows
  both hosts in sync on v1;
- only the target came down: the bucket's newest (v2) is not in host-1's cache.
Without the fetch-on-behind path host-1 stays on v0 and the test fails waiting for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    POSTGRES_ENV,
    DaemonProcess,
    hotswap_cli,
    make_config_file,
    wait_until,
)
from sqlalchemy import text
from support_fleet_daemons import LEASE_S, aliases_of
from support_rollout import WorkerPool, WorkerProc, build_checkpoint, publish_into, reset_worker
from support_s3 import MotoServer, upload_dir

from daemon.registry import Registry

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")]  # fmt: skip
BUCKET, PREFIX, LABEL = "ckpts", "run/", "bucket"
ON = 180  # seconds a host may take to reach a version (two cores shared: generous)



@pytest.fixture
def pool(tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(tmp_path / "pool", n=2)
    yield p
    p.close()


def s3_host(factory: Callable[..., DaemonProcess], url: str, i: int, w: WorkerProc, moto: MotoServer,
            root: Path) -> DaemonProcess:  # fmt: skip
    """host-i's daemon (not started): its own folder holding v0 (its worker runs it) and the shared
    bucket prefix as `[[sources]]` labelled `bucket`, downloading into `root/host-i/s3cache`."""
    local = root / f"host-{i}" / "local"
    sources = [{"path": str(local), "rescan_interval_s": 5.0},
               {"type": "s3", "bucket": BUCKET, "prefix": PREFIX, "endpoint_url": moto.url, "name": LABEL,
                "poll_interval_s": 0.5, "cache_dir": str(cache_of(root, i))}]  # fmt: skip
    d = factory(url, sources=sources, checks={"enabled": ["manifest", "headers", "crc32c"]}, env=moto.env(),
                wait=False, extra={"rollout": {"mode": "pause", "health_window_s": 0.3, "health_poll_s": 0.5},
                                   "workers": [w.spec()],
                                   "fleet": {"host": f"host-{i}", "enabled": True, "max_updating_hosts": 1,
                                             "lease_s": LEASE_S, "poll_s": 0.5}})  # fmt: skip
    local.mkdir(parents=True)
    reset_worker(w, publish_into(local, "v0", seed=0), "v0")
    w.wait_running(240, version="v0")
    return d


def cache_of(root: Path, i: int) -> Path:
    return root / f"host-{i}" / "s3cache"


def on(url: str, i: int, version: str, d: DaemonProcess) -> None:
    try:
        wait_until(lambda: aliases_of(url, f"host-{i}") == {"serving": version, "last_good": version}, ON, 0.2,
                   f"host-{i} serving {version} (its last_good too)")  # fmt: skip
    except AssertionError as exc:
        own = [json.dumps(e) for e in log_events(d) if str(e.get("logger", "")).startswith("daemon")
               and e.get("level") != "debug"]  # fmt: skip
        raise AssertionError(f"{exc}\nhost-{i}'s last log lines:\n" + "\n".join(own[-25:])) from None


def upload(s3: Any, root: Path, version: str, seed: int) -> Path:
    built = build_checkpoint(root / "upload" / version, version, seed)
    upload_dir(s3, BUCKET, f"{PREFIX}{version}/", built)
    return built


def log_events(d: DaemonProcess) -> list[dict[str, Any]]:
    """The daemon's JSON log lines (its output is a file: structlog writes JSON)."""
    out = []
    for line in d.log().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def location(url: str, version: str, host: str) -> str | None:
    reg = Registry(url, host)
    try:
        with reg.engine.connect() as c:
            found: str | None = c.execute(text(
                "SELECT l.local_path FROM checkpoint_locations l JOIN checkpoints c ON c.id = l.checkpoint_id "
                "WHERE c.version = :v AND l.host = :h"), {"v": version, "h": host}).scalar_one_or_none()  # fmt: skip
            return found
    finally:
        reg.close()


def test_a_late_joiner_fetches_the_held_fleet_target_from_s3_and_converges(
    tmp_path: Path, pg_url: str, pool: WorkerPool, moto_server: MotoServer,
    daemon_factory: Callable[..., DaemonProcess],
) -> None:  # fmt: skip
    s3 = moto_server.client()
    s3.create_bucket(Bucket=BUCKET)
    w = pool.workers
    first = s3_host(daemon_factory, pg_url, 0, w[0], moto_server, tmp_path)
    first.start(timeout=120)
    on(pg_url, 0, "v0", first)
    built: dict[str, Path] = {}
    # host-0 registers each, fetches it into its cache and deploys it
    for version, seed in [("v1", 1), ("v2", 2)]:
        built[version] = upload(s3, tmp_path, version, seed)
        on(pg_url, 0, version, first)
    assert location(pg_url, "v1", "host-0") == str(cache_of(tmp_path, 0) / "v1")

    cfg = make_config_file(tmp_path / "cli.toml", database={"url": pg_url}, fleet={"host": "host-0", "enabled": True},
                           daemon={"state_dir": str(tmp_path / "cli-state")})  # fmt: skip
    held = hotswap_cli("fleet", "target", "v1", "-c", str(cfg))
    assert held.returncode == 0, held.stderr
    on(pg_url, 0, "v1", first)  # the fleet is held on v1; the bucket's newest stays v2

    late = s3_host(daemon_factory, pg_url, 1, w[1], moto_server, tmp_path)
    late_cache = cache_of(tmp_path, 1)
    assert not late_cache.exists() and location(pg_url, "v1", "host-1") is None  # no copy of the target here
    late.start(timeout=120)
    on(pg_url, 1, "v1", late)

    # its listing saw both versions and handed neither on (known to the fleet): no copy came that way
    def ignored() -> set[str]:
        return {str(e.get("version")) for e in log_events(late) if e.get("event") == "already registered; ignored"
                and e.get("source") == LABEL}  # fmt: skip

    wait_until(lambda: {"v1", "v2"} <= ignored(), 30, 0.2, "host-1's listing to pass over v1 and v2")
    events = log_events(late)
    # the fleet agent fetched the target through the `bucket` source and recorded host-1's copy
    fetched = [e for e in events if e.get("event") == "fetched this host's copy"]
    assert [(e.get("version"), e.get("source"), e.get("directory")) for e in fetched] == [
        ("v1", LABEL, str(late_cache / "v1"))], fetched  # fmt: skip
    assert location(pg_url, "v1", "host-1") == str(late_cache / "v1")
    assert not (late_cache / "v2").exists()  # the target came down, not the bucket's newest
    for f in sorted(p for p in built["v1"].iterdir() if p.is_file()):
        assert (late_cache / "v1" / f.name).read_bytes() == f.read_bytes(), f.name

    info = w[1].wait_running(60, version="v1")  # host-1's worker serves v1 from host-1's own cache dir
    assert Path(info["path"]).resolve() == (late_cache / "v1").resolve(), info
    info = w[0].wait_running(60, version="v1")
    assert Path(info["path"]).resolve() == (cache_of(tmp_path, 0) / "v1").resolve(), info

    def fleet() -> dict[str, tuple[str, str, int]] | None:
        out = hotswap_cli("status", "--fleet", "--json", "-c", str(cfg))
        assert out.returncode == 0, out.stderr
        rows = {h["host"]: (h["serving"], h["state"], h["lag"]) for h in json.loads(out.stdout)["hosts"]}
        return rows if all(r[1] == "in sync" for r in rows.values()) else None

    seen = wait_until(fleet, 60, 0.2, "both hosts in sync in status --fleet")
    assert seen == {"host-0": ("v1", "in sync", 0), "host-1": ("v1", "in sync", 0)}, seen
    table = hotswap_cli("status", "--fleet", "-c", str(cfg), env={"COLUMNS": "100"})
    assert table.returncode == 0, table.stderr
    assert "fleet target: v1" in table.stdout and "host-1" in table.stdout, table.stdout
