"""Attacks on the S3 source, replayed through boto3 against a real moto server on loopback.

- Version squatting: folders are listed in name order and the label came from the manifest, so a
  folder `aaa-squat/` whose manifest said `version = "legit"` was registered and fetched into
  `cache/legit` before the real `legit/`. A version now comes only from the folder of its name: a
  mismatch is refused (logged once with both names, shown under `refused`), never emitted.
- Cache deletion: a fetch `rmtree`d whatever `cache/<label>` held. Now a complete copy there is
  never deleted (another one refuses the fetch); only a remnant without a manifest is replaced,
  once the new download is complete.
- Labels from S3 (folder names, manifests' versions) with control characters or newlines are
  refused with the reason; the source goes on listing.
- A manifest that does not parse is logged with its real parse error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
from conftest import publish_tiny
from support_s3 import MotoServer, upload_dir

from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.sources.base import FetchError, FetchItem
from daemon.sources.s3 import S3Source, S3SourceConfig

BUCKET = "ckpts"



@pytest.fixture
def s3(moto_server: MotoServer) -> Any:
    client = moto_server.client()
    client.create_bucket(Bucket=BUCKET)
    return client


def make_source(server: MotoServer, tmp_path: Path) -> tuple[S3Source, list[Any]]:
    items: list[Any] = []
    cfg = S3SourceConfig(bucket=BUCKET, prefix="run-1", endpoint_url=server.url, poll_interval_s=3600,
                         cache_dir=str(tmp_path / "cache"), max_attempts=1, connect_timeout_s=2, read_timeout_s=5,
                         retry_after_s=0.5)  # fmt: skip
    cfg.validate("sources[0]")
    return S3Source(cfg, items.append), items


def fetch(src: S3Source, version: str, uri: str) -> Path:
    return src.fetch(FetchItem(1, version, uri), lambda done, total: None)


def tree(directory: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(directory.iterdir())}


def refusals(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "checkpoint refused"]


def test_a_folder_claiming_another_version_is_refused_and_never_fetched_into_its_cache(moto_server, s3, tmp_path):
    publish_tiny(tmp_path / "real" / "legit", seed=1)
    publish_tiny(tmp_path / "evil" / "aaa-squat", seed=9, version="legit")  # listed first, claims "legit"
    upload_dir(s3, BUCKET, "run-1/aaa-squat/", tmp_path / "evil" / "aaa-squat")
    upload_dir(s3, BUCKET, "run-1/legit/", tmp_path / "real" / "legit")
    src, items = make_source(moto_server, tmp_path)
    with structlog.testing.capture_logs() as logs:
        found = src.scan()
        again = src.scan()
    print("emitted:", [(i.version, i.uri) for i in found], "refusals:", refusals(logs))
    assert [(i.version, i.uri) for i in found] == [("legit", f"s3://{BUCKET}/run-1/legit/")]
    assert again == [] and len(items) == 1
    [refused] = refusals(logs)  # once, though listed twice
    assert refused["folder"] == "aaa-squat" and "'legit'" in refused["reason"] and "aaa-squat" in refused["reason"]
    assert set(src.describe()["refused"]) == {"aaa-squat"}
    legit = fetch(src, "legit", found[0].uri)
    assert legit == tmp_path / "cache" / "legit"
    for p in (tmp_path / "real" / "legit").iterdir():
        assert (legit / p.name).read_bytes() == p.read_bytes()
    before = tree(legit)
    # a registration of the squat from before (an older daemon, another host's row) is not fetched either
    with pytest.raises(FetchError, match="fetched only from a folder of that name"):
        fetch(src, "legit", f"s3://{BUCKET}/run-1/aaa-squat/")
    assert tree(legit) == before
    # the squatter fixes its manifest to its own name: looked at again (its manifest changed), emitted
    publish_tiny(tmp_path / "fixed" / "aaa-squat", seed=9)
    upload_dir(s3, BUCKET, "run-1/aaa-squat/", tmp_path / "fixed" / "aaa-squat")
    assert [i.version for i in src.scan()] == ["aaa-squat"] and "refused" not in src.describe()


def test_a_fetch_never_deletes_a_copy_in_the_cache_and_replaces_only_a_remnant(moto_server, s3, tmp_path):
    publish_tiny(tmp_path / "a" / "step-1", seed=1)
    upload_dir(s3, BUCKET, "run-1/step-1/", tmp_path / "a" / "step-1")
    src, _ = make_source(moto_server, tmp_path)
    [item] = src.scan()
    cached = fetch(src, item.version, item.uri)
    before = tree(cached)
    assert fetch(src, item.version, item.uri) == cached and tree(cached) == before  # the same: reused
    # the store's copy changes under the same label (a re-upload, or someone with write access)
    publish_tiny(tmp_path / "b" / "step-1", seed=2)
    upload_dir(s3, BUCKET, "run-1/step-1/", tmp_path / "b" / "step-1")
    with pytest.raises(FetchError, match="the cache holds another copy of step-1") as err:
        fetch(src, item.version, item.uri)
    print("refused:", err.value.reason)
    assert tree(cached) == before
    # a remnant without a manifest (an interrupted removal) is this version's incomplete copy: replaced
    publish_tiny(tmp_path / "c" / "step-2", seed=3)
    upload_dir(s3, BUCKET, "run-1/step-2/", tmp_path / "c" / "step-2")
    remnant = tmp_path / "cache" / "step-2"
    remnant.mkdir()
    (remnant / "config.json").write_text("{}")
    got = fetch(src, "step-2", f"s3://{BUCKET}/run-1/step-2/")
    assert got == remnant
    for name in (MANIFEST_NAME, "config.json"):
        assert (got / name).read_bytes() == (tmp_path / "c" / "step-2" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["step-1", "step-2"]  # nothing set aside is left


def test_labels_with_control_characters_are_refused_and_the_source_goes_on(moto_server, s3, tmp_path):
    bad = "v\x1b[31mred"  # S3 takes it as a key; as a label it would paint every log line and /status
    publish_tiny(tmp_path / "x" / "bad", seed=1)  # a valid manifest, uploaded under the bad folder name
    upload_dir(s3, BUCKET, f"run-1/{bad}/", tmp_path / "x" / "bad")
    # a manifest whose version has a newline: handed on, to be rejected with the real reason
    publish_tiny(tmp_path / "y" / "nl", seed=2)
    doc = (tmp_path / "y" / "nl" / MANIFEST_NAME).read_text().replace('"version": "nl"', '"version": "nl\\nforged"')
    (tmp_path / "y" / "nl" / MANIFEST_NAME).write_text(doc)
    upload_dir(s3, BUCKET, "run-1/nl/", tmp_path / "y" / "nl")
    publish_tiny(tmp_path / "z" / "good", seed=3)
    upload_dir(s3, BUCKET, "run-1/good/", tmp_path / "z" / "good")
    src, _ = make_source(moto_server, tmp_path)
    with structlog.testing.capture_logs() as logs:
        found = src.scan()
    print("emitted:", [i.version for i in found], "logs:", [e for e in logs if e["log_level"] == "warning"])
    assert sorted(i.version for i in found) == ["good", "nl"]
    assert "contains a control character" in src.describe()["refused"][bad]
    [parse] = [e for e in logs if e["event"].startswith("manifest does not parse")]
    assert parse["name"] == "nl" and "version 'nl\\nforged' contains a newline" in parse["error"], parse
    nl = next(i for i in found if i.version == "nl")
    with pytest.raises(FetchError, match="contains a newline"):  # rejected at fetch with the same reason
        fetch(src, nl.version, nl.uri)
    good = next(i for i in found if i.version == "good")
    assert (fetch(src, good.version, good.uri) / MANIFEST_NAME).is_file()


def test_labels_a_shell_or_a_command_would_read_are_refused(moto_server, s3, tmp_path):
    """Issue 37, item 6: S3 takes `$(id)` and `-rf` as key prefixes; as labels they are refused."""
    for i, name in enumerate(("v$(id)", "-rf")):  # valid manifests, uploaded under the bad folder names
        publish_tiny(tmp_path / "x" / f"bad{i}", seed=i + 1)
        upload_dir(s3, BUCKET, f"run-1/{name}/", tmp_path / "x" / f"bad{i}")
    publish_tiny(tmp_path / "z" / "good", seed=3)
    upload_dir(s3, BUCKET, "run-1/good/", tmp_path / "z" / "good")
    src, _ = make_source(moto_server, tmp_path)
    found = src.scan()
    assert [i.version for i in found] == ["good"]
    refused = src.describe()["refused"]
    assert "starts with '-'" in refused["-rf"] and "a label is letters" in refused["v$(id)"], refused


def test_a_manifest_that_does_not_parse_is_logged_with_its_own_parse_error(moto_server, s3, tmp_path):
    publish_tiny(tmp_path / "y" / "bad-digest", seed=2)
    manifest = tmp_path / "y" / "bad-digest" / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"digest": "blake3:', '"digest": "blake3:00'))
    upload_dir(s3, BUCKET, "run-1/bad-digest/", tmp_path / "y" / "bad-digest")
    src, _ = make_source(moto_server, tmp_path)
    with structlog.testing.capture_logs() as logs:
        [item] = src.scan()
    [parse] = [e for e in logs if e["event"].startswith("manifest does not parse")]
    print("logged:", parse)
    assert parse["name"] == "bad-digest" and "does not match its files' hashes" in parse["error"], parse
    assert "not valid UTF-8 JSON" not in parse["error"]
    with pytest.raises(FetchError, match="does not match its files' hashes"):  # rejected with the same reason
        fetch(src, item.version, item.uri)
