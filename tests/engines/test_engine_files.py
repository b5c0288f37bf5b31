"""The files a vLLM/SGLang worker is about to load, checked against the verified digests
(daemon/engines/engine_files.py): real safetensors files, real hashes.

A checkpoint changed after verify (a byte flipped in place, truncated, a weight file added, a
file replaced) is refused naming the file; one that changes after the check (between prepare
and the reload call) is seen by the last stat; a checked directory is hashed once per version
for every worker of the host, and a refused one is not hashed again until its files change.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support_check import expect_of, flip_byte

from daemon.engines import engine_files
from daemon.engines.engine_files import EngineFilesRefused, check_engine_files
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.base import Expect

pytestmark = pytest.mark.quick


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many files were hashed (the real hash runs; only counted)."""
    calls: list[int] = []
    real = engine_files.hash_files

    def counting(paths: Any, **kw: Any) -> Any:
        calls.append(len(paths))
        return real(paths, **kw)

    monkeypatch.setattr(engine_files, "hash_files", counting)
    engine_files._CACHE.clear()
    engine_files._FAILED.clear()
    yield calls
    engine_files._CACHE.clear()
    engine_files._FAILED.clear()


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, Expect]:
    d = make_tiny_checkpoint(tmp_path / "v1", seed=1)
    return d, expect_of(d)


def weights(d: Path) -> Path:
    return next(d.glob("*.safetensors"))


def test_verified_files_pass_once_and_are_reused_while_unchanged(ckpt: tuple[Path, Expect], hashed: list[int]) -> None:
    d, expect = ckpt
    checked = check_engine_files(str(d), "v1", expect)
    assert checked is not None and {f.path for f in checked.files} == {f.path for f in expect.files}
    assert checked.weak == () and checked.changed() is None
    assert check_engine_files(str(d), "v1", expect) is checked  # the second worker: no second hash
    assert len(hashed) == 1
    assert check_engine_files(str(d), "v1", Expect()) is None  # nothing to check against


def test_workers_checking_at_once_share_one_hash(ckpt: tuple[Path, Expect], hashed: list[int]) -> None:
    d, expect = ckpt
    out: list[object] = []
    threads = [threading.Thread(target=lambda: out.append(check_engine_files(str(d), "v1", expect))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(hashed) == 1 and len({id(o) for o in out}) == 1 and out[0] is not None


def test_a_byte_changed_in_place_is_refused_and_not_hashed_again_until_the_file_changes(
    ckpt: tuple[Path, Expect], hashed: list[int]
) -> None:
    d, expect = ckpt
    f = weights(d)
    flip_byte(f, f.stat().st_size // 2)  # same size: only the hash can tell
    for _ in range(2):
        with pytest.raises(EngineFilesRefused, match=rf"{f.name}: blake3 .* does not match the verified .*since verify"):
            check_engine_files(str(d), "v1", expect)
    assert len(hashed) == 1  # the second refusal came from the record: the files had not changed
    flip_byte(f, f.stat().st_size // 2)  # put back: the same bytes as verified, a new ctime
    assert check_engine_files(str(d), "v1", expect) is not None
    assert len(hashed) == 2


def test_truncated_or_missing_files_are_refused(ckpt: tuple[Path, Expect], hashed: list[int]) -> None:
    d, expect = ckpt
    f = weights(d)
    size = f.stat().st_size
    os.truncate(f, size - 8)
    with pytest.raises(EngineFilesRefused, match=rf"{f.name}: {size - 8} bytes, {size} verified"):
        check_engine_files(str(d), "v1", expect)
    f.unlink()
    with pytest.raises(EngineFilesRefused, match="No such file"):
        check_engine_files(str(d), "v1", expect)
    assert hashed == []  # refused on the stat alone


@pytest.mark.parametrize("extra", ["model-00002-of-00002.safetensors", "sub/pytorch_model.bin"])
def test_a_weight_file_verify_never_saw_is_refused(ckpt: tuple[Path, Expect], extra: str) -> None:
    d, expect = ckpt
    (d / extra).parent.mkdir(exist_ok=True)
    shutil.copy(weights(d), d / extra)  # an engine would load it along with the verified ones
    with pytest.raises(EngineFilesRefused, match=f"{extra}: a weight file that was not verified"):
        check_engine_files(str(d), "v1", expect)
    (d / "notes.txt").write_text("not a weight file")
    (d / extra).unlink()
    assert check_engine_files(str(d), "v1", expect) is not None  # other files are not loaded: fine


def test_changes_after_the_check_are_seen_by_the_last_look(ckpt: tuple[Path, Expect], tmp_path: Path) -> None:
    d, expect = ckpt
    f = weights(d)
    checked = check_engine_files(str(d), "v1", expect)
    assert checked is not None and checked.changed() is None
    f.write_bytes(f.read_bytes())  # the very same bytes, written again: not what was hashed
    assert checked.changed() == f"{f.name}: written to since it was checked"
    checked = check_engine_files(str(d), "v1", expect)  # hashed again: same bytes, passes
    assert checked is not None and checked.changed() is None
    replacement = tmp_path / "other"
    shutil.copy(f, replacement)
    os.replace(replacement, f)
    assert checked.changed() == f"{f.name}: replaced by another file since it was checked"
    checked = check_engine_files(str(d), "v1", expect)
    assert checked is not None
    (d / "late.safetensors").write_bytes(b"")
    assert checked.changed() == f"late.safetensors: a weight file that was not verified is in {d.resolve()}"


def test_crc_only_references_are_checked_and_reported_weak(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "old", seed=2)
    expect = expect_of(d, crc_only=True)  # format-1 rows: the registry knows only CRC32C
    checked = check_engine_files(str(d), "old", expect)
    assert checked is not None and set(checked.weak) == {f.path for f in expect.files}
    flip_byte(weights(d), 100)
    with pytest.raises(EngineFilesRefused, match="crc32c .* does not match"):
        check_engine_files(str(d), "old", expect)
