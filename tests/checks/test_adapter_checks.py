"""The verify stage on LoRA adapter checkpoints (PEFT layout) against a tiny serving base: a good
adapter passes every check; each kind of bad adapter is refused by the check that owns it, with a
reason naming the module, the shapes or the bases. Also: a resized vocabulary passes compat as a
restart rollout, or is refused when restart rollouts are off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support_adapters import BASE_NAME, make_adapter, make_base, publish_adapter
from support_engines import corrupt_bytes

from daemon.checks import CHECK_NAMES, CheckSettings, run_checks
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint

pytestmark = pytest.mark.quick

ALL = CheckSettings()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_base(tmp_path_factory.mktemp("base") / "base-v0", seed=0)
    publish(d, version="base-v0")
    return d


def adapter(tmp_path: Path, base: Path, version: str = "sql@1", **kw: object) -> Path:
    return publish_adapter(tmp_path / "watch", version, "sql", lambda d: make_adapter(d, base, seed=1, **kw))  # type: ignore[arg-type]


def refused(directory: Path, base: Path, settings: CheckSettings = ALL) -> tuple[str, str]:
    report = run_checks(directory, settings, reference=base)
    assert not report.ok, "the adapter should have been refused"
    failed = report.results[-1]
    json.dumps(failed.detail)
    return failed.name, str(failed.detail["reason"])


def test_a_good_adapter_passes_every_check(tmp_path: Path, base: Path) -> None:
    report = run_checks(adapter(tmp_path, base), ALL, reference=base)
    assert report.ok, report.reason
    assert [r.name for r in report.results] == list(CHECK_NAMES)
    assert all(r.status == "pass" for r in report.results), [(r.name, r.status) for r in report.results]
    compat = next(r for r in report.results if r.name == "compat").detail
    assert compat["adapter"] == "sql" and compat["base_model"] == BASE_NAME and compat["rank"] == 8
    assert compat["modules"] == 4  # q_proj and v_proj of two layers
    forward = next(r for r in report.results if r.name == "forward").detail
    assert 0 < forward["kl_from_base"] < ALL.adapter_kl_max  # type: ignore[operator]
    assert report.digest and report.tensor_count == 8


def test_corrupt_bytes_are_refused_by_the_hash_check(tmp_path: Path, base: Path) -> None:
    d = adapter(tmp_path, base)
    corrupt_bytes(d)
    check, reason = refused(d, base)
    assert check == "crc32c" and "adapter_model.safetensors" in reason


def test_a_rank_the_tensors_do_not_have_is_refused_naming_module_and_shapes(tmp_path: Path, base: Path) -> None:
    check, reason = refused(adapter(tmp_path, base, config_rank=4), base)
    assert check == "compat"
    assert "module model.layers.0.self_attn.q_proj: lora_A shape [8, 64] != [4, 64]" in reason, reason
    assert "r=4" in reason and "base weight [64, 64]" in reason


def test_a_shape_the_base_does_not_have_is_refused_naming_module_and_shapes(tmp_path: Path, base: Path) -> None:
    check, reason = refused(adapter(tmp_path, base, wrong_shape=True), base)
    assert check == "compat"
    assert "lora_A shape [8, 63] != [8, 64]" in reason and "self_attn.q_proj" in reason, reason


def test_an_adapter_for_another_base_is_refused_naming_both(tmp_path: Path, base: Path) -> None:
    check, reason = refused(adapter(tmp_path, base, base_model="meta-llama/Llama-3-8B"), base)
    assert check == "compat"
    assert "trained for base 'meta-llama/Llama-3-8B'" in reason and "'base-v0'" in reason and BASE_NAME in reason


def test_an_adapter_with_a_nan_is_refused_by_the_finite_check(tmp_path: Path, base: Path) -> None:
    check, reason = refused(adapter(tmp_path, base, nan=True), base)
    assert check == "finite" and "lora_B" in reason and "NaN" in reason, reason


def test_a_target_module_the_base_lacks_is_refused(tmp_path: Path, base: Path) -> None:
    d = adapter(tmp_path, base)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj", "gate_projx"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    publish(d, version="sql@1", extra={"adapter": "sql"})
    check, reason = refused(d, base)
    assert check == "compat" and "target module 'gate_projx' matches no module" in reason, reason


def test_an_adapter_that_moves_the_base_too_far_is_refused_by_the_forward_canary(tmp_path: Path, base: Path) -> None:
    d = adapter(tmp_path, base, std=1.5)
    check, reason = refused(d, base, CheckSettings(adapter_kl_max=0.05, adapter_delta_max=1000.0))
    assert check == "forward" and "KL(base || adapted)" in reason and "checks.adapter_kl_max 0.05" in reason


def test_a_merged_delta_larger_than_its_bound_is_refused_naming_the_module(tmp_path: Path, base: Path) -> None:
    """Issue 37: the scale (lora_alpha / r) is bounded in compat; B and A themselves can still bury
    the base weight. |scale * B @ A| / |W| is ~270 here (std 1.5), ~5 with the default std."""
    d = adapter(tmp_path, base, std=1.5)
    check, reason = refused(d, base, CheckSettings(adapter_kl_max=None))
    assert check == "forward" and "the merged delta |scale * B @ A| is" in reason, reason
    assert "checks.adapter_delta_max 10" in reason and reason.startswith("module model.layers."), reason
    assert run_checks(adapter(tmp_path / "ok", base), CheckSettings(adapter_kl_max=None), reference=base).ok


def test_an_adapter_that_overflows_in_the_engines_fp16_is_refused_there(tmp_path: Path, base: Path) -> None:
    """Issue 37: the canary ran in float32 where an fp16 engine overflows. With checks.engine_dtype =
    "float16" the merged weights are run in float16: values past 65504 become inf, the logits NaN."""
    d = adapter(tmp_path, base, std=40.0)  # merged weights ~1e5: finite in float32, not in float16
    loose = {"adapter_kl_max": None, "adapter_delta_max": 1e9}
    assert run_checks(d, CheckSettings(engine_dtype="float32", **loose), reference=base).ok  # type: ignore[arg-type]
    check, reason = refused(d, base, CheckSettings(engine_dtype="float16", **loose))  # type: ignore[arg-type]
    assert check == "forward" and "logits with the adapter contain NaN/Inf" in reason, reason


def test_an_adapter_without_a_name_is_refused(tmp_path: Path, base: Path) -> None:
    d = make_adapter(tmp_path / "noname", base, seed=1)
    publish(d, version="noname")
    check, reason = refused(d, base)
    assert check == "compat" and "no adapter name" in reason and "--adapter NAME" in reason


def test_an_adapter_with_no_serving_base_is_refused(tmp_path: Path, base: Path) -> None:
    report = run_checks(adapter(tmp_path, base), ALL, reference=None)
    assert not report.ok and report.reason is not None and "no serving base model" in report.reason


@pytest.mark.parametrize("allowed", [True, False])
def test_a_resized_vocabulary_needs_a_restart_rollout(tmp_path: Path, base: Path, allowed: bool) -> None:
    d = make_base(tmp_path / "base-v1", seed=3, overrides={"vocab_size": 320})
    publish(d, version="base-v1")
    settings = CheckSettings(enabled=("manifest", "headers", "crc32c", "compat"), restart_rollouts=allowed)
    report = run_checks(d, settings, reference=base)
    compat = report.results[-1]
    assert compat.name == "compat"
    if allowed:
        assert report.ok and compat.detail["restart_rollout"] is True
        assert "model.embed_tokens.weight" in " ".join(compat.detail["differences"])
    else:
        assert not report.ok and "restart_rollouts = false forbids them" in str(compat.detail["reason"])


def test_a_full_checkpoint_still_passes_compat_without_a_restart(tmp_path: Path, base: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "same", seed=5)
    publish(d, version="same")
    report = run_checks(d, CheckSettings(enabled=("manifest", "headers", "crc32c", "compat")), reference=base)
    assert report.ok and "restart_rollout" not in report.results[-1].detail


def test_the_documented_demo_adapter_passes_every_check(tmp_path: Path, base: Path) -> None:
    """`daemon.tinymodel.make_tiny_adapter` (docs/how-to/adapters.md) makes an adapter for a tiny
    base that every check accepts (issue 36: the only helper was in tests/)."""
    from daemon.tinymodel import make_tiny_adapter

    made = publish_adapter(tmp_path / "watch", "demo@1", "demo", lambda d: make_tiny_adapter(d, base, seed=1))
    report = run_checks(made, ALL, reference=base)
    assert report.ok, report.reason
    compat = next(r for r in report.results if r.name == "compat").detail
    assert compat["adapter"] == "demo" and compat["base_model"] == BASE_NAME and compat["rank"] == 8
    assert compat["modules"] == 4
