"""Checks "compat" and "forward" for a LoRA adapter checkpoint (PEFT layout: daemon.formats.adapter).

compat: the adapter against the serving base (the reference directory): it names a base and that
base is the one serving (its config's `_name_or_path`, its version label or its digest); every
target module matches a module of the base; every pair's `lora_A` is `[r, in]` and `lora_B`
`[out, r]` with `r` the declared rank and `in`/`out` the base weight's; the weights are
floating point. A refusal names the module and both shapes.

forward: the base's forward canary (daemon.checks.canary) run twice on the fixed prompts, on the
base weights and on the base with the adapter merged into them (`W + scale * B @ A`, summed in float32,
run in `checks.engine_dtype`), each merged delta at most `checks.adapter_delta_max` x its weight's norm:
the logits must be finite, and the change from the base bounded: mean KL(base || adapted) at most
`checks.adapter_kl_max` nats, top-1 agreement at least `checks.adapter_top1_min` when set.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from daemon.checks.base import CheckContext, CheckFailed
from daemon.checks.headers import load_table
from daemon.formats import (
    ADAPTER_WEIGHTS,
    MANIFEST_NAME,
    AdapterConfig,
    AdapterLayoutError,
    LayoutError,
    LoraPair,
    SmallFileError,
    TensorLocation,
    identity,
    lora_pairs,
    read_adapter_config,
    read_config,
    read_json_object,
    tensor_table,
)

FLOAT_DTYPES = ("F32", "F16", "BF16")


def adapter_facts(ctx: CheckContext) -> tuple[AdapterConfig, dict[str, LoraPair], str, str | None]:
    """(config, pairs, name, base) of the adapter under check; CheckFailed naming the problem."""
    table = load_table(ctx)
    try:
        cfg = read_adapter_config(ctx.directory)
        version = ctx.manifest.version if ctx.manifest is not None and ctx.manifest.version else ctx.directory.name
        name, base = identity(ctx.directory, version, ctx.manifest.extra if ctx.manifest is not None else None)
        pairs = lora_pairs(list(table))
    except AdapterLayoutError as exc:
        raise CheckFailed(str(exc)) from None
    files = {loc.file.name for loc in table.values()}
    if files != {ADAPTER_WEIGHTS}:
        raise CheckFailed(f"the adapter's weights must be one file, {ADAPTER_WEIGHTS} (found {sorted(files)})")
    return cfg, pairs, name, base


def base_identities(ref: Path) -> dict[str, str]:
    """What the serving base answers to: config `_name_or_path`, manifest version and digest."""
    out: dict[str, str] = {}
    with contextlib.suppress(LayoutError):
        doc = read_config(ref) or {}
        if isinstance(doc.get("_name_or_path"), str) and doc["_name_or_path"]:
            out["name_or_path"] = doc["_name_or_path"]
    with contextlib.suppress(SmallFileError):
        m = read_json_object(ref, MANIFEST_NAME, 16 * 1024 * 1024)
        for key in ("version", "digest"):
            if isinstance(m.get(key), str) and m[key]:
                out[key] = m[key]
    out.setdefault("version", ref.name)
    return out


def _reference(ctx: CheckContext) -> Path:
    if ctx.reference is None:
        raise CheckFailed("no serving base model to check the adapter against (deploy a base checkpoint first, "
                          "or set checks.reference_dir)")  # fmt: skip
    return ctx.reference


def check_adapter_compat(ctx: CheckContext) -> dict[str, Any]:
    cfg, pairs, name, base = adapter_facts(ctx)
    if cfg.scale > ctx.settings.adapter_scale_max:
        raise CheckFailed(f"adapter scale {cfg.scale:.6g} (lora_alpha {cfg.alpha:g} / r {cfg.r}) is over "
                          f"checks.adapter_scale_max {ctx.settings.adapter_scale_max:g}", {"scale": cfg.scale})  # fmt: skip
    ref = _reference(ctx)
    known = base_identities(ref)
    if base is None:
        raise CheckFailed("the adapter names no base model (adapter_config.json base_model_name_or_path, or "
                          "`hotswap publish --base-model`): cannot tell what it was trained for")  # fmt: skip
    if base not in known.values():
        raise CheckFailed(
            f"adapter {name!r} was trained for base {base!r}; the serving base is {known.get('version')!r}"
            + (f" ({known['name_or_path']})" if "name_or_path" in known else ""),
            {"base_model": base, "serving": known},
        )
    try:
        ref_table, _ = tensor_table(ref)
    except (LayoutError, OSError, ValueError) as exc:
        raise CheckFailed(f"serving base {ref.name} unreadable: {exc}") from None
    table = load_table(ctx)
    for module, pair in pairs.items():
        _check_pair(cfg, pair, table[pair.a], table[pair.b], ref_table.get(f"{module}.weight"))
    modules = {n.removesuffix(".weight") for n, loc in ref_table.items() if n.endswith(".weight") and len(loc.entry.shape) == 2}
    if cfg.target_regex:
        unmatched = [] if any(cfg.targets(m) for m in modules) else list(cfg.target_modules)
    else:
        unmatched = [t for t in cfg.target_modules if not any(m == t or m.endswith("." + t) for m in modules)]
    if unmatched:
        raise CheckFailed(f"target module {unmatched[0]!r} matches no module of the serving base {known['version']}",
                          {"target_modules": list(cfg.target_modules)})  # fmt: skip
    return {"adapter": name, "base_model": base, "serving_base": known.get("version"), "rank": cfg.r,
            "scale": round(cfg.scale, 6), "modules": len(pairs), "target_modules": list(cfg.target_modules)}  # fmt: skip


def _check_pair(cfg: AdapterConfig, pair: LoraPair, a: TensorLocation, b: TensorLocation,
                base: TensorLocation | None) -> None:  # fmt: skip
    module = pair.module
    if not cfg.targets(module):
        raise CheckFailed(f"module {module}: has LoRA weights but is not in target_modules {list(cfg.target_modules)}",
                          {"module": module})  # fmt: skip
    if base is None or len(base.entry.shape) != 2:
        raise CheckFailed(f"module {module}: the serving base has no linear weight {module}.weight to adapt",
                          {"module": module})  # fmt: skip
    out_f, in_f = base.entry.shape
    want_a, want_b = [cfg.r, in_f], [out_f, cfg.r]
    for which, loc, want in (("lora_A", a, want_a), ("lora_B", b, want_b)):
        got = list(loc.entry.shape)
        if got != want:
            raise CheckFailed(
                f"module {module}: {which} shape {got} != {want} (rank r={cfg.r}, base weight {list(base.entry.shape)})",
                {"module": module, "tensor": loc.entry.name, "shape": got, "expected": want},
            )
        if loc.entry.dtype not in FLOAT_DTYPES:
            raise CheckFailed(f"module {module}: {which} dtype {loc.entry.dtype} is not one of {', '.join(FLOAT_DTYPES)}",
                              {"module": module, "dtype": loc.entry.dtype})  # fmt: skip


def _bound_delta(module: str, delta: Any, w: Any, most: float) -> None:
    """The merged delta's magnitude: |scale * B @ A| / |W| (Frobenius) at most `most`; a scale
    within bounds can still come with B and A large enough to bury the base weight."""
    ratio = float(delta.norm()) / max(float(w.float().norm()), 1e-12)
    if not ratio <= most:  # NaN too
        raise CheckFailed(f"module {module}: the merged delta |scale * B @ A| is {ratio:.4g} x the base weight's "
                          f"norm, over checks.adapter_delta_max {most:g}", {"module": module, "delta_ratio": ratio})  # fmt: skip


def check_adapter_forward(ctx: CheckContext) -> dict[str, Any]:
    import torch

    from daemon.checks.canary import CANARIES, bind, run
    from daemon.checks.forward import _config_doc, _staged_state

    cfg, pairs, _name, _base = adapter_facts(ctx)
    ref = _reference(ctx)
    settings = ctx.settings
    device = settings.forward_device
    doc = _config_doc(ref)
    if doc is None:
        raise CheckFailed(f"serving base {ref.name}/config.json missing: cannot run the adapter's forward canary")
    vocab_size = doc.get("vocab_size")
    vocab = vocab_size if isinstance(vocab_size, int) and vocab_size > 0 else 2**31
    prompts = [[t % vocab for t in p] for p in settings.forward_prompts]
    canary = CANARIES.get(doc, device, ref.name, settings.canary_dtype)
    base_state, base_copy, own_base = _staged_state(ctx, ref, device)
    lora_state, lora_copy, own_lora = _staged_state(ctx, ctx.directory, device)
    bound: dict[str, torch.Tensor] = {}
    try:
        bound = bind(canary, base_state, ref.name)
        base_logits = run(canary, bound, prompts)
        for module, pair in pairs.items():
            key = f"{module}.weight"
            w = bound.get(key)
            if w is None:
                raise CheckFailed(f"module {module}: not a parameter of the base model's forward pass", {"module": module})
            a, b = lora_state[pair.a].float(), lora_state[pair.b].float()
            delta = cfg.scale * (b @ a)
            _bound_delta(module, delta, w, settings.adapter_delta_max)
            bound[key] = (w.float() + delta).to(w.dtype)  # in the engine's dtype: an fp16 overflow shows
        adapted = run(canary, bound, prompts)
    finally:
        bound.clear()
        base_state.clear()
        lora_state.clear()
        for copy, own in ((base_copy, own_base), (lora_copy, own_lora)):
            if own:
                copy.release()
    for i, logits in enumerate(adapted):
        finite = torch.isfinite(logits)
        if not bool(finite.all()):
            pos = int((~finite).any(dim=-1).nonzero()[0, 0])
            raise CheckFailed(f"logits with the adapter contain NaN/Inf (prompt {i}, position {pos}) on {device}",
                              {"prompt": i, "position": pos})  # fmt: skip
    new_all, ref_all = torch.cat(adapted), torch.cat(base_logits)
    top1 = float((new_all.argmax(-1) == ref_all.argmax(-1)).float().mean())
    ref_logp, new_logp = ref_all.log_softmax(-1), new_all.log_softmax(-1)
    kl = float((ref_logp.exp() * (ref_logp - new_logp)).sum(-1).mean())
    detail = {"device": device, "prompts": len(prompts), "base": ref.name, "kl_from_base": round(kl, 6),
              "top1_agreement": round(top1, 4), "max_abs_logit": round(float(new_all.abs().max()), 4)}  # fmt: skip
    if settings.adapter_kl_max is not None and kl > settings.adapter_kl_max:
        raise CheckFailed(f"the adapter moves the base too far: KL(base || adapted) {kl:.4g} nats > "
                          f"checks.adapter_kl_max {settings.adapter_kl_max}", detail)  # fmt: skip
    if settings.adapter_top1_min is not None and top1 < settings.adapter_top1_min:
        raise CheckFailed(f"top-1 agreement with the base {top1:.3f} < checks.adapter_top1_min "
                          f"{settings.adapter_top1_min}", detail)  # fmt: skip
    return detail
