"""A real worker opens a version's loader buffer ahead of its update (issue 41, `POST
/admin/map_ahead`): the prepare that follows takes that mapping instead of opening the buffer
again, and what no update takes is let go when the daemon says so. On shared memory here (a
sealed segment); the daemon asks workers only for CUDA buffers (daemon.transport.ipc_verify)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support_ipc import LoaderProcess, shm_dir
from support_wait import wait_until
from support_worker import WorkerProcess, start_worker, write_token

from daemon.tinymodel import make_tiny_checkpoint

PROMPT = [1, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("mapahead")
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
def worker(root: Path) -> Iterator[WorkerProcess]:
    w = start_worker(root / "v1", root / "token", extra=["--version", "v1"])
    yield w
    w.stop()


def segment_maps(w: WorkerProcess, segment: str) -> list[str]:
    """The worker's mappings of `segment`, with their addresses."""
    with open(f"/proc/{w.proc.pid}/maps") as f:
        return [line.split()[0] for line in f if segment in line]


def events(w: WorkerProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in w.info()["events"] if e["event"] == name]


def test_a_buffer_opened_ahead_is_the_one_the_prepare_uses_then_let_go_to_it(
        worker: WorkerProcess, loader: LoaderProcess, root: Path) -> None:  # fmt: skip
    desc = loader.client.descriptor("v2")
    segment = Path(desc["buffers"][0]["path"]).name
    assert segment_maps(worker, segment) == []
    worker.admin("/admin/map_ahead", {"version": "v2", "loader": str(loader.socket_path)})
    wait_until(lambda: worker.info()["mapped_ahead"] == "v2", timeout=30, what="the worker to open v2 ahead")
    ahead = segment_maps(worker, segment)
    assert len(ahead) == 1 and events(worker, "mapped_ahead")[-1]["version"] == "v2"
    body = {"version": "v2", "transport": "ipc", "descriptor": desc, "mode": "copy"}
    worker.admin("/admin/prepare", body)
    assert segment_maps(worker, segment) == ahead  # the same mapping, not a second open
    assert worker.info()["mapped_ahead"] is None
    assert events(worker, "map_ahead_released")[-1] == {**events(worker, "map_ahead_released")[-1],
                                                        "version": "v2", "why": "taken"}  # fmt: skip
    worker.admin("/admin/update", body)
    info = worker.info()
    assert info["version"] == "v2" and info["prepared_version"] is None


def test_a_buffer_opened_ahead_and_never_updated_to_is_let_go_when_asked(
        worker: WorkerProcess, loader: LoaderProcess) -> None:  # fmt: skip
    segment = Path(loader.client.descriptor("v3")["buffers"][0]["path"]).name
    worker.admin("/admin/map_ahead", {"version": "v3", "loader": str(loader.socket_path)})
    wait_until(lambda: worker.info()["mapped_ahead"] == "v3", timeout=30, what="the worker to open v3 ahead")
    assert len(segment_maps(worker, segment)) == 1
    worker.admin("/admin/map_ahead", {"version": None})  # v3 failed its checks
    assert worker.info()["mapped_ahead"] is None and segment_maps(worker, segment) == []
    assert events(worker, "map_ahead_released")[-1]["why"] == "let_go"


def test_a_map_ahead_the_loader_cannot_answer_holds_nothing_and_bad_bodies_are_refused(
        worker: WorkerProcess, loader: LoaderProcess) -> None:  # fmt: skip
    before = len(events(worker, "map_ahead_failed"))
    worker.admin("/admin/map_ahead", {"version": "nope", "loader": str(loader.socket_path / "missing")})
    wait_until(lambda: len(events(worker, "map_ahead_failed")) > before, timeout=30, what="the failed open's event")
    assert worker.info()["mapped_ahead"] is None
    for body in ({"version": "v2"}, {"version": "v2", "loader": "relative.sock"}, {"version": 7, "loader": "/x"},
                 {"version": "v2", "loader": "/x", "extra": 1}, ["v2"]):  # fmt: skip
        r = worker.post("/admin/map_ahead", body, admin=True)
        assert r.status_code in (400, 422), (body, r.status_code, r.text)
    assert worker.post("/admin/map_ahead", {"version": None}).status_code in (401, 403)  # admin only
