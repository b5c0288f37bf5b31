"""Stage while verifying (issue 15): one read feeds the hashes and the staged copy; the finite scan
and the forward canary run on that copy; the canary's skeleton is built once per architecture.

The canary's reuse of the copy and its cache are this process's (`isolate_checks = false`, as
tools run it); the daemon runs the forward check in its check process (daemon.checks.isolation).

CPU path of the same code the H200 runs (staging device "cpu"; on a GPU the copy is a CUDA tensor).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support_checks import published, rewrite_tensors

from daemon.bytepipe.files import hash_files
from daemon.bytepipe.staged import StagedCopy, stage_files
from daemon.checks import CHECK_NAMES, CheckSettings, run_checks
from daemon.checks.canary import CANARIES, REFERENCES
from daemon.checks.finite_staged import scan_staged
from daemon.formats.checkpoint import tensor_table
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport import SenderOptions, WorkersAhead, daemon_transport

NO_FINITE = CheckSettings(isolate_checks=False, enabled=tuple(n for n in CHECK_NAMES if n != "finite"))  # the canary must catch it


@pytest.fixture(autouse=True)
def fresh_canaries() -> Any:
    CANARIES.clear()
    yield
    CANARIES.clear()


def _by_name(report: Any) -> dict[str, dict[str, Any]]:
    return {r.name: r.detail for r in report.results}


def test_one_read_gives_the_same_digests_as_hashing_and_stages_exactly_those_bytes(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "v", seed=3, shards=3)
    rels = sorted(p.name for p in d.iterdir())
    # small chunks and few threads: many chunks per file, read ahead, hashed in file order
    digests, copy = stage_files(d, rels, "cpu", alg="blake3", threads=2, chunk=4096)
    assert digests == hash_files([d / r for r in rels], alg="blake3", threads=2, chunk=4096)
    for r in rels:
        assert copy.file_bytes(r).numpy().tobytes() == (d / r).read_bytes()
    copy.release()
    assert copy.nbytes == 0


def test_a_file_that_is_not_regular_is_refused_naming_it(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "v")
    (d / "sub").mkdir()
    with pytest.raises(OSError, match="sub: not a regular file"):
        stage_files(d, ["model.safetensors", "sub"], "cpu", alg="blake3")


def test_a_good_checkpoint_is_verified_from_one_read_and_the_copy_is_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    released: list[int] = []
    real = StagedCopy.release

    def counting(self: StagedCopy) -> None:
        released.append(self.nbytes)
        real(self)

    monkeypatch.setattr(StagedCopy, "release", counting)
    d = published(tmp_path / "v", seed=1, shards=2, dtype="bfloat16")
    report = run_checks(d, CheckSettings(isolate_checks=False))
    assert report.ok, report.reason
    detail = _by_name(report)
    assert detail["crc32c"]["staged"].startswith("on cpu")
    assert detail["finite"]["scanned"] == "staged copy on cpu"
    assert detail["forward"]["weights"] == "crc32c pass"  # the hashed copy, not a second read
    assert len(released) == 1 and released[0] > 0  # the one copy, gone once verify ends
    # rejected later in the run: the copy is released too
    bad = published(tmp_path / "bad", seed=2)
    rewrite_tensors(bad, lambda s: s["model.norm.weight"].fill_(float("nan")))
    assert not run_checks(bad, CheckSettings(isolate_checks=False)).ok
    assert len(released) == 2


def test_stage_device_off_keeps_the_file_reading_checks(tmp_path: Path) -> None:
    d = published(tmp_path / "v")
    report = run_checks(d, CheckSettings(isolate_checks=False, stage_device="off"))
    assert report.ok, report.reason
    detail = _by_name(report)
    assert detail["crc32c"]["staged"].startswith("no ")
    assert detail["finite"]["scanned"] == "files"
    assert detail["forward"]["weights"] == "read for the forward check"


def test_stage_device_off_still_asks_the_disk_workers_to_read_ahead_but_stages_nothing(tmp_path: Path) -> None:
    """"off" turns down a copy of the bytes (the loader's), not the disk workers' read ahead."""
    d = published(tmp_path / "v")
    reads: list[tuple[str | None, str | None, str | None, int]] = []
    sender = daemon_transport("disk", SenderOptions(state_dir=tmp_path))
    ask = sender.verify_stager("v1", "cpu", WorkersAhead(read=lambda *a: reads.append(a)))
    assert ask is not None and not ask.holds_bytes

    class Copies:  # the loader's shape: a copy of the weights
        holds_bytes = True
        staged: list[list[str]] = []

        def stage(self, root: Path, rels: list[str], alg: str, on_mapped: Any = None) -> None:
            self.staged.append(rels)

        def finish(self, ok: bool, files: list[Any], digest: str | None) -> None:
            pass

    off = CheckSettings(isolate_checks=False, stage_device="off", hash_alg="blake3")
    assert run_checks(d, off, stager=ask).ok
    weights = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert [r[:3] for r in reads] == [("v1", str(d), "blake3")]  # asked once, never let go (the version passed)
    assert reads[0][3] >= weights  # the version's bytes: what each worker keeps room for, per copy
    copies = Copies()
    assert run_checks(d, off, stager=copies).ok and copies.staged == []
    on = CheckSettings(isolate_checks=False, hash_alg="blake3")
    assert run_checks(d, on, stager=copies).ok and len(copies.staged) == 1


@pytest.mark.parametrize(
    "dtype,value,kind",
    [
        (torch.float32, float("nan"), "nan"),
        (torch.float64, float("inf"), "inf"),
        (torch.float16, float("-inf"), "inf"),
        (torch.bfloat16, float("nan"), "nan"),
        (torch.float8_e5m2, float("inf"), "inf"),
        (torch.float8_e4m3fn, float("nan"), "nan"),
    ],
)
def test_the_staged_scan_finds_nan_and_inf_in_every_float_width(
    tmp_path: Path, dtype: torch.dtype, value: float, kind: str
) -> None:
    from safetensors.torch import save_file

    d = tmp_path / "v"
    d.mkdir()
    bad = torch.zeros(3000, dtype=torch.float32).to(dtype)
    bad[2345] = torch.tensor(value).to(dtype)
    good = torch.full((7, 5), 448.0 if dtype == torch.float8_e4m3fn else 1.5).to(dtype)  # e4m3's max is finite
    save_file({"a.bad": bad, "b.good": good}, str(d / "model.safetensors"))
    table, _ = tensor_table(d)
    _digests, copy = stage_files(d, ["model.safetensors"], "cpu", alg=None)
    for engine in ("torch", "numpy"):  # the GPU's engine, run here on a CPU tensor; the host's
        found = scan_staged(copy, sorted(table.items()), d, engine=engine)
        assert [(b.tensor, b.first_index) for b in found] == [("a.bad", 2345)], engine
        assert (found[0].nan, found[0].inf) == ((1, 0) if kind == "nan" else (0, 1)), engine


def test_the_fused_pass_clears_finite_tensors_and_an_overflowing_sum_is_counted_exactly(tmp_path: Path) -> None:
    """The torch engine's first pass (one sum per tensor) clears finite tensors without the exact
    count; finite values whose float32 sum overflows are counted exactly and pass; a NaN is found."""
    from safetensors.torch import save_file

    from daemon.checks import finite_staged

    d = tmp_path / "v"
    d.mkdir()
    huge = torch.full((64,), 3.0e38, dtype=torch.bfloat16)  # finite, but 64 of them sum past float32's range
    bad = torch.zeros(100, dtype=torch.bfloat16)
    bad[17] = float("nan")
    plain = {f"p{i}": torch.randn(50, dtype=torch.float32) for i in range(5)}
    save_file({"huge": huge, "bad": bad, **plain}, str(d / "model.safetensors"))
    table, _ = tensor_table(d)
    _digests, copy = stage_files(d, ["model.safetensors"], "cpu", alg=None)
    assert not torch.isfinite(torch.tensor(float(huge.float().sum())))  # the overflow really happens
    assert finite_staged._suspects(copy, sorted(table.items()), d) == {
        i for i, name in enumerate(sorted(table)) if name in ("huge", "bad")}
    before = finite_staged.SUMS_RUN[0]
    found = scan_staged(copy, sorted(table.items()), d, engine="torch")
    assert [(b.tensor, b.nan, b.inf, b.first_index) for b in found] == [("bad", 1, 0, 17)]
    assert finite_staged.SUMS_RUN[0] - before == len(table)


def test_canary_skeleton_is_built_once_across_versions_and_reused_after_a_rejection(tmp_path: Path) -> None:
    versions = [published(tmp_path / f"v{i}", seed=i, shards=2) for i in range(3)]
    nan = published(tmp_path / "nan", seed=9, shards=2)
    rewrite_tensors(nan, lambda s: next(iter(s.values())).view(-1).__setitem__(5, float("nan")),
                    file="model-00001-of-00002.safetensors")  # fmt: skip
    builds = CANARIES.builds
    reports = [run_checks(v, NO_FINITE) for v in (versions[0], nan, versions[1], versions[2])]
    assert [r.ok for r in reports] == [True, False, True, True]
    assert reports[1].reason is not None and reports[1].reason.startswith("forward: logits contain NaN/Inf")
    assert CANARIES.builds - builds == 1
    assert [_by_name(r)["forward"].get("skeleton") for r in reports if r.ok] == ["built", "reused", "reused"]


def test_canary_rejects_garbled_weights(tmp_path: Path) -> None:
    d = published(tmp_path / "v", seed=4)
    rewrite_tensors(d, lambda s: s["model.norm.weight"].fill_(3e38))  # finite weights, infinite logits
    report = run_checks(d, NO_FINITE)
    assert not report.ok and report.reason is not None
    assert report.reason.startswith("forward: logits contain NaN/Inf")


def test_canary_rejects_tensors_that_do_not_fit_the_model(tmp_path: Path) -> None:
    d = published(tmp_path / "v", seed=4)
    w = "model.layers.0.mlp.down_proj.weight"
    rewrite_tensors(d, lambda s: s.__setitem__(w, s[w][:, :-1].contiguous()))
    report = run_checks(d, NO_FINITE)
    assert not report.ok and report.reason is not None
    assert report.reason.startswith("forward: ") and f"{w!r} has shape" in report.reason
    missing = published(tmp_path / "m", seed=4)
    rewrite_tensors(missing, lambda s: s.pop(w))
    report = run_checks(missing, NO_FINITE)
    assert report.reason is not None and f"{w!r}" in report.reason and "not in the checkpoint" in report.reason
    extra = published(tmp_path / "x", seed=4)
    rewrite_tensors(extra, lambda s: s.__setitem__("model.extra.weight", torch.zeros(3)))
    report = run_checks(extra, NO_FINITE)
    assert report.reason is not None and "'model.extra.weight' is not a parameter" in report.reason


def test_canary_logits_equal_a_whole_model_built_from_the_files(tmp_path: Path) -> None:
    from daemon.checks.forward import build_model

    d = published(tmp_path / "v", seed=6, shards=2)
    ids = [1, 17, 42, 5, 33, 8, 21, 60]
    report = run_checks(d, CheckSettings(isolate_checks=False, enabled=("forward",), forward_prompts=(tuple(ids),)))
    assert report.ok
    with torch.inference_mode():
        want = build_model(d, "cpu")(input_ids=torch.tensor([ids])).logits[0]
    assert _by_name(report)["forward"]["max_abs_logit"] == round(float(want.abs().max()), 4)


def test_an_architecture_change_builds_a_second_skeleton(tmp_path: Path) -> None:
    a = published(tmp_path / "a", seed=1)
    b = make_tiny_checkpoint(tmp_path / "b", seed=1, config_overrides={"tie_word_embeddings": True})
    builds = CANARIES.builds
    assert run_checks(a, NO_FINITE).ok and CANARIES.builds - builds == 1
    report = run_checks(b, CheckSettings(isolate_checks=False, enabled=("forward",)))
    assert report.ok, report.reason
    assert CANARIES.builds - builds == 2


def test_reference_logits_are_computed_once_per_serving_version(tmp_path: Path) -> None:
    ref = published(tmp_path / "serving", seed=0)
    bounds = CheckSettings(isolate_checks=False, forward_top1_min=0.0, forward_kl_max=100.0)
    REFERENCES.clear()
    builds = CANARIES.builds
    first = run_checks(published(tmp_path / "n1", seed=1), bounds, reference=ref)
    second = run_checks(published(tmp_path / "n2", seed=2), bounds, reference=ref)
    assert first.ok and second.ok
    assert _by_name(first)["forward"]["reference_logits"] == "computed"
    assert _by_name(second)["forward"]["reference_logits"] == "cached"
    assert CANARIES.builds - builds == 1
    same = run_checks(published(tmp_path / "same", seed=0), bounds, reference=ref)
    assert _by_name(same)["forward"]["top1_agreement"] == 1.0 and _by_name(same)["forward"]["kl"] == 0.0
    json.dumps([r.detail for r in same.results])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 run)")
def test_on_a_gpu_the_staged_copy_matches_the_files_and_the_checks_run_there(tmp_path: Path) -> None:
    d = published(tmp_path / "v", seed=1, shards=3, dtype="bfloat16")
    rels = sorted(p.name for p in d.iterdir())
    digests, copy = stage_files(d, rels, "cuda:0", alg="blake3", threads=4, chunk=4096)
    assert digests == hash_files([d / r for r in rels], alg="blake3", threads=4, chunk=4096)
    for r in rels:
        assert copy.file_bytes(r).cpu().numpy().tobytes() == (d / r).read_bytes()
    copy.release()
    settings = CheckSettings(isolate_checks=False, forward_device="cuda:0")
    report = run_checks(d, settings)
    assert report.ok, report.reason
    assert _by_name(report)["finite"]["scanned"] == "staged copy on cuda:0"
    nan = published(tmp_path / "nan", seed=2, dtype="bfloat16")
    rewrite_tensors(nan, lambda s: s["model.layers.0.mlp.up_proj.weight"].view(-1).__setitem__(77, float("nan")))
    report = run_checks(nan, settings)
    assert report.reason is not None and report.reason.startswith("finite: ") and "element 77" in report.reason
    report = run_checks(nan, CheckSettings(isolate_checks=False, forward_device="cuda:0", enabled=NO_FINITE.enabled))
    assert report.reason is not None and report.reason.startswith("forward: logits contain NaN/Inf")
    # isolated (the default): the GPU copy crosses to the check process as a CUDA IPC handle
    isolated = CheckSettings(forward_device="cuda:0")
    report = run_checks(d, isolated)
    assert report.ok and _by_name(report)["forward"]["weights"] == "crc32c pass", _by_name(report)["forward"]
    report = run_checks(nan, CheckSettings(forward_device="cuda:0", enabled=NO_FINITE.enabled))
    assert report.reason is not None and report.reason.startswith("forward: logits contain NaN/Inf")


def test_if_the_staged_paths_cannot_run_here_the_checks_fall_back_and_still_reject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import daemon.checks.finite as finite
    import daemon.checks.forward as forward

    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("not supported by this torch")

    monkeypatch.setattr(forward, "run_scanned", broken)
    monkeypatch.setattr(finite, "scan_staged", broken)
    good = published(tmp_path / "good", seed=1)
    report = run_checks(good, CheckSettings(isolate_checks=False))
    assert report.ok, report.reason
    assert _by_name(report)["forward"]["weights"].startswith("whole model built (canary failed: RuntimeError")
    assert _by_name(report)["finite"]["scanned"].startswith("files (the staged scan failed")
    nan = published(tmp_path / "nan", seed=2)
    rewrite_tensors(nan, lambda s: s["model.norm.weight"].__setitem__(0, float("nan")))
    assert (run_checks(nan, CheckSettings(isolate_checks=False)).reason or "").startswith("finite: ")
    assert (run_checks(nan, NO_FINITE).reason or "").startswith("forward: logits contain NaN/Inf")


def test_stage_device_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="stage_device must be auto, off, cpu, cuda or cuda:N"):
        CheckSettings.from_mapping({"stage_device": "gpu0"})
    assert CheckSettings.from_mapping({"stage_device": "cuda:1"}).staging_device == "cuda:1"
    assert CheckSettings(isolate_checks=False, stage_device="auto", forward_device="cuda:0").staging_device == "cuda:0"
    assert CheckSettings(isolate_checks=False, enabled=("manifest", "headers", "crc32c")).staging_device is None


def test_canary_runs_every_prompt_in_one_forward_with_each_prompts_own_logits(tmp_path: Path) -> None:
    """One right-padded batch (issue 41) gives each prompt the logits it gets alone."""
    import json

    from safetensors.torch import load_file

    from daemon.checks.canary import bind, run

    d = make_tiny_checkpoint(tmp_path / "v", seed=3)
    canary = CANARIES.get(json.loads((d / "config.json").read_text()), "cpu", "v")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        state.update(load_file(str(f)))
    bound = bind(canary, state, "v")
    prompts = [[1, 5, 9], [2, 7, 11, 13, 17, 19], [4]]
    runs = canary.runs
    together = run(canary, bound, prompts)
    assert canary.runs == runs + 1  # one forward for the three
    alone = [run(canary, bound, [p])[0] for p in prompts]
    assert [t.shape[0] for t in together] == [3, 6, 1]
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
