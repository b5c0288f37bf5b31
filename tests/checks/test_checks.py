"""The verify stage on real tiny checkpoints: good ones pass, each kind of damage is rejected by name."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from support_checks import (
    add_word_tokenizer,
    edit_manifest,
    flip_bit_in_data,
    published,
    raw_safetensors,
    rewrite_header,
    rewrite_tensors,
    shard_paths,
)

from daemon.checks import CHECK_NAMES, CheckResult, CheckSettings, run_checks
from daemon.formats.checkpoint import INDEX_NAME, MANIFEST_NAME
from daemon.manifest import load_manifest, publish
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick

FAST = CheckSettings(enabled=tuple(n for n in CHECK_NAMES if n != "forward"))  # forward has its own tests


def reject(directory: Path, settings: CheckSettings = FAST, reference: Path | None = None) -> tuple[str, str]:
    """Run the checks, expect a rejection, return (failing check name, its reason)."""
    report = run_checks(directory, settings, reference=reference)
    assert not report.ok, "the checkpoint should have been rejected"
    assert not report.deferred
    failed = report.results[-1]
    assert not failed.ok and report.reason == f"{failed.name}: {failed.detail['reason']}"
    assert all(r.ok for r in report.results[:-1])
    json.dumps(failed.detail)  # the coordinator stores it in a JSON column
    return failed.name, failed.detail["reason"]


# ---------------------------------------------------------------- good checkpoints


@pytest.mark.parametrize("shards,dtype", [(1, "float32"), (3, "float32"), (2, "bfloat16")])
def test_good_checkpoint_passes_every_check_and_reports_each_result(tmp_path: Path, shards: int, dtype: str):
    ref = published(tmp_path / "serving", seed=1, shards=shards, dtype=dtype)
    new = published(tmp_path / "new", seed=2, shards=shards, dtype=dtype)
    seen: list[CheckResult] = []
    report = run_checks(
        new, CheckSettings(forward_top1_min=0.0, forward_kl_max=100.0), reference=ref, on_result=seen.append
    )
    assert report.ok, report.reason
    assert [r.name for r in seen] == list(CHECK_NAMES)
    assert seen == report.results
    assert all(r.ok and not r.deferred and r.duration_ms >= 0 for r in seen)
    manifest = load_manifest(new)
    assert report.digest == manifest.digest
    assert (
        report.total_bytes
        == sum(f.bytes for f in manifest.files)
        == sum(p.stat().st_size for p in new.iterdir() if p.name != MANIFEST_NAME)
    )
    assert report.tensor_count == 21
    forward = report.results[-1].detail
    assert forward["top1_agreement"] < 1.0 and forward["kl"] > 0  # different seeds: different logits
    json.dumps([r.detail for r in seen])  # every detail can be stored in the JSON column


def test_checkpoint_without_manifest_gets_file_list_and_digest_from_the_directory(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "idx", seed=3, shards=2)
    report = run_checks(d, FAST)
    assert report.ok, report.reason
    assert report.manifest is None
    assert {f.path for f in report.files} == {p.name for p in d.iterdir()}
    publish(d)  # the same content published later has the same digest
    assert report.digest == load_manifest(d).digest


def test_disabled_checks_do_not_run(tmp_path: Path):
    d = published(tmp_path / "v", seed=0)
    report = run_checks(d, CheckSettings(enabled=("crc32c", "manifest")))
    assert [r.name for r in report.results] == ["manifest", "crc32c"]  # always in the fixed order


# ---------------------------------------------------------------- manifest and completeness


@pytest.mark.parametrize("shard_index", [0, 1])
def test_flipped_bit_in_each_shard_is_caught_by_crc32c(tmp_path: Path, shard_index: int):
    d = published(tmp_path / "v", shards=2)
    shard = shard_paths(d)[shard_index]
    flip_bit_in_data(shard)
    name, reason = reject(d)
    assert name == "crc32c"
    assert shard.name in reason and "does not match the manifest" in reason


def test_truncated_shard_is_rejected_naming_it(tmp_path: Path):
    d = published(tmp_path / "v", shards=2)
    shard = shard_paths(d)[1]
    os.truncate(shard, shard.stat().st_size - 100)
    name, reason = reject(d)
    assert name == "manifest"
    assert shard.name in reason and "truncated" in reason


def test_truncated_shard_without_manifest_fails_the_header_length_rule(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v", shards=2)
    shard = shard_paths(d)[0]
    os.truncate(shard, shard.stat().st_size - 4)
    name, reason = reject(d)
    assert name == "headers"
    assert shard.name in reason


def test_missing_shard_is_rejected_naming_it(tmp_path: Path):
    d = published(tmp_path / "v", shards=3)
    shard = shard_paths(d)[2]
    shard.unlink()
    name, reason = reject(d)
    assert name == "manifest" and shard.name in reason and "missing" in reason


def test_missing_shard_of_an_index_only_checkpoint_is_rejected_naming_it(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v", shards=2)
    shard = shard_paths(d)[0]
    shard.unlink()
    name, reason = reject(d)
    assert name == "manifest" and shard.name in reason and INDEX_NAME in reason


def test_extra_unlisted_file_is_rejected_naming_it(tmp_path: Path):
    d = published(tmp_path / "v")
    (d / "optimizer.pt").write_bytes(b"not listed")
    name, reason = reject(d)
    assert name == "manifest" and "optimizer.pt" in reason and "not listed" in reason


@pytest.mark.parametrize(
    "bad_path,words",
    [
        ("../outside.safetensors", "'..'"),
        ("sub/../../x", "'..'"),
        ("/etc/passwd", "absolute"),
        ("./model.safetensors", "not normalised"),
        ("a//b", "not normalised"),
    ],
)
def test_manifest_path_leaving_or_not_normalised_is_rejected(tmp_path: Path, bad_path: str, words: str):
    d = published(tmp_path / "v")

    def add(doc: dict) -> dict:
        doc["files"].append({"path": bad_path, "bytes": 1, "crc32c": "00000000", "blake3": "0" * 64})
        return doc

    edit_manifest(d, add)
    name, reason = reject(d)
    assert name == "manifest" and bad_path in reason and words in reason


def test_symlink_leaving_the_checkpoint_is_rejected(tmp_path: Path):
    d = published(tmp_path / "v")
    outside = tmp_path / "secret.txt"
    outside.write_text("x")
    (d / "tokenizer.json").symlink_to(outside)
    name, reason = reject(d)
    assert name == "manifest" and "tokenizer.json" in reason and "symlink" in reason


def test_manifest_with_wrong_format_or_bad_json_is_rejected(tmp_path: Path):
    d = published(tmp_path / "v")
    edit_manifest(d, lambda doc: {**doc, "format": "other/2"})
    assert "format" in reject(d)[1]
    (d / MANIFEST_NAME).write_text("{not json")
    name, reason = reject(d)
    assert name == "manifest" and "not valid UTF-8 JSON" in reason


def test_require_manifest_rejects_index_committed_checkpoints(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    name, reason = reject(d, CheckSettings(enabled=("manifest",), require_manifest=True))
    assert MANIFEST_NAME in reason and "require_manifest" in reason


# ---------------------------------------------------------------- headers and index


def _shift_offsets(header: dict, name: str, delta: int) -> dict:
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + delta, end + delta]
    return header


def test_header_claiming_overlapping_offsets_is_rejected_naming_the_tensor(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    shard = d / "model.safetensors"

    def overlap(h: dict) -> dict:
        # point the last tensor 4 bytes back and shrink nothing else: two tensors now share bytes
        tensors = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        last = tensors[-1]
        h = _shift_offsets(h, last, -4)
        return h

    rewrite_header(shard, overlap)
    publish(d)  # a well-formed manifest over a bad file: the header check must catch it
    name, reason = reject(d)
    assert name == "headers" and "model.safetensors" in reason and "overlaps tensor" in reason


def test_header_over_the_cap_is_rejected(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    shard = d / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[:8] = struct.pack("<Q", 100 * 1024 * 1024 + 1)  # claims a 100 MB + 1 header
    shard.write_bytes(bytes(raw))
    name, reason = reject(d)
    assert name == "headers" and "model.safetensors" in reason and "exceeds the cap" in reason


def test_configured_header_cap_applies(tmp_path: Path):
    d = published(tmp_path / "v")
    name, reason = reject(d, CheckSettings(enabled=("headers",), header_cap_bytes=512))
    assert "exceeds the cap of 512 bytes" in reason


def test_header_that_is_not_json_is_rejected(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    shard = d / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8:12] = b"{{{{"
    shard.write_bytes(bytes(raw))
    name, reason = reject(d)
    assert name == "headers" and "model.safetensors" in reason and "not valid JSON" in reason


def test_index_mapping_a_tensor_to_the_wrong_shard_is_rejected(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v", shards=2)
    index = json.loads((d / INDEX_NAME).read_text())
    name = "model.norm.weight"
    right = index["weight_map"][name]
    wrong = next(f for f in set(index["weight_map"].values()) if f != right)
    index["weight_map"][name] = wrong
    (d / INDEX_NAME).write_text(json.dumps(index))
    check, reason = reject(d)
    assert check == "headers" and name in reason and wrong in reason and right in reason


def test_index_missing_a_tensor_that_a_shard_holds_is_rejected(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v", shards=2)
    index = json.loads((d / INDEX_NAME).read_text())
    del index["weight_map"]["lm_head.weight"]
    (d / INDEX_NAME).write_text(json.dumps(index))
    check, reason = reject(d)
    assert check == "headers" and "'lm_head.weight'" in reason and "missing from weight_map" in reason


def test_tensor_in_two_shards_is_rejected(tmp_path: Path):
    d = tmp_path / "v"
    d.mkdir()
    for shard in ("a.safetensors", "b.safetensors"):
        (d / shard).write_bytes(
            raw_safetensors({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"abcd")
        )
    check, reason = reject(d)
    assert check == "headers" and "'w'" in reason and "a.safetensors" in reason and "b.safetensors" in reason


# ---------------------------------------------------------------- compatibility


NO_RESTART = dataclasses.replace(FAST, restart_rollouts=False)  # [rollout] restart_rollouts = false


def test_renamed_tensor_is_incompatible_and_named(tmp_path: Path):
    ref = published(tmp_path / "serving", seed=0)
    new = published(tmp_path / "new", seed=1)
    rewrite_tensors(new, lambda s: s.__setitem__("model.norm.renamed", s.pop("model.norm.weight")))
    name, reason = reject(new, NO_RESTART, reference=ref)
    assert name == "compat"
    assert "'model.norm.weight' missing" in reason and "'model.norm.renamed' not in the serving" in reason
    assert "needs a restart rollout" in reason


def test_changed_shape_is_incompatible_and_named(tmp_path: Path):
    ref = published(tmp_path / "serving", seed=0)
    new = published(tmp_path / "new", seed=1)
    rewrite_tensors(new, lambda s: s.__setitem__("model.norm.weight", torch.ones(65)))
    name, reason = reject(new, NO_RESTART, reference=ref)
    assert name == "compat" and "'model.norm.weight' shape [65] != serving [64]" in reason


def test_changed_dtype_is_incompatible_and_named(tmp_path: Path):
    ref = published(tmp_path / "serving", seed=0)
    new = published(tmp_path / "new", seed=1)
    rewrite_tensors(new, lambda s: s.__setitem__("lm_head.weight", s["lm_head.weight"].to(torch.bfloat16)))
    name, reason = reject(new, NO_RESTART, reference=ref)
    assert name == "compat" and "'lm_head.weight' dtype BF16 != serving F32" in reason


def test_configured_reference_dir_is_used_when_no_serving_version_is_passed(tmp_path: Path):
    ref = published(tmp_path / "ref", seed=0, dtype="bfloat16")
    new = published(tmp_path / "new", seed=1)
    name, reason = reject(new, CheckSettings(enabled=("compat",), reference_dir=ref, restart_rollouts=False))
    assert name == "compat" and "dtype F32 != serving BF16" in reason
    report = run_checks(new, CheckSettings(enabled=("compat",)))
    assert report.ok and "skipped" in report.results[0].detail


# ---------------------------------------------------------------- finite


@pytest.mark.parametrize(
    "dtype,value", [("float32", float("nan")), ("bfloat16", float("nan")), ("float16", float("inf"))]
)
def test_nan_or_inf_in_one_tensor_is_rejected_naming_it(tmp_path: Path, dtype: str, value: float):
    d = published(tmp_path / "v", dtype=dtype, shards=2)
    target = "model.layers.1.mlp.up_proj.weight"
    file = json.loads((d / INDEX_NAME).read_text())["weight_map"][target]

    def plant(state: dict) -> None:
        state[target].view(-1)[1234] = value

    rewrite_tensors(d, plant, file=file)
    name, reason = reject(d)
    assert name == "finite" and f"'{target}'" in reason and file in reason
    kind = "1 NaN and 0 Inf" if value != value else "0 NaN and 1 Inf"
    assert kind in reason and "element 1234" in reason


# ---------------------------------------------------------------- headroom


def test_not_enough_host_memory_defers_instead_of_rejecting(tmp_path: Path):
    d = published(tmp_path / "v")
    seen: list[CheckResult] = []
    report = run_checks(d, CheckSettings(headroom_factor=1e9), on_result=seen.append)
    assert not report.ok and report.deferred
    assert seen[-1].name == "headroom" and seen[-1].deferred
    assert "host RAM available" in report.reason and "deferred" in report.reason
    assert "forward" not in [r.name for r in seen]  # stops at the first failure


# ---------------------------------------------------------------- forward pass


def test_forward_pass_rejects_weights_that_overflow_the_logits(tmp_path: Path):
    d = published(tmp_path / "v")
    rewrite_tensors(d, lambda s: s["model.norm.weight"].fill_(3e38))  # finite weights, infinite logits
    name, reason = reject(d, CheckSettings())
    assert name == "forward" and "logits contain NaN/Inf" in reason


def test_forward_pass_bounds_against_the_serving_version(tmp_path: Path):
    ref = published(tmp_path / "serving", seed=0)
    same = published(tmp_path / "same", seed=0)
    other = published(tmp_path / "other", seed=5)
    strict = CheckSettings(enabled=("forward",), forward_top1_min=0.99, forward_kl_max=1e-6)
    report = run_checks(same, strict, reference=ref)
    assert report.ok and report.results[0].detail["top1_agreement"] == 1.0
    name, reason = reject(other, strict, reference=ref)
    assert name == "forward" and "top-1 agreement with the serving version" in reason
    kl_only = CheckSettings(enabled=("forward",), forward_kl_max=1e-6)
    assert "KL(serving || new)" in reject(other, kl_only, reference=ref)[1]


def test_forward_pass_needs_config_json(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    (d / "config.json").unlink()
    name, reason = reject(d, CheckSettings(enabled=("forward",)))
    assert "config.json missing" in reason


def test_forward_pass_rejects_a_checkpoint_lacking_a_model_parameter(tmp_path: Path):
    d = published(tmp_path / "v")
    rewrite_tensors(d, lambda s: s.pop("model.layers.0.mlp.down_proj.weight"))
    name, reason = reject(d, CheckSettings(enabled=("forward",)))
    assert "'model.layers.0.mlp.down_proj.weight'" in reason and "not in the checkpoint" in reason


# ---------------------------------------------------------------- settings


def test_settings_reject_unknown_names_and_keys():
    with pytest.raises(ValueError, match="unknown check names"):
        CheckSettings(enabled=("manifest", "sha256"))
    with pytest.raises(ValueError, match=r"checks: unknown keys \['headroom'\]"):
        CheckSettings.from_mapping({"headroom": 2})
    with pytest.raises(ValueError, match="headroom_factor"):
        CheckSettings.from_mapping({"headroom_factor": 0})
    s = CheckSettings.from_mapping(
        {"hmac_keys": {"t": "/k"}, "enabled": ["manifest", "crc32c"], "reference_dir": "/r"}
    )
    assert s.hmac_keys == {"t": Path("/k")} and s.enabled == ("manifest", "crc32c")
    assert s.reference_dir == Path("/r")


def test_forward_pass_uses_the_checkpoints_tokenizer_and_rejects_a_broken_one(tmp_path: Path):
    d = make_tiny_checkpoint(tmp_path / "v")
    settings = CheckSettings(enabled=("forward",))
    assert run_checks(d, settings).results[0].detail["prompt_source"] == "token ids (no tokenizer)"
    add_word_tokenizer(d)
    report = run_checks(d, settings)
    assert report.ok, report.reason
    assert report.results[0].detail["prompt_source"] == "tokenizer"
    (d / "tokenizer.json").write_text("{broken")
    name, reason = reject(d, settings)
    assert "tokenizer files present but unusable" in reason
