"""The `delta` section of a manifest: what a delta checkpoint is made against and which files carry it.

    "delta": {"format": "hotswap.delta/1",
              "base": {"version": "v1", "digest": "blake3:<hex>"},
              "files": [{"path": "hotswap-delta/model.safetensors.hsd", "target": "model.safetensors",
                         "bytes": N, "crc32c": "<8 hex>", "blake3": "<64 hex>"}],
              "delta_bytes": N, "full_bytes": N,
              "anchor": "v0", "chain_bytes": N,      # the last full version, delta bytes since it
              "chain_length": N}                     # deltas since the anchor, this one included

It is a top-level key of a format-2 manifest, so the signature covers it. The manifest's own
`files` are the *result* files; a result file that no delta file targets is the base's file of the
same path, unchanged (its listed hash must be the base's). `chain_bytes` is what the anchor rule
reads (daemon.delta.anchors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from daemon.delta.errors import DeltaError
from daemon.formats.names import ManifestError, check_relative_path, check_version_label
from daemon.hashing import HASH_ALGORITHMS, is_hex_digest
from daemon.manifest import Manifest, ManifestFile

FORMAT = "hotswap.delta/1"
KEY = "delta"
DELTA_DIR = "hotswap-delta"  # where the delta files live inside a delta checkpoint
SUFFIX = ".hsd"


class BaseMissing(DeltaError):
    """This host has no copy of the delta's base (registered as `base_id`): fetch it, then rebuild."""

    def __init__(self, message: str, base_id: int) -> None:
        super().__init__(message)
        self.base_id = base_id


@dataclass(frozen=True, slots=True)
class DeltaFile:
    path: str  # the delta file, relative to the delta checkpoint
    target: str  # the result file it rebuilds
    file: ManifestFile  # its bytes and hashes


@dataclass(frozen=True, slots=True)
class DeltaSpec:
    base_version: str
    base_digest: str
    files: tuple[DeltaFile, ...]
    delta_bytes: int
    full_bytes: int
    anchor: str
    chain_bytes: int
    chain_length: int

    @property
    def ratio(self) -> float:
        return self.delta_bytes / self.full_bytes if self.full_bytes else 0.0

    def to_doc(self, hash_alg: str) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "base": {"version": self.base_version, "digest": self.base_digest},
            "files": [{"path": f.path, "target": f.target, "bytes": f.file.bytes, "crc32c": f.file.crc32c,
                       hash_alg: f.file.hash} for f in self.files],  # fmt: skip
            "delta_bytes": self.delta_bytes,
            "full_bytes": self.full_bytes,
            "anchor": self.anchor,
            "chain_bytes": self.chain_bytes,
            "chain_length": self.chain_length,
        }


def delta_path(target: str) -> str:
    return f"{DELTA_DIR}/{target}{SUFFIX}"


def is_delta(manifest: Manifest) -> bool:
    return KEY in manifest.extra


def parse(manifest: Manifest, where: str) -> DeltaSpec | None:
    """The manifest's delta section, strictly checked; None for a full checkpoint."""
    doc = manifest.extra.get(KEY)
    if doc is None:
        return None
    alg = manifest.hash_alg
    if alg not in HASH_ALGORITHMS:
        raise DeltaError(f"{where}: a delta needs a format-2 manifest (strong hashes)")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DeltaError(f"{where}: delta.format must be {FORMAT!r}")
    base = doc.get("base")
    if not isinstance(base, dict) or not isinstance(base.get("version"), str) or not isinstance(base.get("digest"), str):
        raise DeltaError(f"{where}: delta.base must name a version and a digest")
    try:
        check_version_label(base["version"], where)
    except ManifestError as exc:
        raise DeltaError(f"{where}: delta.base.version: {exc}") from None
    b_alg, _, b_hex = base["digest"].partition(":")
    if not is_hex_digest(b_alg, b_hex):
        raise DeltaError(f"{where}: delta.base.digest {base['digest']!r:.80} is not <alg>:<hex>")
    if base["version"] == manifest.version:
        raise DeltaError(f"{where}: the delta names itself ({manifest.version}) as its base: a loop")
    results = {f.path for f in manifest.files}
    raw = doc.get("files")
    if not isinstance(raw, list):
        raise DeltaError(f"{where}: delta.files must be a list")
    files: list[DeltaFile] = []
    seen: set[str] = set()
    keys = {"path", "target", "bytes", "crc32c", alg}
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) != keys:
            raise DeltaError(f"{where}: delta.files[{i}] must have exactly {', '.join(sorted(keys))}")
        path, target = item["path"], item["target"]
        try:
            check_relative_path(path)
        except ManifestError as exc:
            raise DeltaError(f"{where}: delta.files[{i}]: {exc}") from None
        if target not in results:
            raise DeltaError(f"{where}: delta.files[{i}] rebuilds {target!r}, which the manifest does not list")
        if target in seen:
            raise DeltaError(f"{where}: {target!r} has two delta files")
        seen.add(target)
        size, crc, strong = item["bytes"], item["crc32c"], item[alg]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(crc, str) or len(crc) != 8:
            raise DeltaError(f"{where}: delta.files[{i}]: bytes and crc32c are malformed")
        if not is_hex_digest(alg, strong):
            raise DeltaError(f"{where}: delta.files[{i}]: {alg} must be 64 lowercase hex digits")
        files.append(DeltaFile(path, target, ManifestFile(path, size, crc, strong, alg)))
    numbers = [doc.get(k) for k in ("delta_bytes", "full_bytes", "chain_bytes", "chain_length")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
        raise DeltaError(f"{where}: delta_bytes, full_bytes, chain_bytes and chain_length must be non-negative integers")
    anchor = doc.get("anchor")
    if not isinstance(anchor, str):
        raise DeltaError(f"{where}: delta.anchor must name the last full version")
    delta_bytes, full_bytes, chain_bytes, chain_length = (n if isinstance(n, int) else 0 for n in numbers)
    return DeltaSpec(base["version"], base["digest"], tuple(files), delta_bytes, full_bytes, anchor, chain_bytes,
                     chain_length)  # fmt: skip


def fetched_files(manifest: Manifest, where: str) -> list[ManifestFile]:
    """What a source moves for this checkpoint: a delta's own files (the result files are rebuilt on
    the host from its base, daemon.pipeline.deltas), or a full checkpoint's files. Raises DeltaError."""
    spec = parse(manifest, where)
    return list(manifest.files) if spec is None else [f.file for f in spec.files]
