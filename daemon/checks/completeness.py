"""Check "manifest": every file present, nothing unlisted, sizes match, paths safe, signature valid."""

from __future__ import annotations

import json
from typing import Any

from daemon.checks.base import CheckContext, CheckFailed
from daemon.checks.signatures import SignatureError, verify_manifest_signature
from daemon.formats.checkpoint import INDEX_NAME, MANIFEST_NAME, LayoutError, weight_files
from daemon.manifest import ManifestError, ManifestFile, list_checkpoint_files, load_manifest


def check_manifest(ctx: CheckContext) -> dict[str, Any]:
    root = ctx.directory
    if not root.is_dir():
        raise CheckFailed(f"{root}: not a directory")
    settings = ctx.settings
    has_manifest = (root / MANIFEST_NAME).exists() or (root / MANIFEST_NAME).is_symlink()
    detail: dict[str, Any] = {}
    try:
        on_disk = list_checkpoint_files(root)
    except ManifestError as exc:
        raise CheckFailed(str(exc)) from None
    sizes = {rel: (root / rel).stat().st_size for rel in on_disk}

    if has_manifest:
        try:
            manifest = load_manifest(root)
        except ManifestError as exc:
            raise CheckFailed(str(exc)) from None
        if settings.keys_configured:
            try:
                detail["signature"] = verify_manifest_signature(
                    manifest, settings.hmac_keys, settings.ed25519_keys
                )
            except SignatureError as exc:
                raise CheckFailed(f"{MANIFEST_NAME}: {exc}") from None
        elif manifest.signature is not None:
            detail["signature"] = "present, not verified (no keys configured)"
        listed = {f.path: f for f in manifest.files}
        missing = [p for p in listed if p not in sizes]
        if missing:
            raise CheckFailed(
                f"{missing[0]}: listed in the manifest but missing from the checkpoint"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                {"missing": missing[:20]},
            )
        for path, entry in listed.items():
            if sizes[path] != entry.bytes:
                raise CheckFailed(
                    f"{path}: size {sizes[path]} bytes, manifest says {entry.bytes} "
                    f"({'truncated' if sizes[path] < entry.bytes else 'grown'})",
                    {"file": path, "bytes": sizes[path], "expected_bytes": entry.bytes},
                )
        extra = [p for p in on_disk if p not in listed]
        if extra:
            raise CheckFailed(
                f"{extra[0]}: file not listed in the manifest"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
                {"unlisted": extra[:20]},
            )
        ctx.manifest = manifest
        ctx.files = list(manifest.files)
        ctx.crcs_known = True
        ctx.digest = manifest.digest
        detail.update(source="manifest", version=manifest.version)
    else:
        if settings.require_manifest:
            raise CheckFailed(f"{MANIFEST_NAME} missing and checks.require_manifest is on")
        if settings.keys_configured:
            raise CheckFailed(
                f"{MANIFEST_NAME} missing: cannot verify a signature (signing keys are configured)"
            )
        ctx.files = [ManifestFile(rel, sizes[rel], "") for rel in on_disk]
        detail["source"] = "directory (no manifest: CRCs computed, nothing to compare)"

    # the safetensors layout: every shard the index names exists, and is part of the file list
    try:
        shards = weight_files(root)
    except LayoutError as exc:
        raise CheckFailed(str(exc)) from None
    for shard in shards:
        rel = shard.relative_to(root).as_posix()
        if rel not in sizes:
            raise CheckFailed(
                f"{rel}: shard listed in {INDEX_NAME} is missing", {"file": rel, "index": INDEX_NAME}
            )
    config = root / "config.json"
    if config.exists():
        try:
            if not isinstance(json.loads(config.read_bytes()), dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckFailed(f"config.json: not a valid JSON object ({exc})") from None
    detail.update(files=len(ctx.files), bytes=ctx.total_bytes, shards=len(shards))
    return detail
