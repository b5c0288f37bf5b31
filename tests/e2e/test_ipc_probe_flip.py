"""Update-then-resume over ipc (issue 41), real loader and worker processes over shared memory:
the worker writes, resumes at once and probes serving; a version whose probe fails (NaN weights
that pass every table check) is flipped back to what the worker served, in copy and swap mode,
and refused (409) with the flip-back time; the worker then serves the old version's tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support_ipc import LoaderProcess, shm_dir
from support_worker import WorkerProcess, start_worker, write_token

from daemon.tinymodel import make_tiny_checkpoint

PROMPT = [1, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("flip")
    make_tiny_checkpoint(r / "v1", seed=1)
    make_tiny_checkpoint(r / "v2", seed=2)
    bad = make_tiny_checkpoint(r / "nan", seed=3)
    for f in bad.glob("*.safetensors"):  # the final norm all NaN: same table, non-finite logits
        tensors = load_file(str(f))
        tensors = {k: (torch.full_like(v, float("nan")) if k == "model.norm.weight" else v) for k, v in tensors.items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
    write_token(r)
    return r


@pytest.fixture(scope="module")
def loader(root: Path) -> Iterator[LoaderProcess]:
    with shm_dir() as d:
        lp = LoaderProcess(root / "loader.sock", d, "--max-versions", "8")
        for v in ("v1", "v2", "nan"):
            lp.client.stage(v, str(root / v))
        yield lp
        lp.stop()


@pytest.fixture(scope="module")
def w(root: Path) -> Iterator[WorkerProcess]:
    proc = start_worker(root / "v1", root / "token", extra=["--version", "v1"])
    yield proc
    proc.stop()


def update_then_resume(w: WorkerProcess, loader: LoaderProcess, version: str, mode: str):  # type: ignore[no-untyped-def]
    body = {"version": version, "transport": "ipc", "descriptor": loader.client.descriptor(version), "mode": mode}
    w.admin("/admin/prepare", body)  # opened and validated while serving
    assert w.admin("/admin/pause", {"mode": "keep"})["state"] == "PAUSED"
    return w.post("/admin/update?then=resume", body, admin=True)


@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_a_failing_probe_after_resume_flips_back_and_refuses(w: WorkerProcess, loader: LoaderProcess, mode: str) -> None:
    r = update_then_resume(w, loader, "v2", mode)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["state"] == "RUNNING" and doc["probe"]["finite"] is True and doc["probe"]["weight_version"] == "v2"
    assert doc["pause_window_ms"] >= 0 and w.info()["state"] == "RUNNING"
    good = w.greedy(PROMPT)
    updates_before = w.info()["update_count"]

    r = update_then_resume(w, loader, "nan", mode)
    assert r.status_code == 409, r.text
    err = r.json()
    assert "probe after resume failed" in err["error"] and "back on v2" in err["error"], err
    assert err["flip_back_ms"] >= 0 and err["probe"]["finite"] is False
    info = w.info()
    assert info["state"] == "RUNNING" and info["version"] == "v2" and info["previous_version"] == "nan"
    assert info["update_count"] > updates_before  # the bad version was written, then flipped back
    flips = [e for e in info["events"] if e["event"] == "flipped_back"]
    assert flips and flips[-1]["version"] == "v2" and flips[-1]["bad"] == "nan"
    assert w.greedy(PROMPT) == good  # serving v2's weights again, whole
    assert w.get("/health").status_code == 200


def test_update_then_resume_needs_a_paused_worker(w: WorkerProcess, loader: LoaderProcess) -> None:
    body = {"version": "v1", "transport": "ipc", "descriptor": loader.client.descriptor("v1")}
    r = w.post("/admin/update?then=resume", body, admin=True)
    assert r.status_code == 409 and "paused or draining" in r.json()["error"]
    assert w.post("/admin/update?then=later", body, admin=True).status_code == 400
