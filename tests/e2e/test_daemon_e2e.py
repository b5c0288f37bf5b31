"""The real daemon as a subprocess, against SQLite and (when configured) PostgreSQL."""

from __future__ import annotations

import json
import shutil
import threading
import time

from conftest import hotswap_cli, publish_tiny, wait_until

from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import load_manifest, publish
from daemon.tinymodel import make_tiny_checkpoint


def test_published_checkpoint_becomes_verified_and_shows_in_history(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url)
    make_tiny_checkpoint(tmp_path / "build" / "step-100", seed=1)
    shutil.copytree(tmp_path / "build" / "step-100", d.watch_dir / "step-100")
    publish(d.watch_dir / "step-100", version="step-100", step=100)

    row = d.wait_status("step-100", "verified")
    manifest = load_manifest(d.watch_dir / "step-100")
    assert row["digest"] == manifest.digest
    assert row["total_bytes"] == manifest.total_bytes
    assert row["step"] == 100
    assert row["commit_signal"] == "manifest"
    assert row["tensor_count"] == 21
    assert row["verified_at"] >= row["discovered_at"]

    with d.registry.session() as s:
        from daemon.registry import queries as q

        ckpt = q.get_checkpoint(s, "step-100")
        assert sorted(f.path for f in ckpt.files) == sorted(f.path for f in manifest.files)
        assert {f.path: f.crc32c for f in ckpt.files} == {f.path: f.crc32c for f in manifest.files}
        # the strong hashes, as computed from the bytes (equal to the signed ones), are the reference
        assert {f.path: (f.hash_alg, f.hash) for f in ckpt.files} == {
            f.path: ("blake3", f.hash) for f in manifest.files
        }
        checks = q.checks_of(s, ckpt.id)
        assert [c.name for c in checks] == [
            "manifest",
            "headers",
            "crc32c",
            "compat",
            "finite",
            "headroom",
            "forward",
        ]
        assert all(c.ok for c in checks)
        # nothing serving yet: compat did not run, and its row says so
        assert [c.status for c in checks] == ["pass", "pass", "pass", "skipped", "pass", "pass", "pass"]

    out = hotswap_cli("history", "--json", "-c", str(d.config_path))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["version"], r["status"]) for r in rows] == [("step-100", "verified")]

    status = d.get("/status").json()
    assert status["checkpoints"] == {"verified": 1}
    metrics = d.get("/metrics").text
    assert 'hotswap_checkpoints{status="verified"} 1.0' in metrics
    assert "hotswap_verify_seconds_count" in metrics
    assert d.get("/health").json() == {"ok": True}


def test_crc_mismatch_is_rejected_naming_the_file(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url)
    src = tmp_path / "bad"
    publish_tiny(src, seed=2, version="bad-crc")
    # Same size, different bytes: the size check passes, only the CRC can catch it.
    weights = src / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    shutil.copytree(src, d.watch_dir / "bad-crc")

    row = d.wait_status("bad-crc", "rejected")
    assert row["status_message"].startswith("crc32c:")
    assert "model.safetensors" in row["status_message"]
    assert d.alive()


def test_crc_preserving_forgery_in_a_signed_checkpoint_is_rejected_by_the_daemon(db_url, daemon_factory, tmp_path):
    from support_checks import forge_keeping_crc

    from daemon.checks.signatures import HmacSigner

    key = tmp_path / "trainer.key"
    key.write_text("trainer-secret\n")
    d = daemon_factory(db_url, checks={"hmac_keys": {"trainer-1": str(key)}, "require_manifest": True})
    src = make_tiny_checkpoint(tmp_path / "build" / "forged", seed=3)
    publish(src, version="forged", signer=HmacSigner("trainer-1", b"trainer-secret"))
    forge_keeping_crc(src / "model.safetensors")  # lm_head negated, every CRC and the signature intact
    shutil.copytree(src, d.watch_dir / "forged")
    row = d.wait_status("forged", "rejected")
    assert row["status_message"].startswith("crc32c: model.safetensors: blake3 does not match")
    assert d.alive()


def test_slow_copy_registers_once_after_the_manifest_lands(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url, sources=None)
    src = tmp_path / "src"
    publish_tiny(src, seed=3, shards=2, version="slow-1")
    dst = d.watch_dir / "slow-1"
    dst.mkdir()
    files = sorted(p for p in src.iterdir() if p.name != MANIFEST_NAME)
    manifest_landed: list[float] = []

    def copy_slowly() -> None:
        # Every file grows in chunks over ~5 s; the manifest is copied last.
        chunks = {p: p.read_bytes() for p in files}
        handles = {p: open(dst / p.name, "wb") for p in files}  # noqa: SIM115
        steps = 10
        for i in range(steps):
            for p, data in chunks.items():
                part = data[len(data) * i // steps : len(data) * (i + 1) // steps]
                handles[p].write(part)
                handles[p].flush()
            time.sleep(0.5)
        for h in handles.values():
            h.close()
        manifest_landed.append(time.time())
        shutil.copy(src / MANIFEST_NAME, dst / MANIFEST_NAME)

    writer = threading.Thread(target=copy_slowly)
    writer.start()
    while writer.is_alive():
        assert d.row("slow-1") is None, "registered before its manifest landed"
        time.sleep(0.1)
    writer.join()
    row = d.wait_status("slow-1", "verified")
    assert row["discovered_at"].timestamp() >= manifest_landed[0] - 0.01
    assert [r["version"] for r in d.history()] == ["slow-1"]


def test_sigkill_mid_verify_finishes_on_restart_without_duplicates(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url, env={"HOTSWAP_TEST_VERIFY_DELAY_S": "30"}, hooked=True)
    publish_tiny(tmp_path / "k", seed=4, version="killed-1")
    shutil.copytree(tmp_path / "k", d.watch_dir / "killed-1")
    d.wait_status("killed-1", "verifying")
    d.kill()
    assert d.row("killed-1")["status"] == "verifying"

    d.env["HOTSWAP_TEST_VERIFY_DELAY_S"] = "0"
    d.start()
    row = d.wait_status("killed-1", "verified")
    assert [r["version"] for r in d.history()] == ["killed-1"]
    with d.registry.session() as s:
        from daemon.registry import queries as q

        checks = q.checks_of(s, row["checkpoint_id"])
        # the interrupted attempt left no half-written check rows behind
        assert [c.name for c in checks].count("manifest") == 1


def test_restart_does_not_register_known_versions_again(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url)
    publish_tiny(tmp_path / "a", seed=5, version="known-1")
    shutil.copytree(tmp_path / "a", d.watch_dir / "known-1")
    d.wait_status("known-1", "verified")
    d.restart()
    publish_tiny(tmp_path / "b", seed=6, version="known-2")
    shutil.copytree(tmp_path / "b", d.watch_dir / "known-2")
    d.wait_status("known-2", "verified")
    assert [r["version"] for r in d.history()] == ["known-1", "known-2"]
    assert "already registered" in d.log()


def test_same_content_under_a_new_version_is_a_duplicate(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url)
    publish_tiny(tmp_path / "a", seed=7, version="orig")
    shutil.copytree(tmp_path / "a", d.watch_dir / "orig")
    d.wait_status("orig", "verified")
    shutil.copytree(tmp_path / "a", d.watch_dir / "copy")
    publish(d.watch_dir / "copy", version="copy")
    row = d.wait_status("copy", "duplicate")
    assert "orig" in row["status_message"]


def test_directory_committed_while_daemon_was_down_is_found_at_start(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url)
    d.stop()
    publish_tiny(d.watch_dir / "offline-1", seed=8)
    d.start()
    d.wait_status("offline-1", "verified")


def test_marker_and_index_signals(db_url, daemon_factory, tmp_path):
    d = daemon_factory(db_url, sources=[{"path": "checkpoints", "quiet_period_s": 0.3}])
    # relative source path: resolved against the daemon's working directory
    marker_dir = d.workdir / "checkpoints" / "marker-1"
    make_tiny_checkpoint(marker_dir, seed=9)
    (marker_dir / "_SUCCESS").write_text("")
    index_dir = d.workdir / "checkpoints" / "index-1"
    make_tiny_checkpoint(index_dir, seed=10, shards=2)
    r1 = d.wait_status("marker-1", "verified")
    r2 = d.wait_status("index-1", "verified")
    assert (r1["commit_signal"], r2["commit_signal"]) == ("marker", "index")
    # no manifest: the verify stage's hashes of the bytes are recorded and become the reference
    import blake3

    from daemon.registry import queries as q

    with d.registry.session() as s:
        files = q.get_checkpoint(s, "index-1").files
        assert {f.path for f in files} == {p.name for p in index_dir.iterdir()}
        for f in files:
            assert (f.hash_alg, f.hash) == ("blake3", blake3.blake3((index_dir / f.path).read_bytes()).hexdigest())
    assert r2["digest"].startswith("blake3:")
    wait_until(lambda: d.get("/status").json()["checkpoints"].get("verified") == 2, 5)


def test_systemd_notify_ready_and_json_logs_carry_the_version(db_url, daemon_factory, tmp_path):
    import socket

    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(30)
    try:
        d = daemon_factory(db_url, env={"NOTIFY_SOCKET": str(sock_path)}, daemon={"watchdog_interval_s": 0.5})
        messages: list[str] = []
        while not (any(m.startswith("READY=1") for m in messages) and any("WATCHDOG=1" in m for m in messages)):
            messages.append(sock.recv(4096).decode())  # times out (fails) after 30 s
    finally:
        sock.close()
    publish_tiny(tmp_path / "j", seed=11, version="json-1")
    shutil.copytree(tmp_path / "j", d.watch_dir / "json-1")
    d.wait_status("json-1", "verified")
    lines = [json.loads(ln) for ln in d.log().splitlines() if ln.startswith("{")]
    checks = [ln for ln in lines if ln.get("event") == "check"]
    assert len(checks) == 7
    assert all(ln["version"] == "json-1" for ln in checks)
    assert any(ln.get("event") == "verified" and ln.get("version") == "json-1" for ln in lines)
    d.stop()
    assert not (d.state_dir / "daemon.json").exists()
