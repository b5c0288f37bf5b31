"""The `delta` section of a manifest: what a delta checkpoint is made against and which files carry it.

    "delta": {"format": "hotswap.delta/1",
              "base": {"version": "v1", "digest": "blake3:<hex>"},
              "files": [{"path": "hotswap-delta/model.safetensors.hsd", "target": "model.safetensors",
                         "bytes": N, "crc32c": "<8 hex>", "blake3": "<64 hex>"}],
              "delta_bytes": N, "full_bytes": N,
              "anchor": "v0", "chain_bytes": N,      # the last full version, delta bytes since it
              "chain_length": N,                     # deltas since the anchor, this one included
              "anchor_digest": "blake3:<hex>",       # optional: the anchor's content digest
              "changed": {"tensors": N, "elements": N},   # optional: what differs from the base
              "compacted": {"base": {"version": "v0", "digest": "blake3:<hex>"},   # optional
                            "files": [... as above, under hotswap-compact/ ...], "delta_bytes": N}}

It is a top-level key of a format-2 manifest, so the signature covers it. The manifest's own
`files` are the *result* files; a result file that no delta file targets is the base's file of the
same path, unchanged (its listed hash must be the base's). `chain_bytes` is what the anchor rule
reads (daemon.delta.anchors).

`compacted` is one delta from the anchor straight to this version (daemon.delta.compact), its files
under `hotswap-compact/` in the same version folder: a host without the base fetches the anchor plus
these instead of every link of the chain. A host with the base never fetches them (`fetched_files`);
the trainer uploads both (`shipped_files`), and a host falls back to the chain when they are missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from daemon.delta.errors import DeltaError
from daemon.formats import ManifestError, check_relative_path, check_version_label
from daemon.hashing import HASH_ALGORITHMS, is_hex_digest
from daemon.manifest import Manifest, ManifestFile

FORMAT = "hotswap.delta/1"
KEY = "delta"
DELTA_DIR = "hotswap-delta"  # where the delta files live inside a delta checkpoint
COMPACT_DIR = "hotswap-compact"  # where the compacted delta's files live (from the anchor, not the base)
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
    anchor_digest: str | None = None
    tensors_changed: int | None = None  # from the base: tensors whose bytes differ, and their elements
    elements_changed: int | None = None
    compacted: DeltaSpec | None = None  # one delta from the anchor to this version, when published

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
        } | self._optional(hash_alg)

    def _optional(self, hash_alg: str) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if self.anchor_digest is not None:
            doc["anchor_digest"] = self.anchor_digest
        if self.tensors_changed is not None and self.elements_changed is not None:
            doc["changed"] = {"tensors": self.tensors_changed, "elements": self.elements_changed}
        if self.compacted is not None:
            c = self.compacted.to_doc(hash_alg)
            doc["compacted"] = {k: c[k] for k in ("base", "files", "delta_bytes")}
        return doc


def delta_path(target: str) -> str:
    return f"{DELTA_DIR}/{target}{SUFFIX}"


def compact_path(target: str) -> str:
    return f"{COMPACT_DIR}/{target}{SUFFIX}"


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
    base_version, base_digest = _base(doc.get("base"), manifest, where, "delta.base")
    files = _files(doc.get("files"), manifest, alg, where, "delta.files")
    numbers = [doc.get(k) for k in ("delta_bytes", "full_bytes", "chain_bytes", "chain_length")]
    if not all(_count(n) for n in numbers):
        raise DeltaError(f"{where}: delta_bytes, full_bytes, chain_bytes and chain_length must be non-negative integers")
    anchor = doc.get("anchor")
    if not isinstance(anchor, str):
        raise DeltaError(f"{where}: delta.anchor must name the last full version")
    anchor_digest = doc.get("anchor_digest")
    if anchor_digest is not None and not _digest(anchor_digest):
        raise DeltaError(f"{where}: delta.anchor_digest {str(anchor_digest)!r:.80} is not <alg>:<hex>")
    changed = doc.get("changed")
    tensors = elements = None
    if changed is not None:
        if not isinstance(changed, dict) or not _count(changed.get("tensors")) or not _count(changed.get("elements")):
            raise DeltaError(f"{where}: delta.changed must count tensors and elements (non-negative integers)")
        tensors, elements = changed["tensors"], changed["elements"]
    delta_bytes, full_bytes, chain_bytes, chain_length = (n if isinstance(n, int) else 0 for n in numbers)
    compacted = _compacted(doc.get("compacted"), manifest, alg, where, full_bytes, anchor)
    return DeltaSpec(base_version, base_digest, files, delta_bytes, full_bytes, anchor, chain_bytes,
                     chain_length, anchor_digest, tensors, elements, compacted)  # fmt: skip


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _digest(value: object) -> bool:
    if not isinstance(value, str):
        return False
    alg, _, hexa = value.partition(":")
    return is_hex_digest(alg, hexa)


def _base(base: object, manifest: Manifest, where: str, key: str) -> tuple[str, str]:
    if not isinstance(base, dict) or not isinstance(base.get("version"), str) or not isinstance(base.get("digest"), str):
        raise DeltaError(f"{where}: {key} must name a version and a digest")
    try:
        check_version_label(base["version"], where)
    except ManifestError as exc:
        raise DeltaError(f"{where}: {key}.version: {exc}") from None
    if not _digest(base["digest"]):
        raise DeltaError(f"{where}: {key}.digest {base['digest']!r:.80} is not <alg>:<hex>")
    if base["version"] == manifest.version:
        raise DeltaError(f"{where}: the delta names itself ({manifest.version}) as its base: a loop")
    return base["version"], base["digest"]


def _files(raw: object, manifest: Manifest, alg: str, where: str, key: str) -> tuple[DeltaFile, ...]:
    results = {f.path for f in manifest.files}
    if not isinstance(raw, list):
        raise DeltaError(f"{where}: {key} must be a list")
    files: list[DeltaFile] = []
    seen: set[str] = set()
    keys = {"path", "target", "bytes", "crc32c", alg}
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) != keys:
            raise DeltaError(f"{where}: {key}[{i}] must have exactly {', '.join(sorted(keys))}")
        path, target = item["path"], item["target"]
        try:
            check_relative_path(path)
        except ManifestError as exc:
            raise DeltaError(f"{where}: {key}[{i}]: {exc}") from None
        if target not in results:
            raise DeltaError(f"{where}: {key}[{i}] rebuilds {target!r}, which the manifest does not list")
        if target in seen:
            raise DeltaError(f"{where}: {target!r} has two delta files")
        seen.add(target)
        size, crc, strong = item["bytes"], item["crc32c"], item[alg]
        if not _count(size) or not isinstance(crc, str) or len(crc) != 8:
            raise DeltaError(f"{where}: {key}[{i}]: bytes and crc32c are malformed")
        if not is_hex_digest(alg, strong):
            raise DeltaError(f"{where}: {key}[{i}]: {alg} must be 64 lowercase hex digits")
        files.append(DeltaFile(path, target, ManifestFile(path, size, crc, strong, alg)))
    return tuple(files)


def _compacted(doc: object, manifest: Manifest, alg: str, where: str, full_bytes: int, anchor: str) -> DeltaSpec | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise DeltaError(f"{where}: delta.compacted must be an object")
    version, digest = _base(doc.get("base"), manifest, where, "delta.compacted.base")
    if version != anchor:
        raise DeltaError(f"{where}: delta.compacted starts at {version}, not at the chain's anchor {anchor}")
    files = _files(doc.get("files"), manifest, alg, where, "delta.compacted.files")
    if any(not f.path.startswith(f"{COMPACT_DIR}/") for f in files):
        raise DeltaError(f"{where}: delta.compacted.files must lie under {COMPACT_DIR}/")
    size = doc.get("delta_bytes")
    if not _count(size) or not isinstance(size, int):
        raise DeltaError(f"{where}: delta.compacted.delta_bytes must be a non-negative integer")
    return DeltaSpec(version, digest, files, size, full_bytes, version, size, 1, digest)


def fetched_files(manifest: Manifest, where: str, compacted: bool = False) -> list[ManifestFile]:
    """What a source moves for this checkpoint: a delta's own files (the result files are rebuilt on
    the host from its base, daemon.pipeline.deltas), or a full checkpoint's files; with `compacted`,
    the compacted delta's files (rebuilt from the anchor). Raises DeltaError."""
    spec = parse(manifest, where)
    if spec is None:
        return list(manifest.files)
    if not compacted:
        return [f.file for f in spec.files]
    if spec.compacted is None:
        raise DeltaError(f"{where}: {manifest.version} has no compacted delta")
    return [f.file for f in spec.compacted.files]


def shipped_files(manifest: Manifest, where: str) -> list[ManifestFile]:
    """What the trainer uploads: a delta's files and its compacted delta's, or a full checkpoint's."""
    spec = parse(manifest, where)
    if spec is None:
        return list(manifest.files)
    extra = [f.file for f in spec.compacted.files] if spec.compacted is not None else []
    return [f.file for f in spec.files] + extra
