"""A real daemon on a watched folder takes delta checkpoints: rebuilt from its verified base, verified
as a full version, recorded (base, encoding, bytes fetched, ratio); every bad delta is refused with
its reason, and nothing half-written is left behind.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from conftest import hotswap_cli, publish_tiny
from support_delta import step

from daemon.bytepipe.files import hash_files
from daemon.client import publish_delta
from daemon.delta.anchors import AnchorRule
from daemon.delta.section import DELTA_DIR
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.manifest import load_manifest

RULE = AnchorRule(share=100.0)  # always a delta: the test decides what it ships


def test_a_delta_is_rebuilt_verified_and_recorded_and_bad_ones_are_refused(
    daemon_factory: Any, db_url: str, tmp_path: Path
) -> None:
    d = daemon_factory(db_url)
    trainer = tmp_path / "trainer"
    publish_tiny(trainer / "v1", seed=1)
    shutil.copytree(trainer / "v1", d.watch_dir / "v1")
    d.wait_status("v1", "verified")

    step(trainer / "v1", trainer / "v2", 1e-4, 2)
    p = publish_delta(trainer / "v2", trainer / "v1", d.watch_dir / "v2", step=2, rule=RULE)
    assert p.spec is not None
    row = d.wait_status("v2", "verified")
    assert (row["encoding"], row["delta_base"], row["fetched_bytes"]) == ("delta", "v1", p.spec.delta_bytes)
    assert 0 < row["delta_ratio"] < 0.5
    rebuilt = Path(row["local_path"])
    assert rebuilt == d.state_dir / "deltas" / "v2"
    assert all((rebuilt / f.path).read_bytes() == (trainer / "v2" / f.path).read_bytes() for f in p.manifest.files)

    # a delta of a delta: its base is the rebuilt v2
    step(trainer / "v2", trainer / "v3", 1e-4, 3)
    publish_delta(trainer / "v3", trainer / "v2", d.watch_dir / "v3", rule=RULE)
    assert d.wait_status("v3", "verified")["delta_base"] == "v2"

    def refused(version: str, why: str) -> None:
        r = d.wait_status(version, "rejected")
        assert why in r["status_message"], r["status_message"]
        assert "\n" not in r["status_message"]
        assert not (d.state_dir / "deltas" / version).exists()
        assert not [p for p in (d.state_dir / "deltas").iterdir() if p.name.startswith(".")]  # no temp left

    # a missing base: a gap in the chain
    publish_tiny(trainer / "ghost", seed=7)
    step(trainer / "ghost", trainer / "g2", 1e-4, 4)
    publish_delta(trainer / "g2", trainer / "ghost", d.watch_dir / "g2", rule=RULE)
    refused("g2", "base ghost is not known here: a gap in the chain")

    # the right label, other bytes: a wrong base digest
    publish_tiny(tmp_path / "other" / "v1", seed=9)
    step(tmp_path / "other" / "v1", trainer / "w2", 1e-4, 5)
    publish_delta(trainer / "w2", tmp_path / "other" / "v1", d.watch_dir / "w2", rule=RULE)
    refused("w2", "wrong base")

    # a base that was rejected
    publish_tiny(trainer / "bad", seed=3)
    shutil.copytree(trainer / "bad", d.watch_dir / "bad")
    weights = d.watch_dir / "bad" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-10] ^= 0xFF
    weights.write_bytes(bytes(raw))
    d.wait_status("bad", "rejected")
    step(trainer / "bad", trainer / "b2", 1e-4, 6)
    publish_delta(trainer / "b2", trainer / "bad", d.watch_dir / "b2", rule=RULE)
    refused("b2", "base bad was rejected")

    # a delta file changed after it was published (its signed hash no longer matches)
    step(trainer / "v3", trainer / "v4", 1e-4, 7)
    staging = tmp_path / "staging" / "v4"
    publish_delta(trainer / "v4", trainer / "v3", staging, rule=RULE)
    hsd = staging / DELTA_DIR / "model.safetensors.hsd"
    raw = bytearray(hsd.read_bytes())
    raw[-1] ^= 0x01
    hsd.write_bytes(bytes(raw))
    shutil.copytree(staging, d.watch_dir / "v4")
    refused("v4", "delta refused: delta file hotswap-delta/model.safetensors.hsd")

    # consistent and signed-looking, but the delta rebuilds other bytes than the result hashes say:
    # refused by the rebuild itself (each result file is hashed in memory as it is decoded)
    step(trainer / "v3", trainer / "v5", 1e-4, 8)
    step(trainer / "v3", tmp_path / "liar", 1e-4, 9)
    staging = tmp_path / "staging" / "v5"
    publish_delta(trainer / "v5", trainer / "v3", staging, rule=RULE)
    other = tmp_path / "staging" / "liar"
    publish_delta(tmp_path / "liar", trainer / "v3", other, version="v5", rule=RULE)
    m = load_manifest(staging)
    hsd = f"{DELTA_DIR}/model.safetensors.hsd"
    shutil.copyfile(other / hsd, staging / hsd)
    (d_,) = hash_files([staging / hsd])
    doc = dict(m.extra["delta"])
    doc["files"] = [{**doc["files"][0], "bytes": d_.bytes, "crc32c": d_.crc32c, "blake3": d_.hash}]
    (staging / MANIFEST_NAME).write_text(replace(m, extra={"delta": doc}).to_json())
    shutil.copytree(staging, d.watch_dir / "v5")
    refused("v5", "delta refused: result file model.safetensors (rebuilt from hotswap-delta/model.safetensors.hsd)")

    # the verified versions are untouched, and history/show say how each arrived
    assert d.row("v3")["status"] == "verified"
    assert d.get("/health").status_code == 200  # refusals are the checkpoints' problem, not the daemon's
    out = hotswap_cli("show", "v3", "-c", str(d.config_path))
    assert out.returncode == 0, out.stderr
    assert "delta of:" in out.stdout and "v2" in out.stdout and "delta/full" in out.stdout
    assert (d.watch_dir / "v3" / MANIFEST_NAME).is_file()


def test_an_unsigned_delta_under_a_signing_policy_is_refused_before_it_is_decoded(
    daemon_factory: Any, db_url: str, tmp_path: Path
) -> None:
    import os

    from daemon.checks.signatures import HmacSigner
    from daemon.manifest import publish

    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32).hex().encode())
    signer = HmacSigner("trainer", key.read_bytes())
    d = daemon_factory(db_url, checks={"enabled": ["manifest", "headers", "crc32c"], "hmac_keys": {"trainer": str(key)}})
    trainer = tmp_path / "trainer"
    publish_tiny(trainer / "v1", seed=1)
    publish(trainer / "v1", version="v1", signer=signer)
    shutil.copytree(trainer / "v1", d.watch_dir / "v1")
    d.wait_status("v1", "verified")
    step(trainer / "v1", trainer / "v2", 1e-4, 2)
    publish_delta(trainer / "v2", trainer / "v1", d.watch_dir / "v2", signer=signer, rule=RULE)
    assert d.wait_status("v2", "verified")["encoding"] == "delta"  # signed: rebuilt and verified
    step(trainer / "v2", trainer / "v3", 1e-4, 3)
    publish_delta(trainer / "v3", trainer / "v2", d.watch_dir / "v3", rule=RULE)  # no signer
    r = d.wait_status("v3", "rejected")
    assert "manifest is unsigned but signing keys are configured: not rebuilt" in r["status_message"], r
    assert not (d.state_dir / "deltas" / "v3").exists()
    assert d.row("v2")["status"] == "verified"


def test_the_fetched_bytes_view_sums_each_day_by_source_and_encoding(
    daemon_factory: Any, db_url: str, tmp_path: Path
) -> None:
    from sqlalchemy import text

    d = daemon_factory(db_url)
    trainer = tmp_path / "trainer"
    publish_tiny(trainer / "v1", seed=1)
    shutil.copytree(trainer / "v1", d.watch_dir / "v1")
    d.wait_status("v1", "verified")
    specs = []
    for i in (2, 3):
        step(trainer / f"v{i - 1}", trainer / f"v{i}", 1e-4, i)
        specs.append(publish_delta(trainer / f"v{i}", trainer / f"v{i - 1}", d.watch_dir / f"v{i}", rule=RULE).spec)
        d.wait_status(f"v{i}", "verified")
    with d.registry.session() as s:
        rows = s.execute(text("SELECT day, source, encoding, versions, fetched_bytes, full_bytes "
                              "FROM fetched_bytes_per_day ORDER BY encoding")).all()  # fmt: skip
        day = str(s.execute(text("SELECT discovered_at FROM checkpoints WHERE version = 'v1'")).scalar_one())[:10]
    full = load_manifest(trainer / "v1").total_bytes
    assert [tuple(r)[1:] for r in rows] == [
        (rows[0][1], "delta", 2, sum(p.delta_bytes for p in specs if p), rows[0][5]),
        (rows[0][1], "full", 1, full, full),
    ], rows
    assert {r[0] for r in rows} == {day}
    assert abs(rows[0][5] - sum(p.full_bytes for p in specs if p)) <= 2  # rounding of the stored ratio
