"""`hotswap loader` as a real process on shared host memory: staging, budget, holders, protocol, exit."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support_ipc import LoaderProcess, load_checkpoint, shm_dir

from daemon.handoff.loader_client import LoaderClient, LoaderError, LoaderUnavailable
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.ipc import IpcTransport

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {f"v{i}": make_tiny_checkpoint(root / f"v{i}", seed=i, shards=1 + i % 2) for i in range(1, 5)}


@pytest.fixture
def shm() -> Iterator[Path]:
    with shm_dir() as d:
        yield d


@pytest.fixture
def loader(tmp_path: Path, shm: Path) -> Iterator[LoaderProcess]:
    lp = LoaderProcess(tmp_path / "loader.sock", shm)
    yield lp
    lp.stop()


def test_stage_exports_exact_bytes_and_a_private_socket(loader: LoaderProcess, ckpts: dict[str, Path]) -> None:
    info = loader.client.stage("v1", str(ckpts["v1"]))
    assert (info.version, info.tensors, info.devices) == ("v1", 21, ["host"])
    assert stat.S_IMODE(os.stat(loader.socket_path).st_mode) == 0o600
    desc = loader.client.descriptor("v1")
    assert desc["kind"] == "shm" and desc["loader"] == str(loader.socket_path)
    seg = Path(desc["buffers"][0]["path"])
    assert seg.parent == loader.shm_dir and stat.S_IMODE(seg.stat().st_mode) == 0o400  # sealed
    ref = load_checkpoint(ckpts["v1"])
    with IpcTransport(desc, device="cpu") as tr:
        views = tr.views()
        assert views.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(views[name], t), name
    # same version from the same directory: the existing one; from another: refused (immutable)
    assert loader.client.stage("v1", str(ckpts["v1"])).bytes == info.bytes
    with pytest.raises(LoaderError, match="immutable"):
        loader.client.stage("v1", str(ckpts["v2"]))
    assert loader.segments() == [seg.name]


def test_bad_checkpoints_are_refused_and_leave_nothing(loader: LoaderProcess, ckpts: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    data = (ckpts["v2"] / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:-100])  # truncated: the header promises more
    with pytest.raises(LoaderError, match=r"broken/model.safetensors: tensor 'model.norm.weight'.*past the data section"):
        loader.client.stage("broken", str(broken))
    with pytest.raises(LoaderError, match="not a checkpoint directory"):
        loader.client.stage("nowhere", str(tmp_path / "missing"))
    with pytest.raises(LoaderError, match="'ghost' is not staged"):
        loader.client.descriptor("ghost")
    assert loader.segments() == []
    assert loader.client.status()["versions"] == []


def test_in_use_versions_are_never_freed(loader: LoaderProcess, ckpts: dict[str, Path]) -> None:
    c = loader.client
    c.stage("v1", str(ckpts["v1"]))
    with pytest.raises(LoaderError, match="positive process id"):
        c.acquire("v1", "worker-a", pid=-1)  # never a process group
    c.acquire("v1", "worker-a", pid=os.getpid())
    with pytest.raises(LoaderError, match=r"in use by worker-a \(1\)"):
        c.drop("v1")
    c.release("v1", "worker-a")
    assert c.drop("v1") == {"version": "v1", "freed": True}
    assert loader.segments() == []
    with pytest.raises(LoaderError, match="does not hold"):
        c.release("v1", "worker-a")


def test_dead_holders_are_released(loader: LoaderProcess, ckpts: dict[str, Path]) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    loader.client.stage("v1", str(ckpts["v1"]))
    loader.client.acquire("v1", "crashed-worker", pid=gone.pid)
    assert loader.client.drop("v1")["freed"]


def test_max_versions_evicts_least_recently_used_unheld(loader: LoaderProcess, ckpts: dict[str, Path]) -> None:
    c = loader.client
    for v in ("v1", "v2", "v3"):
        c.stage(v, str(ckpts[v]))
    c.acquire("v1", "w", pid=os.getpid())  # v1 is oldest but held: v2 must go instead
    c.stage("v4", str(ckpts["v4"]))
    assert [v["version"] for v in c.status()["versions"]] == ["v1", "v3", "v4"]
    assert len(loader.segments()) == 3


def test_budget_refuses_when_everything_is_held(tmp_path: Path, shm: Path, ckpts: dict[str, Path]) -> None:
    one = 427264  # a tiny checkpoint's staged bytes
    lp = LoaderProcess(tmp_path / "l.sock", shm, "--budget-bytes", str(2 * one + 100))
    try:
        c = lp.client
        c.stage("v1", str(ckpts["v1"]))
        c.stage("v2", str(ckpts["v2"]))
        c.acquire("v1", "a", pid=os.getpid())
        c.acquire("v2", "b", pid=os.getpid())
        with pytest.raises(LoaderError, match=r"no room to stage 'v3'.*v1 \(ready, held by \['a'\]\)"):
            c.stage("v3", str(ckpts["v3"]))
        c.release("v2", "b")
        c.stage("v3", str(ckpts["v3"]))  # v2 evicted
        assert sorted(v["version"] for v in c.status()["versions"]) == ["v1", "v3"]
        assert c.status()["used_bytes"] == 2 * one
    finally:
        assert lp.stop() == 0


def _raw(sock_path: Path, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock_path))
        s.sendall(payload)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b'{"op": "format_disk", "id": 1}\n', "unknown op 'format_disk'"),
        (b'{"op": "stage", "id": 2, "version": "x"}\n', "missing argument 'path'"),
        (b'{"op": "drop", "id": 3, "version": 7}\n', "version must be str"),
        (b'{"op": "status", "id": 4, "exec": "rm -rf /"}\n', "unknown arguments ['exec']"),
        (b"\x80\x04\x95pickle\n", "not a JSON line"),
        (b"[1, 2]\n", "must be a JSON object"),
        (b"x" * (1 << 20) + b"y" * 100, "longer than"),
    ],
)
def test_protocol_errors_are_answered_and_survived(loader: LoaderProcess, payload: bytes, message: str) -> None:
    resp = _raw(loader.socket_path, payload)
    assert resp["ok"] is False and message in resp["error"]
    assert loader.client.status()["kind"] == "shm"  # still serving


def test_sigterm_frees_everything(tmp_path: Path, shm: Path, ckpts: dict[str, Path]) -> None:
    lp = LoaderProcess(tmp_path / "l.sock", shm)
    lp.client.stage("v1", str(ckpts["v1"]))
    assert lp.segments()
    assert lp.stop() == 0
    assert lp.segments() == [] and not lp.socket_path.exists()
    with pytest.raises(LoaderUnavailable):
        LoaderClient(lp.socket_path).status()


def test_restart_after_sigkill_cleans_stale_segments(tmp_path: Path, shm: Path, ckpts: dict[str, Path]) -> None:
    lp = LoaderProcess(tmp_path / "l.sock", shm)
    lp.client.stage("v1", str(ckpts["v1"]))
    lp.kill()
    lp.stop()
    assert lp.segments() and lp.socket_path.exists()  # what a crash leaves behind
    again = LoaderProcess(tmp_path / "l.sock", shm)  # replaces the dead socket, removes the dead segments
    try:
        assert again.segments() == []
        # a second loader on a live socket is refused
        third = subprocess.run(
            [sys.executable, "-m", "daemon.loader.server", "--socket", str(again.socket_path), "--device", "cpu",
             "--shm-dir", str(shm)], capture_output=True, text=True, timeout=60,
        )
        assert third.returncode != 0 and "another loader is listening" in third.stderr
    finally:
        assert again.stop() == 0
