"""The pause holds only the write (issue 15): the update's source is opened before the pause
(`/admin/prepare`), the post-update probe runs in the worker and comes back with the update's
answer, and what the update opened is let go after resume. Real worker and loader processes."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from support_check import expect_of, flip_byte
from support_ipc import LoaderProcess, shm_dir
from support_worker import WorkerProcess, start_worker, write_token

from daemon.formats.checkpoint import tensor_table
from daemon.tinymodel import make_tiny_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("prep")
    for name, seed in (("v1", 1), ("v2", 2), ("v3", 3)):
        make_tiny_checkpoint(r / name, seed=seed)
    write_token(r)
    return r


@pytest.fixture(scope="module")
def loader(root: Path) -> Iterator[LoaderProcess]:
    with shm_dir() as d:
        lp = LoaderProcess(root / "loader.sock", d)
        for v in ("v2", "v3"):
            lp.client.stage(v, str(root / v))
        yield lp
        lp.stop()


@pytest.fixture(scope="module")
def w(root: Path) -> Iterator[WorkerProcess]:
    wp = start_worker(root / "v1", root / "token", extra=["--version", "v1"])
    yield wp
    wp.stop()


def holders(loader: LoaderProcess) -> dict[str, dict[str, int]]:
    return {v["version"]: v["holders"] for v in loader.client.status()["versions"]}


def events_since(w: WorkerProcess, t: float) -> list[dict[str, Any]]:
    return [e for e in w.info()["events"] if e["at"] >= t]


def test_ipc_handle_opened_before_the_pause_and_released_after_resume(w: WorkerProcess, loader: LoaderProcess) -> None:
    t0 = max((e["at"] for e in w.info()["events"]), default=0.0)
    body = {"version": "v2", "transport": "ipc", "descriptor": loader.client.descriptor("v2"), "mode": "copy"}
    prep = w.admin("/admin/prepare", body)
    assert prep["prepared"] is True and prep["state"] == "RUNNING"
    assert w.info()["prepared_version"] == "v2" and holders(loader)["v2"]  # acquired at the loader already
    w.admin("/admin/pause", {"mode": "keep"})
    up = w.admin("/admin/update", body)
    assert up["version"] == "v2" and up["prepared"] is True  # the update opened nothing itself
    assert holders(loader)["v2"]  # still held: nothing is let go inside the pause
    w.admin("/admin/resume")
    wait_until(lambda: any(e["event"] == "released" for e in events_since(w, t0)), timeout=10, what="released")
    seq = [(e["event"], e["state"]) for e in events_since(w, t0)]
    names = [n for n, _ in seq]
    assert names[:4] == ["prepared", "paused", "updated", "resumed"], seq
    assert seq[0] == ("prepared", "RUNNING") and ("released", "RUNNING") in seq[4:]
    wait_until(lambda: not holders(loader)["v2"], timeout=10, what="v2 released at the loader after resume")
    assert w.info()["prepared_version"] is None


def test_update_answer_carries_the_workers_own_probe_under_the_new_weights(w: WorkerProcess, root: Path) -> None:
    w.admin("/admin/pause", {"mode": "keep"})
    up = w.admin("/admin/update", {"version": "v3", "transport": "disk", "path": str(root / "v3")})
    probe = up["probe"]
    assert probe["weight_version"] == "v3" and probe["finite"] is True and len(probe["token_ids"]) == 1
    assert up["prepared"] is False  # no prepare: opened inside, as before
    w.admin("/admin/resume")
    # the same greedy forward as the probe route, which the daemon used to call while paused
    again = w.admin("/admin/probe", {"max_tokens": 1})
    assert again["token_ids"] == probe["token_ids"] and again["prompt_token_ids"] == probe["prompt_token_ids"]
    w.admin("/admin/pause", {"mode": "keep"})
    back = w.admin("/admin/update", {"version": "v1", "transport": "disk", "path": str(root / "v1")})
    w.admin("/admin/resume")
    assert back["probe"]["weight_version"] == "v1" and back["probe"]["token_ids"] != [] and back["probe"]["finite"]


def test_a_preparation_for_another_body_is_dropped_not_used(w: WorkerProcess, loader: LoaderProcess, root: Path) -> None:
    body = {"version": "v3", "transport": "ipc", "descriptor": loader.client.descriptor("v3"), "mode": "copy"}
    w.admin("/admin/prepare", body)
    assert holders(loader)["v3"]
    up = w.admin("/admin/update", {"version": "v2", "transport": "disk", "path": str(root / "v2")})
    assert up["prepared"] is False and up["version"] == "v2"
    assert w.info()["prepared_version"] is None
    wait_until(lambda: not holders(loader)["v3"], timeout=10, what="unused preparation let go")
    bad = w.post("/admin/prepare", {"version": "v9", "transport": "disk", "path": str(root / "nope")}, admin=True)
    assert bad.status_code == 422 and "nope" in bad.json()["error"]
    assert w.info()["version"] == "v2" and w.info()["prepared_version"] is None


def test_a_broadcast_update_is_not_prepared_ahead(w: WorkerProcess) -> None:
    # its open is the ranks' collective "ready" vote: it must stay inside the update
    r = w.admin("/admin/prepare", {"version": "b1", "transport": "broadcast"})
    assert r["prepared"] is False and "broadcast" in r["reason"] and w.info()["prepared_version"] is None


@pytest.fixture(scope="module")
def ahead_worker(root: Path) -> Iterator[WorkerProcess]:
    wp = start_worker(root / "v1", root / "token", extra=["--version", "v1", "--stage-disk", "on"])
    yield wp
    wp.stop()


def test_a_prepared_disk_update_reads_ahead_and_the_pause_writes_only_verified_bytes(
    ahead_worker: WorkerProcess, root: Path, tmp_path: Path
) -> None:
    w = ahead_worker
    src = tmp_path / "v2x"
    shutil.copytree(root / "v2", src)
    body = {"version": "v2x", "transport": "disk", "path": str(src), "expect": expect_of(src).to_json()}
    assert w.admin("/admin/prepare", body)["prepared"] is True
    table, _ = tensor_table(src)
    loc = min(table.values(), key=lambda x: (str(x.file), x.entry.start))
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 2)  # changed after the check: never read
    w.admin("/admin/pause", {"mode": "keep"})
    up = w.admin("/admin/update", body)
    w.admin("/admin/resume")
    assert up["prepared"] is True and up["read_path"] == "ahead" and up["digest_checked"] is True
    on_staged = w.greedy([1, 17, 42, 99, 7, 3])
    w.admin("/admin/update", {"version": "v2", "transport": "disk", "path": str(root / "v2")})
    assert w.greedy([1, 17, 42, 99, 7, 3]) == on_staged  # the verified v2 bytes, not the changed file
    # a version whose bytes changed since verify is refused at prepare; nothing stays prepared
    bad = w.post("/admin/prepare", {**body, "version": "v2y"}, admin=True)
    assert bad.status_code == 422 and "does not match the verified" in bad.json()["error"], bad.text
    assert w.info()["prepared_version"] is None and w.info()["version"] == "v2"


def test_a_preparation_no_update_takes_is_let_go_after_its_ttl(root: Path, loader: LoaderProcess) -> None:
    """The daemon prepares later workers while the first ones update; when the rollout stops
    before their turn, the open IPC handle (a loader acquisition) must not be kept for good."""
    wp = start_worker(root / "v1", root / "token", extra=["--version", "v1", "--prepared-ttl-s", "1"])
    try:
        body = {"version": "v3", "transport": "ipc", "descriptor": loader.client.descriptor("v3"), "mode": "copy"}
        assert wp.admin("/admin/prepare", body)["prepared"] is True
        assert wp.info()["prepared_version"] == "v3" and holders(loader)["v3"]
        wait_until(lambda: wp.info()["prepared_version"] is None, timeout=20, what="the preparation to expire")
        assert any(e["event"] == "prepare_expired" and e["version"] == "v3" for e in wp.info()["events"])
        wait_until(lambda: not holders(loader)["v3"], timeout=10, what="the loader acquisition let go")
        assert wp.info()["version"] == "v1" and wp.info()["state"] == "RUNNING"
    finally:
        wp.stop()


@pytest.mark.parametrize("ttl", ["0", "-1", "nan", "inf"])
def test_a_prepared_ttl_that_is_not_a_positive_time_is_refused_at_start(ttl: str) -> None:
    from daemon.worker.server import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--model", "m", "--prepared-ttl-s", ttl])
    assert exited.value.code == 2
