"""A disk version read ahead of its verification (daemon/worker/read_ahead.py), in a real worker
process with `--stage-disk on` (on the CPU the buffer is host memory): `POST /admin/read_ahead`
reads and hashes the files while the daemon would still be verifying them; the prepare that
follows takes that buffer only when the digests it carries (the registry's, after verify) are
exactly what was read, and reads the files itself otherwise. The daemon's side (it asks when the
crc32c pass starts) is tests/e2e/test_daemon_read_ahead.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from support_check import expect_of, flip_byte
from support_worker import WorkerProcess, start_worker, write_token

from daemon.formats.checkpoint import tensor_table
from daemon.tinymodel import make_tiny_checkpoint

PROMPT = [1, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("read-ahead")
    for name, seed in (("v1", 1), ("v2", 2), ("v3", 3)):
        make_tiny_checkpoint(r / name, seed=seed)
    write_token(r)
    return r


@pytest.fixture(scope="module")
def w(root: Path) -> Iterator[WorkerProcess]:
    wp = start_worker(root / "v1", root / "token", extra=["--version", "v1", "--stage-disk", "on"])
    yield wp
    wp.stop()


def ahead_events(w: WorkerProcess, since: float) -> list[dict[str, Any]]:
    return [e for e in w.info()["events"] if e["at"] > since and e["event"].startswith("read_ahead")]


def last_event_at(w: WorkerProcess) -> float:
    return max((e["at"] for e in w.info()["events"]), default=0.0)


def read_ahead(w: WorkerProcess, version: str, path: Path) -> None:
    assert w.admin("/admin/read_ahead", {"version": version, "path": str(path), "alg": "blake3"})["version"] == version
    wait_until(lambda: w.info()["read_ahead"] == version, timeout=60, what=f"{version} read ahead")


def update(w: WorkerProcess, body: dict[str, Any]) -> dict[str, Any]:
    w.admin("/admin/pause", {"mode": "keep"})
    try:
        return w.admin("/admin/update", body)
    finally:
        w.admin("/admin/resume")


def test_the_prepare_takes_a_read_ahead_whose_bytes_are_the_verified_ones(w: WorkerProcess, root: Path,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    src = tmp_path / "v2a"
    shutil.copytree(root / "v2", src)
    t0 = last_event_at(w)
    read_ahead(w, "v2a", src)
    body = {"version": "v2a", "transport": "disk", "path": str(src), "expect": expect_of(src).to_json()}
    assert w.admin("/admin/prepare", body)["prepared"] is True
    assert [e["event"] for e in ahead_events(w, t0)] == ["read_ahead", "read_ahead_taken"]
    assert w.info()["read_ahead"] is None and w.info()["prepared_version"] == "v2a"
    up = update(w, body)
    assert up["prepared"] is True and up["read_path"] == "ahead" and up["read_ahead_of_verify"] is True, up
    assert up["digest_checked"] is True and up["check_alg"] == "blake3"
    served = w.greedy(PROMPT)
    update(w, {"version": "v2", "transport": "disk", "path": str(root / "v2"), "expect": expect_of(root / "v2").to_json()})
    assert w.greedy(PROMPT) == served  # the same weights as v2 read the ordinary way


def test_bytes_that_changed_after_the_read_ahead_are_never_taken(w: WorkerProcess, root: Path, tmp_path: Path) -> None:
    src = tmp_path / "v3a"
    shutil.copytree(root / "v3", src)
    t0 = last_event_at(w)
    read_ahead(w, "v3a", src)
    table, _ = tensor_table(src)
    loc = min(table.values(), key=lambda x: (str(x.file), x.entry.start))
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 2)  # after the read, before "verify"
    body = {"version": "v3a", "transport": "disk", "path": str(src), "expect": expect_of(src).to_json()}
    assert w.admin("/admin/prepare", body)["prepared"] is True
    events = ahead_events(w, t0)
    assert [e["event"] for e in events] == ["read_ahead", "read_ahead_released"], events
    assert "not the verified ones" in events[-1]["why"] and events[-1]["why"].startswith("refused"), events
    up = update(w, body)
    assert up["read_path"] == "ahead" and "read_ahead_of_verify" not in up and up["digest_checked"] is True, up
    assert w.info()["version"] == "v3a"  # the changed bytes, read again and checked against the digests given


def test_a_read_ahead_is_let_go_when_the_version_fails_and_not_taken_for_another_source(
    w: WorkerProcess, root: Path, tmp_path: Path
) -> None:
    t0 = last_event_at(w)
    read_ahead(w, "v2b", root / "v2")
    w.admin("/admin/read_ahead", {"version": None})
    assert w.info()["read_ahead"] is None
    assert [(e["event"], e.get("why")) for e in ahead_events(w, t0)] == [("read_ahead", None), ("read_ahead_released", "let_go")]
    # read from one directory, prepared from another holding the same bytes: not taken
    src = tmp_path / "v2c"
    shutil.copytree(root / "v2", src)
    read_ahead(w, "v2c", root / "v2")
    body = {"version": "v2c", "transport": "disk", "path": str(src), "expect": expect_of(src).to_json()}
    assert w.admin("/admin/prepare", body)["prepared"] is True
    assert w.info()["read_ahead"] == "v2c"  # still held (until its hold ends), not the prepare's
    w.admin("/admin/read_ahead", {"version": None})


@pytest.mark.parametrize("body", [
    {"version": "v9", "path": "relative/dir", "alg": "blake3"},
    {"version": "v9", "path": "/abs", "alg": "crc32c"},
    {"version": "v9", "path": "/abs", "alg": "blake3", "extra": 1},
    {"version": "", "path": "/abs", "alg": "blake3"},
    {"version": "v9", "path": "/abs", "alg": "blake3", "reserve": -1},
    {"version": "v9", "path": "/abs", "alg": "blake3", "reserve": "16G"},
    {"version": "v9", "path": "/abs", "alg": "blake3", "reserve": True},
    [1, 2],
])  # fmt: skip
def test_a_read_ahead_body_that_is_not_one_is_refused_by_name(w: WorkerProcess, body: Any) -> None:
    r = w.post("/admin/read_ahead", body, admin=True)
    assert r.status_code in (400, 422) and r.json()["error"], r.text
    assert w.info()["read_ahead"] is None


def test_a_read_ahead_keeps_the_reserve_it_was_asked_for_free_or_reads_nothing_ahead(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device must hold the buffer and the `reserve` the daemon asked for (the other workers'
    read-aheads and the checks' copy), else nothing is read ahead and the prepare reads as before.
    The room is the device's (CUDA): here a device with 1 GiB free is stood in for."""
    import torch

    from daemon.transport import ahead as ahead_module
    from daemon.transport.disk import DiskTransport
    from daemon.worker.updates import parse_read_ahead

    assert parse_read_ahead({"version": "v2", "path": "/abs", "alg": "blake3", "reserve": 5})[3] == 5
    assert parse_read_ahead({"version": "v2", "path": "/abs", "alg": "blake3"})[3] == 0
    asked: list[int] = []

    def room_for(device: torch.device, nbytes: int) -> str | None:
        asked.append(nbytes)
        return None if nbytes <= 1 << 30 else f"{nbytes} needed, 1 GiB free"

    monkeypatch.setattr(ahead_module, "room_for", room_for)
    params = {n: torch.zeros(loc.entry.shape, dtype=torch.float32)
              for n, loc in tensor_table(root / "v2")[0].items()}  # fmt: skip
    need = sum(int(p.numel() * p.element_size()) for p in params.values())
    for reserve, read in ((0, True), (2 << 30, False)):
        tr = DiskTransport(str(root / "v2"))
        tr.stage_ahead, tr.reserve_bytes = "on", reserve
        try:
            tr.stage(params)
            assert (tr.ahead is not None) is read, tr.ahead_note
            assert asked[-1] >= need + reserve and asked[-1] - reserve < need + 4096, asked
        finally:
            tr.close()
