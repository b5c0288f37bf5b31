"""Bytes changed after verify are never served: real worker processes, real safetensors files.

Each checkpoint's reference digests are computed from its bytes first (what verify records), then a
byte of a tensor is flipped; every path that re-reads a version (update, the worker's own rollback,
the restore after a failed write, the initial launch) must refuse it and never serve the changed
weights: the worker stays on the version it had, or refuses traffic when nothing good is left.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from support_check import expect_of, flip_byte
from support_worker import WorkerProcess, start_worker, write_token

from daemon.formats.checkpoint import tensor_table
from daemon.tinymodel import make_tiny_checkpoint

PROMPT = [1, 17, 42, 99, 5]


def flip_a_weight(directory: Path) -> None:
    table, _ = tensor_table(directory)
    loc = table["lm_head.weight"] if "lm_head.weight" in table else next(iter(table.values()))
    flip_byte(loc.file, loc.entry.start + loc.entry.nbytes // 3)


def update_body(version: str, directory: Path, expect: dict) -> dict:
    return {"version": version, "transport": "disk", "path": str(directory), "expect": expect}


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[WorkerProcess, dict[str, Path], dict[str, dict]]]:
    dirs = {v: make_tiny_checkpoint(tmp_path / v, seed=s) for v, s in (("A", 1), ("B", 2), ("C", 3))}
    expects = {v: expect_of(d).to_json() for v, d in dirs.items()}
    write_token(tmp_path)
    (tmp_path / "A.expect.json").write_text(json.dumps(expects["A"]))
    w = start_worker(dirs["A"], tmp_path / "token",
                     extra=["--version", "A", "--expect-file", str(tmp_path / "A.expect.json")])  # fmt: skip
    yield w, dirs, expects
    w.stop()


def test_update_to_changed_bytes_is_refused_and_the_old_version_keeps_serving(setup) -> None:  # type: ignore[no-untyped-def]
    w, dirs, expects = setup
    ok = w.admin("/admin/update", update_body("B", dirs["B"], expects["B"]))
    assert ok["digest_checked"] is True and ok["checked_files"] == 1
    on_b = w.greedy(PROMPT)
    flip_a_weight(dirs["C"])
    r = w.post("/admin/update", update_body("C", dirs["C"], expects["C"]), admin=True)
    assert r.status_code == 409, r.text  # refused for its data (the daemon keeps it RUNNING), not a failed write
    msg = r.json().get("error", r.text)
    assert "does not match the verified" in str(msg) and "restored B" in str(msg), msg
    info = w.info()
    assert info["version"] == "B" and info["state"] != "UNHEALTHY"
    if info["state"] != "RUNNING":
        w.admin("/admin/resume")
    assert w.greedy(PROMPT) == on_b


def test_worker_rollback_to_a_version_changed_since_refuses_and_stays(setup) -> None:  # type: ignore[no-untyped-def]
    w, dirs, expects = setup
    w.admin("/admin/update", update_body("B", dirs["B"], expects["B"]))
    w.admin("/admin/update", update_body("C", dirs["C"], expects["C"]))
    on_c = w.greedy(PROMPT)
    flip_a_weight(dirs["B"])
    r = w.post("/admin/rollback", {}, admin=True)
    assert r.status_code in (409, 500), r.text
    assert "does not match the verified" in r.text
    info = w.info()
    assert info["version"] == "C" and info["state"] != "UNHEALTHY"
    if info["state"] != "RUNNING":
        w.admin("/admin/resume")
    assert w.greedy(PROMPT) == on_c


def test_restore_after_a_failed_write_never_serves_changed_bytes(setup) -> None:  # type: ignore[no-untyped-def]
    """Both the new version and the one to restore were changed: nothing good to go back to, so the
    worker refuses traffic (UNHEALTHY) instead of serving either."""
    w, dirs, expects = setup
    w.admin("/admin/update", update_body("B", dirs["B"], expects["B"]))
    flip_a_weight(dirs["B"])
    flip_a_weight(dirs["C"])
    r = w.post("/admin/update", update_body("C", dirs["C"], expects["C"]), admin=True)
    assert r.status_code == 500 and "failed too" in r.text, r.text
    assert w.info()["state"] == "UNHEALTHY"
    c = w.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert c.status_code >= 500, c.text


def test_launch_on_changed_bytes_refuses_to_start(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "A", seed=1)
    (tmp_path / "A.expect.json").write_text(json.dumps(expect_of(d).to_json()))
    flip_a_weight(d)
    write_token(tmp_path)
    with pytest.raises(RuntimeError, match="does not match the verified"):
        start_worker(d, tmp_path / "token", extra=["--expect-file", str(tmp_path / "A.expect.json")], timeout=60)


def test_update_error_never_echoes_the_bytes_of_a_file_outside_the_checkpoint(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Finding 11: a shard symlinked to a readable secret (think /etc/shadow) used to come back as
    "header length <first 8 bytes as a number>", or as header JSON quoted in the message."""
    w, _dirs, _ = setup
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:$6$s3cr3tSALT$hash:19000:0:99999:7:::\n")
    as_json = tmp_path / "secret.json"
    as_json.write_bytes(b'{"t0p-s3cret-name": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}')
    for target in (secret, as_json):
        d = tmp_path / f"evil-{target.name}"
        d.mkdir()
        (d / "model.safetensors").symlink_to(target)
        r = w.post("/admin/update", {"version": "evil", "transport": "disk", "path": str(d)}, admin=True)
        assert r.status_code in (409, 422), r.text
        assert "leaving the checkpoint" in r.text, r.text
        raw = target.read_bytes()
        for needle in (b"root", b"s3cr3t", b"t0p-s3cret", str(int.from_bytes(raw[:8], "little")).encode()):
            assert needle not in r.content, r.text
    assert w.info()["version"] == "A"
