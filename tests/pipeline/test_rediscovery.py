"""A watched folder and the coordinator in-process (real LocalSource, real SQLite, real tiny
checkpoints and checks): labels that arrive again, conflicts, `reverify`, and folders that try
to lead discovery astray (symlinks out of the folder, a FIFO in place of a manifest).

The daemon-level proofs with real processes are test_commit_stall.py (a stalled writer deploys)
and test_rollout_faults.py."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import publish_tiny, wait_until

from daemon.checks import CheckSettings
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.pipeline.coordinator import Coordinator
from daemon.registry import Registry, status
from daemon.registry import queries as q
from daemon.registry.models import Event
from daemon.registry.status import CheckpointStatus as C
from daemon.sources.commit import CommitDetector
from daemon.sources.local import LocalSource, LocalSourceConfig

CHEAP = CheckSettings(enabled=("manifest", "headers", "crc32c"))
pytestmark = [pytest.mark.timeout(120), pytest.mark.quick]


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    r.upgrade()
    yield r
    r.close()


@pytest.fixture
def pipeline(tmp_path: Path, reg: Registry) -> Iterator[Callable[..., tuple[Coordinator, LocalSource]]]:
    made: list[tuple[Coordinator, LocalSource]] = []

    def make(**source: Any) -> tuple[Coordinator, LocalSource]:
        coord = Coordinator(reg, CHEAP)
        src = LocalSource(LocalSourceConfig(path=str(tmp_path / "watch"), **{"rescan_interval_s": 60.0, **source}),
                          coord.intake)  # fmt: skip
        coord.sources = {src.label: src}
        coord.start()
        src.start()
        made.append((coord, src))
        return coord, src

    yield make
    for coord, src in made:
        src.stop()
        coord.stop()


def row(reg: Registry, version: str) -> dict[str, Any] | None:
    with reg.session() as s:
        c = q.get_checkpoint(s, version)
        return None if c is None else {"id": c.id, "status": c.status, "message": c.status_message, "uri": c.uri}


def events(reg: Registry, version: str) -> list[tuple[str, dict[str, Any]]]:
    with reg.session() as s:
        c = q.get_checkpoint(s, version)
        assert c is not None
        return [(e.to_state, e.detail or {}) for e in
                s.query(Event).filter(Event.checkpoint_id == c.id, Event.worker.is_(None)).order_by(Event.id)]  # fmt: skip


def wait_status(reg: Registry, version: str, want: str, timeout: float = 60) -> dict[str, Any]:
    return wait_until(lambda: (r := row(reg, version)) is not None and r["status"] == want and r, timeout,
                      what=f"{version} {want} (is {row(reg, version)})")  # fmt: skip


def settle(coord: Coordinator, src: LocalSource, name: str) -> None:
    """A rescan, then until the source has checked `name` again (registering what it emits, in
    the same call) and the coordinator has nothing left to do: then nothing more will happen."""
    before = src.looks(name)
    src.rescan()
    wait_until(lambda: src.looks(name) > before, 30, what=f"the source to check {name!r} again")
    wait_until(coord.idle, 60, what="the coordinator idle")


def corrupt(path: Path) -> bytes:
    data = path.read_bytes()
    bad = bytearray(data)
    bad[-1] ^= 0xFF
    path.write_bytes(bytes(bad))
    return data


def test_a_rejected_checkpoint_is_looked_at_again_when_its_files_change(
    tmp_path: Path, reg: Registry, pipeline: Callable[..., tuple[Coordinator, LocalSource]]
) -> None:
    """Finding 8: a checkpoint rejected for a bad file is verified again once the file is fixed."""
    build = tmp_path / "build"
    publish_tiny(build, seed=1, version="fixme")
    good = corrupt(build / "model.safetensors")
    _, src = pipeline()
    os.replace(build, src.root / "fixme")
    wait_status(reg, "fixme", "rejected")
    (src.root / "fixme" / "model.safetensors").write_bytes(good)  # the writer finishes its copy
    wait_status(reg, "fixme", "verified")
    states = [to for to, _ in events(reg, "fixme")]
    assert states == ["discovered", "verifying", "rejected", "discovered", "verifying", "verified"], states
    assert "files changed after it was rejected" in events(reg, "fixme")[3][1]["message"]


def test_republishing_the_same_name_is_noticed_and_a_restart_changes_nothing(
    tmp_path: Path, reg: Registry, pipeline: Callable[..., tuple[Coordinator, LocalSource]]
) -> None:
    coord, src = pipeline()
    build = tmp_path / "build"
    publish_tiny(build, seed=2, version="again")
    corrupt(build / "model.safetensors")
    os.replace(build, src.root / "again")
    wait_status(reg, "again", "rejected")
    shutil.rmtree(src.root / "again")
    publish_tiny(tmp_path / "build2", seed=3, version="again")  # re-published, same name, fixed
    os.replace(tmp_path / "build2", src.root / "again")
    wait_status(reg, "again", "verified")
    # a daemon restart re-discovers the folder: same files, nothing happens
    n = len(events(reg, "again"))
    src.stop()
    coord.stop()
    coord2, src2 = pipeline()
    settle(coord2, src2, "again")
    assert len(events(reg, "again")) == n and row(reg, "again")["status"] == "verified"  # type: ignore[index]


def test_a_change_under_a_verified_label_is_recorded_and_reverify_checks_it_again(
    tmp_path: Path, reg: Registry, pipeline: Callable[..., tuple[Coordinator, LocalSource]]
) -> None:
    coord, src = pipeline()
    publish_tiny(tmp_path / "b", seed=4, version="kept")
    os.replace(tmp_path / "b", src.root / "kept")
    wait_status(reg, "kept", "verified")
    corrupt(src.root / "kept" / "model.safetensors")  # changed after verify
    wait_until(lambda: "files changed after it was verified" in (row(reg, "kept") or {}).get("message", ""), 30,
               what="the change recorded")  # fmt: skip
    assert row(reg, "kept")["status"] == "verified"  # type: ignore[index]  # the verdict stands until reverify
    assert coord.reverify("kept") == "verified"
    row_after = wait_status(reg, "kept", "rejected")
    assert "crc32c" in (row_after["message"] or "") or "model.safetensors" in (row_after["message"] or "")
    with pytest.raises(LookupError, match="unknown version 'nope'"):
        coord.reverify("nope")
    with reg.session() as s:  # the serving version is never re-verified in place
        c = q.get_checkpoint(s, "kept")
        assert c is not None
        status.move(s, c, C.DEPLOYED, "pretend it serves")
    with pytest.raises(ValueError, match="is deployed"):
        coord.reverify("kept")


def test_another_directory_claiming_a_label_first_is_a_recorded_conflict(
    tmp_path: Path, reg: Registry, pipeline: Callable[..., tuple[Coordinator, LocalSource]]
) -> None:
    """Point 11: `squatter/` names itself step-100 first; the real step-100 is not dropped silently."""
    coord, src = pipeline()
    publish_tiny(tmp_path / "s", seed=5, version="step-100")
    os.replace(tmp_path / "s", src.root / "squatter")
    wait_status(reg, "step-100", "verified")
    publish_tiny(tmp_path / "r", seed=6, version="step-100")
    os.replace(tmp_path / "r", src.root / "step-100")
    real_uri = (src.root / "step-100").resolve().as_uri()

    def conflicts() -> list[dict[str, Any]]:
        return [d["conflict"] for _, d in events(reg, "step-100") if "conflict" in d]

    wait_until(lambda: conflicts(), 30, what="the conflict recorded")
    (c,) = conflicts()
    assert c["uri"] == real_uri and c["directory"] == str(src.root / "step-100")
    r = row(reg, "step-100")
    assert r is not None and r["uri"].endswith("/squatter") and "also claimed by" in r["message"]
    settle(coord, src, "step-100")  # seen again: recorded once
    assert len(conflicts()) == 1


def test_symlinked_checkpoints_leading_out_of_the_folder_are_refused(
    tmp_path: Path, reg: Registry, pipeline: Callable[..., tuple[Coordinator, LocalSource]]
) -> None:
    outside = tmp_path / "elsewhere"
    publish_tiny(outside / "ckpt", seed=7, version="outside-dir")
    publish_tiny(tmp_path / "f", seed=8, version="outside-file")
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    coord, src = pipeline()
    (src.root / "linked").symlink_to(outside / "ckpt", target_is_directory=True)
    (tmp_path / "f" / "tokenizer_config.json").unlink(missing_ok=True)
    (tmp_path / "f" / "tokenizer_config.json").symlink_to(secret)
    os.replace(tmp_path / "f", src.root / "with-link")
    publish_tiny(tmp_path / "ok", seed=9, version="inside")
    os.replace(tmp_path / "ok", src.root / "inside")
    (src.root / "alias").symlink_to(src.root / "inside", target_is_directory=True)  # inside the folder: fine
    src.rescan()
    wait_status(reg, "inside", "verified")
    wait_until(lambda: len(src._refused) == 2, 10, what="both refused")
    assert "linked is a symlink to" in src._refused[src.root / "linked"]
    assert "outside the watched folder" in src._refused[src.root / "linked"]
    assert "with-link/tokenizer_config.json is a symlink to" in src._refused[src.root / "with-link"]
    assert row(reg, "outside-dir") is None and row(reg, "outside-file") is None
    assert set(src.describe()["refused"]) == {"linked", "with-link"}


def test_a_fifo_in_place_of_a_manifest_never_hangs_discovery(
    tmp_path: Path, reg: Registry, pipeline: Callable[..., tuple[Coordinator, LocalSource]]
) -> None:
    (tmp_path / "w").mkdir()
    publish_tiny(tmp_path / "w" / "fifo", seed=10, version="fifo")
    (tmp_path / "w" / "fifo" / MANIFEST_NAME).unlink()
    os.mkfifo(tmp_path / "w" / "fifo" / MANIFEST_NAME)
    assert not CommitDetector(["manifest"]).check(tmp_path / "w" / "fifo").committed  # returns at once
    _, src = pipeline()
    os.replace(tmp_path / "w" / "fifo", src.root / "fifo")
    publish_tiny(tmp_path / "n", seed=11, version="next")
    os.replace(tmp_path / "n", src.root / "next")
    src.rescan()
    wait_status(reg, "next", "verified")  # the source kept going
    assert row(reg, "fifo") is None


def test_reverify_without_a_running_daemon_queues_it_for_the_next_start(tmp_path: Path, reg: Registry) -> None:
    from conftest import hotswap_cli, make_config_file

    with reg.session() as s:
        c = status.create(s, version="offline", source="t", uri="file:///x/offline", local_path=str(tmp_path / "x"),
                          commit_signal="manifest")  # fmt: skip
        assert c is not None
        status.move(s, c, C.VERIFYING)
        status.move(s, c, C.REJECTED, "crc32c mismatch")
    cfg = make_config_file(tmp_path / "c.toml", database={"url": str(reg.engine.url)},
                           daemon={"state_dir": str(tmp_path / "state")})  # fmt: skip
    out = hotswap_cli("reverify", "offline", "-c", str(cfg))
    assert out.returncode == 0, out.stderr
    assert "was rejected; queued: the daemon verifies it at its next start" in out.stdout
    assert row(reg, "offline")["status"] == "discovered"  # type: ignore[index]
    assert Coordinator(reg, CHEAP).resume_unfinished() == ["offline"]
