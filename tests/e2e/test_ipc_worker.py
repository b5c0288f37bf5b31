"""ipc updates end to end: a real loader process and real worker processes over shared memory."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from support_ipc import LoaderProcess, shm_dir
from support_worker import WorkerProcess, start_worker, write_token

from daemon.tinymodel import make_tiny_checkpoint

PROMPT = [1, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("ipcw")
    for name, seed, shards in (("v1", 1, 1), ("v2", 2, 2), ("v3", 3, 1)):
        make_tiny_checkpoint(r / name, seed=seed, shards=shards)
    make_tiny_checkpoint(r / "wide", seed=4, config_overrides={"intermediate_size": 96})
    write_token(r)
    return r


@pytest.fixture(scope="module")
def loader(root: Path) -> Iterator[LoaderProcess]:
    with shm_dir() as d:
        lp = LoaderProcess(root / "loader.sock", d, "--max-versions", "8")
        for v in ("v1", "v2", "v3"):
            lp.client.stage(v, str(root / v), digest="0a0b0c0d" if v == "v3" else None)
        yield lp
        lp.stop()


@pytest.fixture(scope="module")
def a(root: Path) -> Iterator[WorkerProcess]:
    w = start_worker(root / "v1", root / "token", extra=["--version", "v1"])
    yield w
    w.stop()


@pytest.fixture(scope="module")
def b(root: Path) -> Iterator[WorkerProcess]:
    w = start_worker(root / "v1", root / "token", extra=["--version", "v1"])
    yield w
    w.stop()


@pytest.fixture(scope="module")
def reference(a: WorkerProcess, b: WorkerProcess, root: Path) -> dict[str, list[int]]:
    """Greedy outputs after a plain disk update to each version (worker b), then b back on v1."""
    out = {"v1": b.greedy(PROMPT)}
    for v in ("v2", "v3", "v1"):
        b.admin("/admin/update", {"version": v, "transport": "disk", "path": str(root / v)})
        out[v] = b.greedy(PROMPT)
    assert len({tuple(x) for x in out.values()}) == 3  # the versions really answer differently
    return out


def ipc_update(w: WorkerProcess, loader: LoaderProcess, version: str, mode: str = "copy", **over: Any):
    desc = over.pop("descriptor", None) or loader.client.descriptor(version)
    return w.post("/admin/update", {"version": version, "transport": "ipc", "descriptor": desc, "mode": mode,
                                    **over}, admin=True)


def worker_maps(w: WorkerProcess) -> int:
    with open(f"/proc/{w.proc.pid}/maps") as f:
        return sum(1 for line in f if "hotswap-test-" in line)


def worker_fds(w: WorkerProcess) -> int:
    """Open files of the worker, not counting sockets (HTTP connections come and go)."""
    fd_dir = f"/proc/{w.proc.pid}/fd"
    count = 0
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(FileNotFoundError):
            count += not os.readlink(f"{fd_dir}/{fd}").startswith("socket:")
    return count


def holders(loader: LoaderProcess) -> dict[str, dict[str, int]]:
    return {v["version"]: v["holders"] for v in loader.client.status()["versions"]}


def test_copy_and_swap_match_a_disk_update_and_rollback_flips_back(
    a: WorkerProcess, loader: LoaderProcess, reference: dict[str, list[int]]
) -> None:
    storage = a.info()["storage_id"]
    r = ipc_update(a, loader, "v2")
    assert r.status_code == 200, r.text
    assert r.json()["transport"] == "ipc" and r.json()["mode"] == "copy"
    assert a.greedy(PROMPT) == reference["v2"] and a.info()["version"] == "v2"
    assert a.info()["storage_id"] == storage  # copied in place
    r = ipc_update(a, loader, "v3", mode="swap")
    assert r.status_code == 200, r.text
    assert a.greedy(PROMPT) == reference["v3"] and a.info()["version"] == "v3"
    assert worker_maps(a) == 1 and holders(loader)["v3"]  # v3 stays mapped and held while served
    rb = a.admin("/admin/rollback")
    assert rb["version"] == "v2" and rb["rolled_back_from"] == "v3"
    assert a.greedy(PROMPT) == reference["v2"]
    assert a.info()["storage_id"] == storage  # the pointer flip went back to the worker's own storage
    rb = a.admin("/admin/rollback")  # and forward again: the retained v3 lease
    assert rb["version"] == "v3" and a.greedy(PROMPT) == reference["v3"]
    # a copy update while swapped writes the worker's own storage, never the loader's buffer
    r = ipc_update(a, loader, "v1")
    assert r.status_code == 200, r.text
    assert a.greedy(PROMPT) == reference["v1"] and a.info()["storage_id"] == storage
    rb = a.admin("/admin/rollback")
    assert rb["version"] == "v3" and a.greedy(PROMPT) == reference["v3"]
    r = ipc_update(a, loader, "v3")  # v3 again, by copy: the loader's v3 must be unchanged
    assert r.status_code == 200 and a.greedy(PROMPT) == reference["v3"]


def test_swap_mode_lets_the_own_copy_go_and_a_later_copy_allocates_it_again(
    root: Path, loader: LoaderProcess, reference: dict[str, list[int]]
) -> None:
    """Two swaps on, no retained version lives in the worker's own storage: it is let go (the
    loader needs that memory for the next version). Rollbacks still flip between the leases, and
    a copy-mode update allocates own storage again, never writing a leased buffer."""
    w = start_worker(root / "v1", root / "token", extra=["--version", "v1"])
    try:
        assert ipc_update(w, loader, "v2", mode="swap").status_code == 200
        assert w.info()["own_storage"] == "own"  # v1 lives there: a rollback flips back to it
        assert ipc_update(w, loader, "v3", mode="swap").status_code == 200
        # released on the worker's releaser thread after it serves again; "released" is observed:
        # no tensor in the worker refers to that storage any more (a stray reference would keep it)
        wait_until(lambda: w.info()["own_storage"] == "released", timeout=30, what="the own copy let go")
        assert w.greedy(PROMPT) == reference["v3"]
        rb = w.admin("/admin/rollback")
        assert rb["version"] == "v2" and w.greedy(PROMPT) == reference["v2"]
        assert w.admin("/admin/rollback")["version"] == "v3"
        r = w.post("/admin/update", {"version": "v1", "transport": "disk", "path": str(root / "v1")}, admin=True)
        assert r.status_code == 200, r.text
        assert w.info()["own_storage"] == "own" and w.greedy(PROMPT) == reference["v1"]
        rb = w.admin("/admin/rollback")  # the v3 lease, untouched by the copy
        assert rb["version"] == "v3" and w.greedy(PROMPT) == reference["v3"]
    finally:
        w.stop()


def _mutated(loader: LoaderProcess, version: str, fn: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(loader.client.descriptor(version)))
    fn(doc)
    return doc


def test_bad_descriptors_are_refused_before_any_write(
    a: WorkerProcess, loader: LoaderProcess, reference: dict[str, list[int]]
) -> None:
    assert ipc_update(a, loader, "v2").status_code == 200
    info = a.info()
    cases = [
        (lambda d: d["tensors"][0].update(offset=d["tensors"][0]["offset"] + 4), 422, "not 256-byte aligned"),
        (lambda d: d["tensors"][0].update(offset=d["size"]), 422, "run past the payload size"),
        (lambda d: d["tensors"][0].update(bytes=d["tensors"][0]["bytes"] - 4), 422, "descriptor says"),
        (lambda d: d["buffers"][0].update(buffer_bytes=d["buffers"][0]["buffer_bytes"] + 256), 422, "the descriptor says"),
        (lambda d: d["tensors"][0].update(dtype="F4"), 422, "unknown dtype 'F4'"),
        (lambda d: d["buffers"][0].update(path="/dev/shm/hotswap-0-0-nothing"), 422, "cannot open"),
    ]
    for mutate, status, needle in cases:
        for mode in ("copy", "swap"):
            r = ipc_update(a, loader, "v3", mode=mode, descriptor=_mutated(loader, "v3", mutate))
            assert r.status_code == status and needle in r.json()["error"], (needle, r.text)
    loader.client.stage("wide", str(Path(loader.socket_path).parent / "wide"))
    r = ipc_update(a, loader, "wide")
    assert r.status_code == 409 and "does not match" in r.json()["error"], r.text
    # the digest the stage request claimed (no per-file reference, no check) is never repeated
    assert loader.client.descriptor("v3")["digest"] is None
    r = ipc_update(a, loader, "v3", expect={"digest": "0a0b0c0d", "tensors": 20})
    assert r.status_code == 409 and "expected 20 tensors" in r.json()["error"], r.text
    after = a.info()
    assert (after["version"], after["storage_id"]) == ("v2", info["storage_id"])
    assert a.greedy(PROMPT) == reference["v2"]
    loader.client.drop("wide")
    assert holders(loader).get("v3") == {}


def test_hundred_updates_leak_nothing(a: WorkerProcess, loader: LoaderProcess, reference: dict[str, list[int]]) -> None:
    assert ipc_update(a, loader, "v1").status_code == 200
    assert ipc_update(a, loader, "v2").status_code == 200
    # the baseline once v1's mapping is let go (the worker releases it after answering; on a loaded
    # machine the snapshot was once taken before that, one map and one fd too many)
    wait_until(lambda: not any(holders(loader).values()), timeout=60, what="the copies' holds released")
    fds, maps, segments = worker_fds(a), worker_maps(a), loader.segments()
    descs = {v: loader.client.descriptor(v) for v in ("v1", "v2", "v3")}
    for i in range(100):
        version = ("v1", "v2", "v3")[i % 3]
        mode = "swap" if i % 4 in (1, 2) else "copy"
        r = ipc_update(a, loader, version, mode=mode, descriptor=descs[version])
        assert r.status_code == 200, (i, r.text)
        if i % 10 == 9:
            assert a.admin("/admin/rollback")["rolled_back_from"] == version
    for v in ("v1", "v2"):  # two copies: no swapped record (and so no lease) is retained any more
        assert ipc_update(a, loader, v).status_code == 200
    assert a.greedy(PROMPT) == reference["v2"]

    def settled() -> bool:
        return (worker_fds(a), worker_maps(a), loader.segments()) == (fds, maps, segments) and not any(
            holders(loader).values()
        )

    # A leak never settles; a loaded machine only releases late (once seen past 10 s in CI).
    try:
        wait_until(settled, timeout=30, what="fds, maps, segments and holders back to baseline")
    except AssertionError:
        now = (worker_fds(a), worker_maps(a), loader.segments(), holders(loader))
        raise AssertionError(f"not back to baseline after 30 s: (fds, maps, segments, holders) {now} "
                             f"vs {(fds, maps, segments, {})}; worker fds: {sorted(os.listdir(f'/proc/{a.proc.pid}/fd'))}"
                             ) from None  # fmt: skip


def test_killing_the_loader_mid_rollout_leaves_every_worker_on_a_whole_version(
    a: WorkerProcess, b: WorkerProcess, root: Path, reference: dict[str, list[int]], tmp_path: Path
) -> None:
    assert b.info()["version"] == "v1"
    with shm_dir() as d:
        lp = LoaderProcess(tmp_path / "l.sock", d)
        lp.client.stage("v2", str(root / "v2"))
        lp.client.stage("v3", str(root / "v3"))
        assert ipc_update(a, lp, "v3", mode="swap").status_code == 200  # first worker done (swapped)
        desc = lp.client.descriptor("v2")
        lp.kill()  # the loader dies before the second worker's turn
        r = ipc_update(b, lp, "v2", descriptor=desc)
        assert r.status_code == 422 and "loader" in r.json()["error"], r.text
        assert b.info()["version"] == "v1" and b.greedy(PROMPT) == reference["v1"]
        assert a.info()["version"] == "v3" and a.greedy(PROMPT) == reference["v3"]  # its mapping outlives the loader
        # the worker can still leave the dead loader's buffer: back to its own storage
        rb = a.admin("/admin/rollback")
        assert a.greedy(PROMPT) == reference[rb["version"]]
        lp.stop()
