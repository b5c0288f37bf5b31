"""Check "forward": run fixed prompts through the model of config.json with the new weights.

The model is a persistent canary (daemon.checks.canary): its skeleton is built once per
architecture and run on the staged tensors (the crc32c pass's copy on the staging device, or one
read of the weights when there is none); no model is constructed per version. `build_model`
(a whole model with its own weights) stays for tools and tests that want one.

Logits must be finite. When a bound is configured and a reference (serving) version
is known, the new model's top-1 agreement and mean KL(reference || new) against the
reference must stay within it. Nothing is downloaded: config and weights come from
the checkpoint directory; prompts are fixed token ids.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from daemon.bytepipe import StagedTensors, stage_files
from daemon.checks.base import DEFAULT_TEXTS, CheckContext, CheckFailed, deferred_for_memory, memory_short
from daemon.checks.canary import CANARIES, REFERENCES, bind, model_config, run_scanned, weights_identity
from daemon.checks.headers import load_table
from daemon.formats import HeaderError, LayoutError, read_config, tensor_table, weight_files

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")  # as the worker looks


def build_model(directory: Path, device: str) -> torch.nn.Module:
    """The checkpoint's model from its config.json with its own weights, in eval mode."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    doc = _config_doc(directory)
    if doc is None:
        raise CheckFailed(f"{directory.name}/config.json missing: cannot build the model for a forward pass")
    # from the bounded read, not from_pretrained's own unbounded one (what AutoConfig does inside)
    config, dtype = model_config(doc, directory.name)
    try:
        # Built straight on `device` with no random initialisation: every weight is loaded next
        # (a missing one is refused below). Random init on the CPU cost ~10 s per 1B parameters.
        with torch.device(device), _no_init_weights():
            try:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # skipped along with initialisation in some releases
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"{directory.name}/config.json: no causal LM for this config ({exc})") from None
    state: dict[str, torch.Tensor] = {}
    for shard in weight_files(directory):
        state.update(load_file(str(shard), device=device))
    result = model.load_state_dict(state, strict=False)
    loaded_ptrs = {p.data_ptr() for n, p in model.named_parameters() if n in state}
    params = dict(model.named_parameters())
    # tied weights (lm_head = embed_tokens) are absent from the file but share storage
    missing = [k for k in result.missing_keys if k in params and params[k].data_ptr() not in loaded_ptrs]
    missing += [k for k in result.missing_keys if k not in params]  # persistent buffers
    if missing:
        raise CheckFailed(
            f"{directory.name}: model needs tensor {missing[0]!r}, not in the checkpoint"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            {"missing": missing[:20]},
        )
    if result.unexpected_keys:
        bad = result.unexpected_keys
        raise CheckFailed(
            f"{directory.name}: tensor {bad[0]!r} is not a parameter of {type(model).__name__}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
            {"unexpected": bad[:20]},
        )
    return model.to(device).eval()


def _config_doc(directory: Path) -> dict[str, Any] | None:
    try:
        return read_config(directory)
    except LayoutError as exc:
        raise CheckFailed(str(exc).replace(f"{directory.parent}/", "")) from None


def _no_init_weights() -> Any:
    """transformers' context that skips random weight initialisation (moved in 5.x)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def prompt_ids(ctx: CheckContext, vocab: int) -> tuple[list[list[int]], str]:
    """Token ids to run: the fixed texts through the checkpoint's tokenizer, else fixed ids."""
    d = ctx.directory
    if not any((d / f).exists() for f in TOKENIZER_FILES):
        return [[t % vocab for t in p] for p in ctx.settings.forward_prompts], "token ids (no tokenizer)"
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        prompts = [list(tokenizer(text)["input_ids"]) for text in DEFAULT_TEXTS]
    except Exception as exc:  # transformers raises many kinds; the worker would fail the same way
        raise CheckFailed(
            f"{d.name}: tokenizer files present but unusable ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    for text, ids in zip(DEFAULT_TEXTS, prompts, strict=True):
        if not ids:
            raise CheckFailed(f"{d.name}: tokenizer turns {text!r} into no tokens")
        if max(ids) >= vocab:
            raise CheckFailed(
                f"{d.name}: tokenizer gives id {max(ids)} for {text!r}, beyond vocab_size {vocab}",
                {"text": text, "ids": ids[:50]},
            )
    return prompts, "tokenizer"


def _staged_state(ctx: CheckContext, directory: Path, device: str) -> tuple[dict[str, torch.Tensor], StagedTensors, bool]:
    """The checkpoint's tensors as views of a staged copy on `device`: the crc32c pass's copy
    when it is there (the hashed bytes), else one read of the weight files (released by the
    caller when the third value is True)."""
    table = load_table(ctx) if directory == ctx.directory else tensor_table(directory)[0]
    staged = ctx.staged if directory == ctx.directory else None
    own = not (isinstance(staged, StagedTensors) and _same_device(staged.device, device))
    copy: StagedTensors
    if own:
        try:
            rels = sorted(f.relative_to(directory).as_posix() for f in {loc.file for loc in table.values()})
            _digests, copy = stage_files(directory, rels, device, alg=None, crc=False,
                                         threads=ctx.settings.crc_threads)  # fmt: skip
        except OSError as exc:
            raise CheckFailed(f"{directory.name}: reading the weights failed: {exc}") from None
    else:
        assert isinstance(staged, StagedTensors)
        copy = staged
    try:
        return {name: copy.tensor(name, loc, directory) for name, loc in table.items()}, copy, own
    except BaseException:
        if own:
            copy.release()
        raise


def _logits(model: torch.nn.Module, prompts: list[list[int]], device: str) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            out.append(model(input_ids=x).logits[0].float().cpu())
    return out


def _same_device(a: str, b: str) -> bool:
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type and (da.index or 0) == (db.index or 0)


def _canary_logits(
    ctx: CheckContext, directory: Path, device: str, prompts: list[list[int]], timing: dict[str, float] | None = None
) -> tuple[list[torch.Tensor], list[tuple[float, float]], str]:
    """The canary's logits and each prompt's extremes (daemon.checks.canary.run_scanned); `timing`
    (when given) gets the ms of each step: skeleton, views, bind, run."""
    marks = [time.perf_counter()]
    doc = _config_doc(directory)
    if doc is None:
        raise CheckFailed(f"{directory.name}/config.json missing: cannot build the model for a forward pass")
    canary = CANARIES.get(doc, device, directory.name, ctx.settings.canary_dtype)
    marks.append(time.perf_counter())
    state, copy, own = _staged_state(ctx, directory, device)
    marks.append(time.perf_counter())
    bound: dict[str, torch.Tensor] = {}
    try:
        bound = bind(canary, state, directory.name)
        marks.append(time.perf_counter())
        logits, extremes = run_scanned(canary, bound, prompts)
        marks.append(time.perf_counter())
        if timing is not None:
            steps = ("skeleton", "views", "bind", "run")
            timing.update({k: round((b - a) * 1e3, 2) for k, a, b in zip(steps, marks[:-1], marks[1:], strict=True)})
        return logits, extremes, "crc32c pass" if not own else "read for the forward check"
    finally:
        bound.clear()  # no view may outlive the copy: its memory goes back when it is released
        state.clear()
        if own:
            copy.release()


def check_forward(ctx: CheckContext) -> dict[str, Any]:
    began = time.perf_counter()
    load_table(ctx)  # headers are sound before torch reads them
    settings = ctx.settings
    device = settings.forward_device
    config = _config_doc(ctx.directory) or {}
    vocab_size = config.get("vocab_size")
    vocab = vocab_size if isinstance(vocab_size, int) and vocab_size > 0 else 2**31
    prompts, source = prompt_ids(ctx, vocab)
    builds = CANARIES.builds
    timing: dict[str, float] = {"before": _ms_since(began)}  # issue 41: every part of the check's time
    try:
        new, extremes, weights_from = _canary_logits(ctx, ctx.directory, device, prompts, timing)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError) as exc:
        if memory_short(exc):  # the whole model would need more: the version is deferred, not rejected
            raise deferred_for_memory("forward", exc) from None
        # the canary is an optimisation: if this transformers/torch cannot run it, build the model
        new = _logits(build_model(ctx.directory, device), prompts, device)
        extremes = [(float(lo), float(hi)) for lo, hi in (torch.aminmax(logits) for logits in new)]
        weights_from = f"whole model built (canary failed: {type(exc).__name__}: {str(exc)[:160]})"
    max_abs = 0.0
    for i, (logits, (low, high)) in enumerate(zip(new, extremes, strict=True)):
        # min and max are finite only when every element is (torch propagates NaN through both);
        # the exact scan (temporaries the size of the logits: ~100 ms on the CPU for three prompts
        # of a 128k vocabulary) runs only to name the position
        if math.isfinite(low) and math.isfinite(high):
            max_abs = max(max_abs, high, -low)
            continue
        finite = torch.isfinite(logits)
        if not bool(finite.all()):
            pos = int((~finite).any(dim=-1).nonzero()[0, 0])
            raise CheckFailed(
                f"logits contain NaN/Inf (prompt {i}, position {pos}) on {device}",
                {"prompt": i, "position": pos, "device": device},
            )
    with contextlib.suppress(OSError, LayoutError):  # the next version's reference, if this one serves
        REFERENCES.put(_reference_key(ctx.directory, device, prompts), new)
    timing["after"] = round(_ms_since(began) - sum(timing.values()), 2)  # the logits scanned, the reference kept
    detail: dict[str, Any] = {
        "device": device,
        "prompts": len(prompts),
        "prompt_source": source,
        "positions": sum(len(p) for p in prompts),
        "max_abs_logit": round(max_abs, 4),
        "weights": weights_from,
        "skeleton": "built" if CANARIES.builds != builds else "reused",
        "ms": timing,
    }
    wants_reference = settings.forward_top1_min is not None or settings.forward_kl_max is not None
    if not wants_reference:
        return detail
    if ctx.reference is None:
        detail["reference"] = "none (no serving version); agreement bounds not applied"
        return detail
    try:
        ref_key = _reference_key(ctx.reference, device, prompts)
    except (OSError, LayoutError) as exc:
        raise CheckFailed(f"serving version {ctx.reference.name}: cannot read its weights ({exc})") from None
    ref = REFERENCES.get(ref_key)
    detail["reference_logits"] = "cached" if ref is not None else "computed"
    if ref is None:
        try:
            ref = _canary_logits(ctx, ctx.reference, device, prompts)[0]
        except (LayoutError, HeaderError) as exc:
            raise CheckFailed(f"serving version {ctx.reference.name}: {exc}") from None
        REFERENCES.put(ref_key, ref)
    if ref[0].shape[-1] != new[0].shape[-1]:  # a resized vocabulary (a restart rollout): nothing to compare
        detail["reference"] = (f"{ctx.reference} has a vocabulary of {ref[0].shape[-1]}, this one {new[0].shape[-1]}: "
                               "agreement bounds not applied")  # fmt: skip
        return detail
    new_all, ref_all = torch.cat(new), torch.cat(ref)
    top1 = float((new_all.argmax(-1) == ref_all.argmax(-1)).float().mean())
    ref_logp, new_logp = ref_all.log_softmax(-1), new_all.log_softmax(-1)
    kl = float((ref_logp.exp() * (ref_logp - new_logp)).sum(-1).mean())
    detail.update(reference=str(ctx.reference), top1_agreement=round(top1, 4), kl=round(kl, 6))
    if settings.forward_top1_min is not None and top1 < settings.forward_top1_min:
        raise CheckFailed(
            f"top-1 agreement with the serving version {top1:.3f} < bound {settings.forward_top1_min}",
            detail,
        )
    if settings.forward_kl_max is not None and kl > settings.forward_kl_max:
        raise CheckFailed(f"KL(serving || new) {kl:.4g} nats > bound {settings.forward_kl_max}", detail)
    return detail


def _reference_key(directory: Path, device: str, prompts: list[list[int]]) -> tuple[Any, ...]:
    doc = _config_doc(directory)
    return (
        weights_identity(weight_files(directory)),
        json.dumps(doc, sort_keys=True, default=str),
        device,
        tuple(tuple(p) for p in prompts),
    )


def _ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 2)
