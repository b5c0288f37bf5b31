"""Failures in a real worker process: a shard damaged mid-update, a restore that fails (UNHEALTHY),
recovery; and the daemon-side `BuiltinWorkerClient` against it, over a Unix socket.

The worker runs from tests/hooked_worker.py with a pause before every write, so the test can
truncate a shard after the worker validated it and before it writes (the window a real truncation
would have to hit).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from hooked_worker import PAUSE_BEFORE_WRITE_ENV
from support_worker import DEVICE, WorkerProcess, start_worker, write_token

from daemon.engines.base import UpdateRefused, WorkerError, WorkerUnreachable
from daemon.engines.builtin import BuiltinWorkerClient
from daemon.formats.checkpoint import weight_files
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.base import UpdateRequest
from daemon.worker.server import main as worker_main

PROMPT = [1, 4, 9, 16, 25]
PAUSE_S = 1.5


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("wfail")
    make_tiny_checkpoint(r / "good", seed=101)
    make_tiny_checkpoint(r / "next", seed=202, shards=2)
    make_tiny_checkpoint(r / "wide", seed=303, config_overrides={"hidden_size": 32, "num_attention_heads": 2,
                                                                  "num_key_value_heads": 1})
    write_token(r)
    return r


@pytest.fixture(scope="module")
def w(root: Path) -> Iterator[WorkerProcess]:
    sock = root / "worker.sock"
    proc = start_worker(root / "good", root / "token", extra=["--uds", str(sock), "--version", "good",
                                                               "--step-delay-ms", "5"],
                        env={PAUSE_BEFORE_WRITE_ENV: str(PAUSE_S)}, module="tests.hooked_worker")
    assert proc.url == f"unix:{sock}"
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(w: WorkerProcess) -> Iterator[BuiltinWorkerClient]:
    c = BuiltinWorkerClient("w0", w.url, w.token, timeout=30.0)
    yield c
    c.close()


def update_in_thread(client: BuiltinWorkerClient, req: UpdateRequest) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = client.update(req)
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def truncate_mid_update(client: BuiltinWorkerClient, src: Path, dst: Path, version: str) -> dict[str, Any]:
    ckpt = Path(shutil.copytree(src, dst))
    t, out = update_in_thread(client, UpdateRequest(version=version, source={"path": str(ckpt)}))
    time.sleep(PAUSE_S / 2)  # validated (headers read), not yet writing
    shard = weight_files(ckpt)[-1]
    os.truncate(shard, shard.stat().st_size // 2)
    t.join(60)
    return out


def test_no_tokenizer_means_text_prompts_get_a_clear_400(w: WorkerProcess) -> None:
    r = w.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "no tokenizer" in message and "token ids" in message


def test_client_round_trip_and_error_mapping(w: WorkerProcess, client: BuiltinWorkerClient, root: Path) -> None:
    assert client.health() and client.ready()
    info = client.weight_info()
    assert (info.version, info.state, info.tensors) == ("good", "RUNNING", 21)
    assert info.device == ("cuda:0" if DEVICE.startswith("cuda") else "cpu")
    assert {"requests_total", "requests_failed"} <= set(client.counters())
    assert client.probe() == "good"
    client.pause("keep")
    assert not client.ready() and client.weight_info().state == "PAUSED"
    with pytest.raises(UpdateRefused, match="shape"):
        client.update(UpdateRequest(version="wide", source={"path": str(root / "wide")}))
    with pytest.raises(UpdateRefused, match="does not exist"):
        client.update(UpdateRequest(version="nope", source={"path": str(root / "missing")}))
    with pytest.raises(UpdateRefused, match="drain in state PAUSED"):
        client.drain(1.0)
    client.resume()
    assert client.weight_info().state == "RUNNING"
    bad = BuiltinWorkerClient("w0", w.url, "not-the-token", timeout=5.0)
    with pytest.raises(WorkerError, match="401") as exc:
        bad.pause("keep")
    assert not isinstance(exc.value, UpdateRefused)
    bad.close()
    assert client.weight_info().state == "RUNNING"
    gone = BuiltinWorkerClient("w9", f"unix:{root / 'nobody.sock'}", "x", timeout=1.0)
    with pytest.raises(WorkerUnreachable, match="w9"):
        gone.weight_info()
    assert gone.health() is False
    gone.close()


def test_truncated_shard_mid_update_restores_the_old_version(
    w: WorkerProcess, client: BuiltinWorkerClient, root: Path, tmp_path: Path
) -> None:
    before = w.greedy(PROMPT)
    client.pause("keep")
    out = truncate_mid_update(client, root / "next", tmp_path / "next-cut", "next-cut")
    err = out.get("error")
    assert isinstance(err, WorkerError) and not isinstance(err, UpdateRefused), out
    assert "short read" in str(err) and "restored good" in str(err)
    info = client.weight_info()
    assert (info.version, info.state) == ("good", "PAUSED")
    assert client.health()
    client.resume()
    assert w.greedy(PROMPT) == before


def test_failed_restore_makes_the_worker_unhealthy_until_rolled_back(
    w: WorkerProcess, client: BuiltinWorkerClient, root: Path, tmp_path: Path
) -> None:
    before = w.greedy(PROMPT)
    # a long request, kept across the pause: it must fail rather than finish on mixed weights
    kept: dict[str, Any] = {}

    def long_request() -> None:
        r = w.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 150, "temperature": 0, "ignore_eos": True})
        kept["status"], kept["body"] = r.status_code, r.json()

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    wait_until(lambda: client.weight_info().in_flight == 1, what="request in flight")
    client.pause("keep")
    (root / "good").rename(root / "good.away")  # the last good version can no longer be re-read
    try:
        out = truncate_mid_update(client, root / "next", tmp_path / "next-cut2", "next-cut2")
        err = out.get("error")
        assert isinstance(err, WorkerError) and "failed too" in str(err), out
        t.join(30)
        assert kept["status"] == 500 and "unhealthy" in kept["body"]["error"]["message"]
        info = client.weight_info()
        assert info.state == "UNHEALTHY" and info.version == "good" and info.extra["unhealthy_reason"]
        assert w.get("/health").status_code == 503 and not client.health()
        assert w.get("/ready").status_code == 503
        r = w.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and "unhealthy" in r.json()["error"]["message"]
        for call in (client.resume, client.probe,
                     lambda: client.update(UpdateRequest(version="next", source={"path": str(root / "next")}))):
            with pytest.raises(WorkerError, match="503"):
                call()
        with pytest.raises(WorkerError, match="restore failed"):
            client.restore()  # the files are still away
    finally:
        (root / "good.away").rename(root / "good")
    res = client.restore()  # restores the last good version from its path
    assert res.version == "good" and res.detail["state"] == "RUNNING"
    assert client.health() and client.ready()
    assert w.greedy(PROMPT) == before


def test_cli_refuses_bad_input_with_a_clear_message(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_main(["--model", str(tmp_path / "none"), "--device", "cpu"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert worker_main(["--model", str(root / "good"), "--device", "cpu", "--token-file", str(tmp_path / "t")]) == 2
    assert "token-file" in capsys.readouterr().err
    partial = Path(shutil.copytree(root / "good", tmp_path / "partial"))
    from safetensors.torch import load_file, save_file

    f = weight_files(partial)[0]
    state = load_file(f)
    del state["model.norm.weight"]
    save_file(state, str(f))
    assert worker_main(["--model", str(partial), "--device", "cpu"]) == 2
    assert "model.norm.weight" in capsys.readouterr().err
