"""ipc: verify stages in the loader (one read): the loader hashes (strong + CRC32C) what it stages,
the daemon's checks compare and scan that very copy, and the version is exported to workers only
once every check passed; a version that fails any check is dropped from the loader."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support_checks import flip_bit_in_data, published, rewrite_tensors, shard_paths
from support_ipc import LoaderProcess, load_checkpoint, shm_dir
from support_wait import wait_until

from daemon.checks import CheckSettings, run_checks
from daemon.handoff.loader_client import LoaderClient, LoaderError
from daemon.manifest import load_manifest
from daemon.transport.ipc import IpcTransport
from daemon.transport.ipc_verify import OPENED_AHEAD, LoaderStager

pytestmark = pytest.mark.quick


@pytest.fixture
def loader(tmp_path: Path) -> Iterator[LoaderProcess]:
    with shm_dir() as d:
        lp = LoaderProcess(tmp_path / "loader.sock", d)
        yield lp
        lp.stop()


def _detail(report: Any) -> dict[str, dict[str, Any]]:
    return {r.name: r.detail for r in report.results}


def _versions(lp: LoaderProcess) -> dict[str, dict[str, Any]]:
    return {v["version"]: v for v in lp.client.status()["versions"]}


def test_verify_reads_once_into_the_loader_and_exports_only_after_every_check(
    loader: LoaderProcess, tmp_path: Path
) -> None:
    d = published(tmp_path / "v1", seed=1, shards=2)
    verified: list[str] = []
    stager = LoaderStager(loader.client, "v1", "cpu", on_verified=verified.append)
    report = run_checks(d, CheckSettings(isolate_checks=False), stager=stager)  # the canary on the copy: in-process
    assert report.ok, report.reason
    detail = _detail(report)
    assert detail["crc32c"]["staged"].startswith("in the loader on cpu (2 weight files")
    assert detail["finite"]["scanned"] == "staged copy on cpu"
    assert detail["forward"]["weights"] == "crc32c pass"
    manifest = load_manifest(d)
    assert report.digest == manifest.digest
    by_path = {f.path: f for f in manifest.files}
    for f in report.files:  # the loader's CRC32C and BLAKE3, equal to the publisher's
        assert (f.crc32c, f.hash) == (by_path[f.path].crc32c, by_path[f.path].hash), f.path
    assert verified == ["v1"]
    state = _versions(loader)["v1"]
    assert state["verified"] and state["digest"] == manifest.digest
    desc = loader.client.descriptor("v1")  # exported now, with the loader's own checked digests
    assert desc["checked"] is True
    with IpcTransport(desc, device="cpu") as tr:
        views = tr.views()
        for name, t in load_checkpoint(d).items():
            assert torch.equal(views[name], t), name


def test_the_check_process_closes_its_view_of_the_loaders_copy_after_answering(
    loader: LoaderProcess, tmp_path: Path
) -> None:
    """The check process's view of the loader's buffer is closed after the forward check answers
    (off the update's path, issue 41), never left mapped: the loader alone decides when it is freed."""
    from daemon.checks.isolation import CHECK_PROCESS

    d = published(tmp_path / "v1", seed=1, shards=2)
    report = run_checks(d, CheckSettings(), stager=LoaderStager(loader.client, "v1", "cpu"))
    assert report.ok, report.reason
    assert _detail(report)["forward"]["child_ms"]["staged_open"] > 0  # it did open the loader's copy
    segment = loader.client.descriptor("v1")["buffers"][0]["path"]
    child = CHECK_PROCESS._proc
    assert child is not None and child.poll() is None
    maps = Path(f"/proc/{child.pid}/maps")
    wait_until(lambda: segment not in maps.read_text(), timeout=30, what=f"the check process to unmap {segment}")
    # and it still answers: the next version's forward runs in the same child
    d2 = published(tmp_path / "v2", seed=2, shards=2)
    report = run_checks(d2, CheckSettings(), stager=LoaderStager(loader.client, "v2", "cpu"))
    assert report.ok and _detail(report)["forward"]["weights"] == "crc32c pass", report.reason
    assert CHECK_PROCESS._proc is child


def test_the_canary_in_the_check_process_reads_the_loaders_copy_not_the_files(
    loader: LoaderProcess, tmp_path: Path
) -> None:
    """Isolated checks (the default): the forward check runs in the check process, which opens the
    loader's buffer from its descriptor; the files are not read a second time (issue 41)."""
    d = published(tmp_path / "v1", seed=1, shards=2)
    report = run_checks(d, CheckSettings(), stager=LoaderStager(loader.client, "v1", "cpu"))
    assert report.ok, report.reason
    forward = _detail(report)["forward"]
    assert forward["weights"] == "crc32c pass"
    # where its time went, recorded with it: the steps in the check, the child's open of the copy
    assert set(forward["ms"]) == {"before", "skeleton", "views", "bind", "run", "after"} and forward["ms"]["run"] > 0, forward
    child = forward["child_ms"]
    assert child["staged_open"] > 0 and child["staged_release"] >= 0 and child["child"] >= forward["ms"]["run"], child
    nan = published(tmp_path / "nan", seed=2)
    rewrite_tensors(nan, lambda s: s["model.layers.0.mlp.up_proj.weight"].view(-1).__setitem__(77, float("nan")))
    no_finite = CheckSettings(enabled=tuple(n for n in CheckSettings().enabled if n != "finite"))
    report = run_checks(nan, no_finite, stager=LoaderStager(loader.client, "nan", "cpu"))
    assert (report.reason or "").startswith("forward: logits contain NaN/Inf"), report.reason  # on the copy
    assert "nan" not in _versions(loader)


def test_before_the_checks_pass_the_version_is_not_exported(loader: LoaderProcess, tmp_path: Path) -> None:
    d = published(tmp_path / "v1", seed=1)
    stager = LoaderStager(loader.client, "v1", "cpu")
    got = stager.stage(d, ["model.safetensors"], "blake3")
    assert got is not None
    with pytest.raises(LoaderError, match="not verified yet"):
        loader.client.descriptor("v1")
    got[1].release()
    stager.finish(False, [], None)
    assert "v1" not in _versions(loader)


@pytest.mark.parametrize("damage", ["nan", "flipped bit"])
def test_a_version_failing_a_check_is_dropped_from_the_loader(
    loader: LoaderProcess, tmp_path: Path, damage: str
) -> None:
    d = published(tmp_path / "bad", seed=2, shards=2)
    if damage == "nan":
        rewrite_tensors(d, lambda s: next(iter(s.values())).view(-1).__setitem__(9, float("nan")),
                        file="model-00001-of-00002.safetensors")  # fmt: skip
    else:
        flip_bit_in_data(shard_paths(d)[1])
    verified: list[str] = []
    report = run_checks(d, CheckSettings(), stager=LoaderStager(loader.client, "bad", "cpu", verified.append))
    assert not report.ok and report.reason is not None
    assert report.reason.startswith("finite: " if damage == "nan" else "crc32c: ")
    assert verified == [] and "bad" not in _versions(loader)


def test_without_a_loader_verify_stages_in_this_process(tmp_path: Path) -> None:
    d = published(tmp_path / "v1", seed=1)
    down = LoaderClient(tmp_path / "no-loader.sock", timeout=1)
    report = run_checks(d, CheckSettings(), stager=LoaderStager(down, "v1", "cpu"))
    assert report.ok, report.reason
    assert _detail(report)["crc32c"]["staged"].startswith("on cpu")


def test_a_version_the_loader_already_holds_is_hashed_here_not_confirmed(
    loader: LoaderProcess, tmp_path: Path
) -> None:
    d = published(tmp_path / "v1", seed=1)
    loader.client.stage("v1", str(d))  # staged earlier, e.g. by a rollout; now re-verified
    report = run_checks(d, CheckSettings(), stager=LoaderStager(loader.client, "v1", "cpu"))
    assert report.ok, report.reason
    assert _detail(report)["crc32c"]["staged"].startswith("on cpu")
    assert _versions(loader)["v1"]["verified"]


def test_a_version_left_held_back_by_an_unfinished_verify_is_staged_afresh(
    loader: LoaderProcess, tmp_path: Path
) -> None:
    d = published(tmp_path / "v1", seed=1)
    first = LoaderStager(loader.client, "v1", "cpu")
    got = first.stage(d, ["model.safetensors"], "blake3")  # then the daemon died: no finish
    assert got is not None
    got[1].release()
    report = run_checks(d, CheckSettings(), stager=LoaderStager(loader.client, "v1", "cpu"))
    assert report.ok, report.reason
    assert _detail(report)["crc32c"]["staged"].startswith("in the loader")
    assert _versions(loader)["v1"]["verified"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 run)")
def test_on_a_gpu_verify_reads_into_the_loaders_gpu_buffer(tmp_path: Path) -> None:
    d = published(tmp_path / "v1", seed=1, shards=2, dtype="bfloat16")
    nan = published(tmp_path / "nan", seed=2, dtype="bfloat16")
    rewrite_tensors(nan, lambda s: s["model.layers.0.mlp.up_proj.weight"].view(-1).__setitem__(77, float("nan")))
    with shm_dir() as shm:
        lp = LoaderProcess(tmp_path / "loader.sock", shm, device="cuda:0")
        try:
            settings = CheckSettings(forward_device="cuda:0", ipc_enabled=True, isolate_checks=False)
            report = run_checks(d, settings, stager=LoaderStager(lp.client, "v1", "cuda:0"))
            assert report.ok, report.reason
            detail = _detail(report)
            assert detail["crc32c"]["staged"].startswith("in the loader on cuda:0"), detail["crc32c"]
            assert detail["finite"]["scanned"] == "staged copy on cuda:0"
            assert detail["forward"]["weights"] == "crc32c pass"
            assert lp.client.descriptor("v1")["kind"] == "cuda"
            isolated = CheckSettings(forward_device="cuda:0", ipc_enabled=True)  # the canary in the check process
            v2 = published(tmp_path / "v2", seed=3, shards=2, dtype="bfloat16")
            report = run_checks(v2, isolated, stager=LoaderStager(lp.client, "v2", "cuda:0"))
            assert report.ok and _detail(report)["forward"]["weights"] == "crc32c pass", _detail(report)["forward"]
            # both opened the loader's buffer while it filled (issue 41): the daemon's view and the
            # check process's, each taken then instead of opened; nothing opened ahead is left over
            assert "opened here while the loader read" in _detail(report)["crc32c"]["staged"], _detail(report)["crc32c"]
            assert _detail(report)["forward"]["staged_opened_ahead"] is True, _detail(report)["forward"]
            assert OPENED_AHEAD.held() == 0
            report = run_checks(nan, settings, stager=LoaderStager(lp.client, "nan", "cuda:0"))
            assert (report.reason or "").startswith("finite: ") and "element 77" in (report.reason or "")
            assert "nan" not in _versions(lp)
        finally:
            lp.stop()


def test_rollout_staging_takes_over_a_version_a_restarted_daemon_never_confirmed(
    loader: LoaderProcess, tmp_path: Path
) -> None:
    from daemon.transport.base import Expect, ExpectedFile, Outgoing, SenderOptions
    from daemon.transport.ipc_stage import IpcSender

    d = published(tmp_path / "v1", seed=1)
    got = LoaderStager(loader.client, "v1", "cpu").stage(d, ["model.safetensors"], "blake3")
    assert got is not None
    got[1].release()  # staged for a verify, never confirmed (the daemon died)
    m = load_manifest(d)
    expect = Expect(digest=m.digest, tensors=21, files=tuple(
        ExpectedFile(f.path, f.bytes, {"crc32c": f.crc32c, f.hash_alg or "blake3": f.hash}) for f in m.files))  # fmt: skip
    sender = IpcSender(SenderOptions(state_dir=tmp_path, loader_socket=str(loader.socket_path)))
    prepared = sender.prepare(Outgoing("v1", str(d), expect))
    desc = prepared.request.source["descriptor"]
    assert desc["checked"] is True and desc["version"] == "v1"
