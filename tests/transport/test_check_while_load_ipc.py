"""Check while loading, ipc: the loader hashes what it stages itself, workers tie the loader's digests to the registry's.

Real loader process (shared memory), real worker processes, real safetensors files. Also the loader's
point-11 findings: a huge pid in `acquire`, predictable segment names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support_check import expect_of, flip_byte
from support_ipc import LoaderProcess, shm_dir
from support_worker import WorkerProcess, start_worker, write_token

from daemon.formats.checkpoint import tensor_table
from daemon.handoff.descriptor import DescriptorError
from daemon.handoff.loader_client import LoaderError
from daemon.handoff.shm import segment_name
from daemon.loader.store import _pid_alive
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick

PROMPT = [1, 17, 42, 99, 5]


def flip_a_weight(directory: Path) -> None:
    table, _ = tensor_table(directory)
    loc = table["lm_head.weight"]
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 3)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("ipccheck")
    for name, seed, shards in (("v1", 1, 1), ("v2", 2, 2), ("v3", 3, 1), ("v4", 4, 1)):
        make_tiny_checkpoint(r / name, seed=seed, shards=shards)
    write_token(r)
    return r


@pytest.fixture(scope="module")
def expects(root: Path) -> dict[str, dict[str, Any]]:
    """What verify recorded, before anything was changed."""
    return {v: expect_of(root / v).to_json() for v in ("v1", "v2", "v3", "v4")}


@pytest.fixture(scope="module")
def loader(root: Path) -> Iterator[LoaderProcess]:
    with shm_dir() as d:
        lp = LoaderProcess(root / "loader.sock", d, "--max-versions", "8")
        yield lp
        lp.stop()


@pytest.fixture(scope="module")
def w(root: Path) -> Iterator[WorkerProcess]:
    proc = start_worker(root / "v1", root / "token", extra=["--version", "v1"])
    yield proc
    proc.stop()


def update(w: WorkerProcess, version: str, desc: dict[str, Any], expect: dict[str, Any]) -> Any:
    return w.post("/admin/update", {"version": version, "transport": "ipc", "descriptor": desc, "expect": expect},
                  admin=True)  # fmt: skip


def test_loader_hashes_what_it_stages_and_refuses_a_mismatch(root: Path, loader: LoaderProcess, expects: dict) -> None:
    c = loader.client
    info = c.call("stage", version="v2", path=str(root / "v2"), digest="blake3:" + "0" * 64, files=expects["v2"]["files"])
    assert info["checked"] is True
    desc = c.descriptor("v2")
    assert desc["digest"] is None  # a content digest that is not the reference files' own: not repeated
    ref = {f["path"]: f["digests"]["blake3"] for f in expects["v2"]["files"]}
    assert {f["path"]: f["hash"] for f in desc["files"]} == {p: h for p, h in ref.items() if p.endswith(".safetensors")}
    # without a reference the loader still computes, but never repeats the client's digest claim
    c.call("stage", version="v3", path=str(root / "v3"), digest="blake3:" + "1" * 64)
    d3 = c.descriptor("v3")
    assert d3["checked"] is False and d3["digest"] is None and len(d3["files"]) == 1
    # bytes changed after verify: the stage is refused, nothing stays staged
    ex4 = expects["v4"]["files"]
    flip_a_weight(root / "v4")
    with pytest.raises(LoaderError, match="check while staging: .*does not match the verified"):
        c.call("stage", version="v4", path=str(root / "v4"), files=ex4)
    assert "v4" not in {v["version"] for v in c.status()["versions"]}


def test_worker_serves_only_what_the_loader_checked(w: WorkerProcess, loader: LoaderProcess, root: Path,
                                                     expects: dict) -> None:  # fmt: skip
    c = loader.client
    c.call("stage", version="v2", path=str(root / "v2"), files=expects["v2"]["files"])
    r = update(w, "v2", c.descriptor("v2"), expects["v2"])
    assert r.status_code == 200, r.text
    assert r.json()["digest_checked"] is True and r.json()["check_by"] == "loader"
    on_v2 = w.greedy(PROMPT)
    # v3 staged without a reference from bytes that no longer match what verify recorded
    v3_expect = expect_of(root / "v3").to_json()
    flip_a_weight(root / "v3")
    c.call("stage", version="v3b", path=str(root / "v3"))
    r = update(w, "v3b", c.descriptor("v3b"), v3_expect)
    assert r.status_code in (409, 422) and "changed since it was verified" in r.text, r.text
    assert w.info()["version"] == "v2" and w.greedy(PROMPT) == on_v2
    # a descriptor whose claims were edited by the sender: the loader's own answer is used/compared
    forged = c.descriptor("v3b")
    forged["files"] = [{"path": f["path"], "bytes": f["bytes"], "alg": "blake3", "hash": f["digests"]["blake3"]}
                       for f in v3_expect["files"] if f["path"].endswith(".safetensors")]  # fmt: skip
    forged["checked"] = True
    r = update(w, "v3b", forged, v3_expect)
    assert r.status_code in (409, 422) and "changed since it was verified" in r.text, r.text
    # a descriptor pointing at a segment file someone else made: refused, never mapped
    fake = c.descriptor("v2")
    own = Path(fake["buffers"][0]["path"])
    mine = own.with_name(own.name + "-x")
    mine.write_bytes(own.read_bytes())
    fake["buffers"][0]["path"] = str(mine)
    r = update(w, "v2", fake, expects["v2"])
    assert r.status_code in (409, 422) and "not the loader's" in r.text, r.text
    # no loader to vouch for it: refused
    lone = c.descriptor("v2")
    lone["loader"] = None
    r = update(w, "v2", lone, expects["v2"])
    assert r.status_code in (409, 422) and "no loader" in r.text, r.text
    assert w.info()["version"] == "v2" and w.greedy(PROMPT) == on_v2


def test_shm_mapping_refuses_foreign_or_writable_segments(tmp_path: Path) -> None:
    from daemon.handoff.shm import ShmMapping

    seg = tmp_path / "hotswap-1-1-x"
    seg.write_bytes(b"\0" * 512)
    os.chmod(seg, 0o600)
    with pytest.raises(DescriptorError, match="writable"):
        ShmMapping(str(seg), 512, trusted_uids=frozenset({os.getuid()}))
    os.chmod(seg, 0o400)
    with pytest.raises(DescriptorError, match="belongs to uid"):
        ShmMapping(str(seg), 512, trusted_uids=frozenset({os.getuid() + 12345}))
    m = ShmMapping(str(seg), 512, trusted_uids=frozenset({os.getuid()}))
    assert m.tensor().numel() == 512
    m.close()


def test_huge_pid_in_acquire_is_refused_and_breaks_nothing(loader: LoaderProcess, root: Path) -> None:
    c = loader.client
    c.call("stage", version="v1", path=str(root / "v1"))
    for pid in (2**70, 2**31, 10**9):
        with pytest.raises(LoaderError, match="process id"):
            c.acquire("v1", "evil", pid=pid)
    assert not _pid_alive(2**70) and not _pid_alive(-5)
    st = c.status()  # status, drop and staging still work
    assert any(v["version"] == "v1" and not v["holders"] for v in st["versions"])
    assert c.drop("v1")["freed"] is True
    c.call("stage", version="v1", path=str(root / "v1"))


def test_segment_names_cannot_be_guessed_and_squatting_does_not_block_staging(loader: LoaderProcess, root: Path) -> None:
    a, b = segment_name(1234, 1, "v"), segment_name(1234, 1, "v")
    assert a != b and len(a) > len("hotswap-1234-1--v") + 30
    # squat every name the old scheme would have used next
    for seq in range(1, 40):
        for v in ("sq",):
            p = loader.shm_dir / f"hotswap-{loader.proc.pid}-{seq}-{v}"
            p.write_bytes(b"")
    loader.client.call("stage", version="sq", path=str(root / "v1"))
    path = loader.client.descriptor("sq")["buffers"][0]["path"]
    st = os.stat(path)
    assert st.st_mode & 0o777 == 0o400 and st.st_uid == os.getuid()


def test_cuda_import_checks_the_real_allocation_size_not_the_descriptors_claim() -> None:
    """The CUDA worker asks the driver how big the allocation behind the handle is (cuMemGetAddressRange)
    and refuses a descriptor that claims more, or a handle that maps into the middle of one."""
    from daemon.handoff.cuda import CudaIpcError, check_imported_range

    check_imported_range(0x7000, 0x7000, 4096, 4096)
    check_imported_range(0x7000, 0x7000, 8192, 4096)
    with pytest.raises(CudaIpcError, match="claims 8192 bytes, the allocation behind the handle has 4096"):
        check_imported_range(0x7000, 0x7000, 4096, 8192)
    with pytest.raises(CudaIpcError, match="inside an allocation"):
        check_imported_range(0x7100, 0x7000, 8192, 256)
    with pytest.raises(CudaIpcError, match="positive"):
        check_imported_range(0x7000, 0x7000, 4096, 0)
