"""Check "compat": same tensor names, shapes and dtypes as the serving version.

A hot swap writes into the live parameters, so anything else needs a restart rollout (the
workers are relaunched on it: daemon.rollout.relaunch). With `checks.restart_rollouts` (set from
`[rollout] restart_rollouts`, on by default) such a checkpoint passes, its detail saying
`restart_rollout: true` and the differences; with it off it is rejected. A LoRA adapter
checkpoint is checked against the serving base instead (daemon.checks.adapter, chosen by the runner).

Tokenizers: a checkpoint without the tokenizer files the serving version has can be written in
place (the worker keeps the tokenizer it loaded), but a worker launched on its folder (a crash's
relaunch, a restart rollout) refuses every text prompt. compat says so in its detail
(`tokenizer_dropped`, a warning in the log) and rejects it with `checks.keep_tokenizer = true`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon.checks.base import CheckContext, CheckFailed, CheckSkipped
from daemon.checks.headers import load_table
from daemon.common import get_logger
from daemon.formats import HeaderError, LayoutError, tensor_table

log = get_logger(__name__)

MAX_LISTED = 3  # differences spelled out in the reason; the detail keeps up to 50
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")  # as the worker reads them


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _tokenizer(ctx: CheckContext, ref_dir: Path) -> dict[str, Any]:
    """{} when the candidate keeps what the serving version has; else the warning (or the rejection)."""
    if not has_tokenizer(ref_dir) or has_tokenizer(ctx.directory):
        return {}
    why = (f"has no tokenizer ({', '.join(TOKENIZER_FILES)}) while the serving version has one: a worker "
           "launched on its folder refuses text prompts (400 no_tokenizer)")  # fmt: skip
    if ctx.settings.keep_tokenizer:
        raise CheckFailed(f"{why}; checks.keep_tokenizer = true rejects it", {"reference": str(ref_dir)})
    log.warning("tokenizer_dropped", directory=str(ctx.directory), reason=why)
    return {"tokenizer_dropped": True, "warning": why}


def check_compat(ctx: CheckContext) -> dict[str, Any]:
    table = load_table(ctx)
    ref_dir = ctx.reference
    if ref_dir is None:
        raise CheckSkipped("no serving version or configured reference to compare with")
    try:
        ref_table, _ = tensor_table(ref_dir)
    except (LayoutError, HeaderError, OSError) as exc:
        raise CheckFailed(f"reference {ref_dir} unreadable: {exc}", {"reference": str(ref_dir)}) from None
    tokenizer = _tokenizer(ctx, ref_dir)
    diffs: list[str] = []
    for name in sorted(set(ref_table) | set(table)):
        ref = ref_table.get(name)
        new = table.get(name)
        if new is None:
            diffs.append(f"tensor {name!r} missing (serving has it)")
        elif ref is None:
            diffs.append(f"tensor {name!r} not in the serving version")
        else:
            if list(new.entry.shape) != list(ref.entry.shape):
                diffs.append(
                    f"tensor {name!r} shape {list(new.entry.shape)} != serving {list(ref.entry.shape)}"
                )
            if new.entry.dtype != ref.entry.dtype:
                diffs.append(f"tensor {name!r} dtype {new.entry.dtype} != serving {ref.entry.dtype}")
    if diffs:
        shown = "; ".join(diffs[:MAX_LISTED])
        more = f"; and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else ""
        detail = {"reference": str(ref_dir), "differences": diffs[:50], "difference_count": len(diffs)}
        if ctx.settings.restart_rollouts:
            return {**detail, **tokenizer, "tensors": len(table), "restart_rollout": True,
                    "note": f"cannot be written in place ({len(diffs)} differences: {shown}{more}): "
                            "rolled out by relaunching the workers on it"}  # fmt: skip
        raise CheckFailed(
            f"incompatible with the serving version ({len(diffs)} differences: {shown}{more}); "
            "needs a restart rollout, and [rollout] restart_rollouts = false forbids them",
            detail,
        )
    return {"reference": str(ref_dir), "tensors": len(table), **tokenizer}
