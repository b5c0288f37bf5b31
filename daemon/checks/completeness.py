"""Check "manifest": every file present, nothing unlisted, sizes match, paths safe, signature valid.

Format 2 lists a strong hash per file under the signature; the crc32c check compares
the bytes with it. Format 1 lists only CRC32C, which a deliberate edit can keep (CRC32C
is linear): it is read, flagged weak in the detail and the log. Where signature keys are
configured it is refused unless `checks.allow_format1_manifest` is on: the operator asked
for a signature to protect the weights, and a format-1 signature covers only CRCs. (An
unsigned manifest of either format is no proof against whoever can write the directory,
and both catch accidents, so require_manifest alone does not refuse format 1.) The
strong hashes are then computed from the bytes as they are now: they pin the content
from here on; they cannot prove what the publisher meant.
"""

from __future__ import annotations

from typing import Any

from daemon.checks.base import CheckContext, CheckFailed
from daemon.checks.signatures import SignatureError, verify_manifest_signature
from daemon.common import get_logger
from daemon.formats import INDEX_NAME, MANIFEST_NAME, LayoutError, read_config, weight_files
from daemon.manifest import FORMAT_1, ManifestError, ManifestFile, list_checkpoint_files, load_manifest

log = get_logger(__name__)

FORMAT1_WEAK = (
    f"{FORMAT_1} lists only CRC32C, which cannot detect a deliberate (CRC-preserving) edit; "
    "strong hashes are computed from the bytes as they are now, not proven against the publisher"
)
FORMAT1_SIGNED = (
    "its signature covers only CRC32C values, so it does not protect the weights"
)


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
        if manifest.weak:
            detail.update(_format1(ctx, manifest.signature is not None))
        if settings.keys_configured:
            try:
                detail["signature"] = verify_manifest_signature(
                    manifest, settings.hmac_keys, settings.ed25519_keys
                )
            except SignatureError as exc:
                raise CheckFailed(f"{MANIFEST_NAME}: {exc}") from None
            if manifest.weak:
                detail["signature"]["covers"] = "crc32c only (format 1)"
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
        ctx.files = [ManifestFile(f.path, f.bytes, "") for f in manifest.files]
        ctx.file_list_from = "manifest"
        detail.update(
            source="manifest",
            format=manifest.format,
            hash_alg=manifest.hash_alg,
            version=manifest.version,
        )
    else:
        if settings.require_manifest:
            raise CheckFailed(f"{MANIFEST_NAME} missing and checks.require_manifest is on")
        if settings.keys_configured:
            raise CheckFailed(
                f"{MANIFEST_NAME} missing: cannot verify a signature (signing keys are configured)"
            )
        ctx.files = [ManifestFile(rel, sizes[rel], "") for rel in on_disk]
        ctx.file_list_from = "directory"
        detail["source"] = "directory (no manifest: the hashes computed next become the reference)"

    # the safetensors layout: every shard the index names exists, and is part of the file list
    try:
        shards = weight_files(root)
        read_config(root)  # bounded, regular file, inside the checkpoint, a JSON object
    except LayoutError as exc:
        raise CheckFailed(_relative(str(exc), root)) from None
    for shard in shards:
        rel = shard.relative_to(root).as_posix()
        if rel not in sizes:
            raise CheckFailed(
                f"{rel}: shard listed in {INDEX_NAME} is missing", {"file": rel, "index": INDEX_NAME}
            )
    detail.update(files=len(ctx.files), bytes=ctx.total_bytes, shards=len(shards))
    return detail


def _format1(ctx: CheckContext, signed: bool) -> dict[str, Any]:
    """Refuse a format-1 manifest where signatures are required, unless allowed; else flag it weak."""
    settings = ctx.settings
    trusted = settings.keys_configured
    if trusted and not settings.allow_format1_manifest:
        raise CheckFailed(
            f"{MANIFEST_NAME} is {FORMAT_1} (CRC32C only; {FORMAT1_SIGNED if signed else 'unsigned'}) and "
            "signature keys are configured: re-publish it with `hotswap publish` (format 2), "
            "or set checks.allow_format1_manifest = true",
            {"format": FORMAT_1, "weak": FORMAT1_WEAK},
        )
    weak = FORMAT1_WEAK + (f"; {FORMAT1_SIGNED}" if signed else "")
    log.warning(
        "weak_manifest",
        directory=str(ctx.directory),
        format=FORMAT_1,
        signed=signed,
        allowed_by="checks.allow_format1_manifest" if trusted else None,
        detail=weak,
    )
    return {"weak": weak}


def _relative(message: str, root: object) -> str:
    return message.replace(f"{root}/", "")
