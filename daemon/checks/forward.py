"""Check "forward": build the model from config.json, load the new weights, run fixed prompts.

Logits must be finite. When a bound is configured and a reference (serving) version
is known, the new model's top-1 agreement and mean KL(reference || new) against the
reference must stay within it. Nothing is downloaded: config and weights come from
the checkpoint directory; prompts are fixed token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.checks.base import DEFAULT_TEXTS, CheckContext, CheckFailed
from daemon.checks.headers import load_table
from daemon.formats.checkpoint import LayoutError, read_config, weight_files

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")  # as the worker looks


def build_model(directory: Path, device: str) -> torch.nn.Module:
    """The checkpoint's model from its config.json with its own weights, in eval mode."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    doc = _config_doc(directory)
    if doc is None:
        raise CheckFailed(f"{directory.name}/config.json missing: cannot build the model for a forward pass")
    try:
        # from the bounded read, not from_pretrained's own unbounded one (what AutoConfig does inside)
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = doc.get("model_type")
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ValueError(f"unknown model_type {model_type!r}")
        config = CONFIG_MAPPING[model_type].from_dict(doc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"{directory.name}/config.json: transformers cannot use it ({exc})") from None
    dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
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


def _logits(model: torch.nn.Module, prompts: list[list[int]], device: str) -> list[torch.Tensor]:
    import torch

    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            out.append(model(input_ids=x).logits[0].float().cpu())
    return out


def check_forward(ctx: CheckContext) -> dict[str, Any]:
    import torch

    load_table(ctx)  # headers are sound before torch reads them
    settings = ctx.settings
    device = settings.forward_device
    config = _config_doc(ctx.directory) or {}
    vocab_size = config.get("vocab_size")
    vocab = vocab_size if isinstance(vocab_size, int) and vocab_size > 0 else 2**31
    prompts, source = prompt_ids(ctx, vocab)
    model = build_model(ctx.directory, device)
    new = _logits(model, prompts, device)
    del model
    for i, logits in enumerate(new):
        finite = torch.isfinite(logits)
        if not bool(finite.all()):
            pos = int((~finite).any(dim=-1).nonzero()[0, 0])
            raise CheckFailed(
                f"logits contain NaN/Inf (prompt {i}, position {pos}) on {device}",
                {"prompt": i, "position": pos, "device": device},
            )
    detail: dict[str, Any] = {
        "device": device,
        "prompts": len(prompts),
        "prompt_source": source,
        "positions": sum(len(p) for p in prompts),
        "max_abs_logit": round(max(float(x.abs().max()) for x in new), 4),
    }
    wants_reference = settings.forward_top1_min is not None or settings.forward_kl_max is not None
    if not wants_reference:
        return detail
    if ctx.reference is None:
        detail["reference"] = "none (no serving version); agreement bounds not applied"
        return detail
    ref_model = build_model(ctx.reference, device)
    ref = _logits(ref_model, prompts, device)
    del ref_model
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
