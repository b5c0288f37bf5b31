"""Check "headers": strict safetensors headers, tensor names unique, index weight_map agrees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon.checks.base import CheckContext, CheckFailed
from daemon.formats import (
    INDEX_NAME,
    HeaderError,
    LayoutError,
    SafetensorsHeader,
    TensorLocation,
    read_header,
    read_index,
    weight_files,
)


def load_table(ctx: CheckContext) -> dict[str, TensorLocation]:
    """Parse every shard's header once (cached on the context); raise CheckFailed on any fault."""
    if ctx.table is not None:
        return ctx.table
    root = ctx.directory
    try:
        shards = weight_files(root)
    except LayoutError as exc:
        raise CheckFailed(str(exc)) from None
    headers: list[SafetensorsHeader] = []
    table: dict[str, TensorLocation] = {}
    for shard in shards:
        rel = shard.relative_to(root).as_posix()
        try:
            h = read_header(shard, cap=ctx.settings.header_cap_bytes)
        except HeaderError as exc:
            raise CheckFailed(_relative(str(exc), root), {"file": rel}) from None
        except OSError as exc:
            raise CheckFailed(f"{rel}: unreadable ({exc.strerror or exc})", {"file": rel}) from None
        for e in h.tensors:
            if e.name in table:
                other = table[e.name].file.relative_to(root).as_posix()
                raise CheckFailed(
                    f"tensor {e.name!r} appears in both {other} and {rel}", {"tensor": e.name, "file": rel}
                )
            table[e.name] = TensorLocation(shard, e)
        headers.append(h)
    ctx.headers = headers
    ctx.table = table
    return table


def _relative(message: str, root: Path) -> str:
    return message.replace(f"{root}/", "")


def check_headers(ctx: CheckContext) -> dict[str, Any]:
    table = load_table(ctx)
    root = ctx.directory
    assert ctx.headers is not None
    # safetensors' own parser as a second opinion: it must accept every file ours accepts
    from safetensors import safe_open

    for h in ctx.headers:
        rel = h.path.relative_to(root).as_posix()
        try:
            with safe_open(str(h.path), framework="numpy") as f:
                theirs = set(f.keys())
        except Exception as exc:  # safetensors raises its own SafetensorError; any failure rejects
            raise CheckFailed(f"{rel}: rejected by the safetensors library ({exc})", {"file": rel}) from None
        ours = {e.name for e in h.tensors}
        if theirs != ours:
            raise CheckFailed(f"{rel}: tensor names disagree with the safetensors library", {"file": rel})
    detail: dict[str, Any] = {
        "shards": len(ctx.headers),
        "tensors": len(table),
        "tensor_bytes": sum(loc.entry.nbytes for loc in table.values()),
    }
    index = root / INDEX_NAME
    if index.exists() or index.is_symlink():
        detail.update(_check_index(table, root))
    return detail


def _check_index(table: dict[str, TensorLocation], root: Path) -> dict[str, Any]:
    try:
        doc = read_index(root)
    except LayoutError as exc:
        raise CheckFailed(_relative(str(exc), root)) from None
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckFailed(f"{INDEX_NAME}: weight_map must map tensor names to shard file names")
    for name, shard in weight_map.items():
        loc = table.get(name)
        if loc is None:
            raise CheckFailed(
                f"{INDEX_NAME}: tensor {name!r} mapped to {shard} is not in any shard",
                {"tensor": name, "file": shard},
            )
        actual = loc.file.relative_to(root).as_posix()
        if actual != shard:
            raise CheckFailed(
                f"{INDEX_NAME}: tensor {name!r} mapped to {shard} but found in {actual}",
                {"tensor": name, "file": actual},
            )
    unmapped = sorted(set(table) - set(weight_map))
    if unmapped:
        rel = table[unmapped[0]].file.relative_to(root).as_posix()
        raise CheckFailed(
            f"{INDEX_NAME}: tensor {unmapped[0]!r} in {rel} is missing from weight_map"
            + (f" (and {len(unmapped) - 1} more)" if len(unmapped) > 1 else ""),
            {"tensor": unmapped[0], "file": rel},
        )
    out: dict[str, Any] = {"index": "agrees with shards"}
    total = (doc.get("metadata") or {}).get("total_size") if isinstance(doc.get("metadata"), dict) else None
    tensor_bytes = sum(loc.entry.nbytes for loc in table.values())
    if isinstance(total, int) and total != tensor_bytes:
        # writers disagree on what total_size counts; worth a note, not a rejection
        out["warning"] = f"index metadata.total_size {total} != tensor bytes {tensor_bytes}"
    return out
