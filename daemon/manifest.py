"""The checkpoint manifest: what `hotswap publish` writes last and every check starts from.

Format 2 (written by `hotswap publish`):

    {"format": "hotswap.manifest/2", "version", "step", "parent", "created_at",
     "hash_alg": "blake3" | "sha256",
     "digest": "<hash_alg>:<hex>",          # content digest, see daemon.hashing.content_digest
     "files": [{"path", "bytes", "crc32c": "<8 hex>", "<hash_alg>": "<64 hex>"}],
     "signature": {"alg": "hmac-sha256" | "ed25519", "key_id", "value": "<base64>"}}

The signature covers the canonical JSON (sorted keys, no whitespace, UTF-8) of every
other field, so it protects the strong per-file hashes. Format 1 (`hotswap.manifest/1`,
files with path, bytes, crc32c only) is still read: its CRCs cannot detect a deliberate
edit (CRC32C is linear), so the checks flag it as weak. Paths are relative, normalised
and stay inside the checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from daemon.bytepipe import crc32c_file, hash_files
from daemon.formats import (
    MANIFEST_CAP_BYTES,
    MANIFEST_NAME,
    ManifestError,
    SmallFileError,
    SmallFileMissing,
    check_relative_path,
    check_version_label,
    read_small_file,
    version_problem,
)
from daemon.hashing import DEFAULT_HASH_ALG, HASH_ALGORITHMS, content_digest, is_hex_digest

__all__ = [
    "FORMAT",
    "FORMAT_1",
    "FORMAT_2",
    "MANIFEST_NAME",
    "MANIFEST_CAP_BYTES",
    "Manifest",
    "ManifestError",
    "ManifestFile",
    "Signature",
    "Signer",
    "canonical_bytes",
    "check_relative_path",
    "check_version_label",
    "crc32c_file",
    "list_checkpoint_files",
    "load_manifest",
    "parse_manifest",
    "publish",
    "version_problem",
]

FORMAT_1 = "hotswap.manifest/1"  # CRC32C only: read, flagged weak
FORMAT_2 = "hotswap.manifest/2"  # CRC32C + a strong hash per file
FORMAT = FORMAT_2  # what `publish` writes
_TMP_PREFIX = f".{MANIFEST_NAME}.tmp"


@dataclass(frozen=True, slots=True)
class ManifestFile:
    """One file: as a manifest lists it, or as the checks measured it ("" where not known)."""

    path: str  # relative, normalised, '/'-separated
    bytes: int
    crc32c: str  # 8 lowercase hex digits
    hash: str = ""  # hex of `hash_alg` ("" in format 1, or before hashing)
    hash_alg: str | None = None  # "blake3" | "sha256"


@dataclass(frozen=True, slots=True)
class Signature:
    alg: str  # "hmac-sha256" or "ed25519"
    key_id: str
    value: str  # base64


class Signer(Protocol):
    """Signs the canonical manifest bytes; see daemon.checks.signatures for the two kinds."""

    @property
    def alg(self) -> str: ...
    @property
    def key_id(self) -> str: ...

    def sign(self, message: bytes) -> str: ...


@dataclass(frozen=True, slots=True)
class Manifest:
    version: str | None
    step: int | None
    parent: str | None
    created_at: str | None
    files: list[ManifestFile]
    signature: Signature | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown top-level keys, kept so signatures verify
    format: str = FORMAT_2
    hash_alg: str | None = DEFAULT_HASH_ALG  # None in format 1

    @property
    def weak(self) -> bool:
        """Format 1: only CRC32C per file, which a deliberate edit can keep unchanged."""
        return self.format == FORMAT_1

    @property
    def digest(self) -> str | None:
        """Content digest `<alg>:<hex>` over the listed strong hashes; None for format 1.

        This is what the manifest claims; the checks recompute it from the bytes.
        """
        if self.format == FORMAT_1 or self.hash_alg is None:
            return None
        return content_digest(self.files, self.hash_alg)

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def unsigned_doc(self) -> dict[str, Any]:
        """Everything the signature covers, as a JSON-ready dict."""
        doc: dict[str, Any] = dict(self.extra)
        doc.update(
            format=self.format,
            version=self.version,
            step=self.step,
            parent=self.parent,
            created_at=self.created_at,
        )
        if self.format == FORMAT_1:
            doc["files"] = [{"path": f.path, "bytes": f.bytes, "crc32c": f.crc32c} for f in self.files]
            return doc
        assert self.hash_alg is not None
        doc.update(
            hash_alg=self.hash_alg,
            digest=self.digest,
            files=[
                {"path": f.path, "bytes": f.bytes, "crc32c": f.crc32c, self.hash_alg: f.hash}
                for f in self.files
            ],
        )
        return doc

    def canonical(self) -> bytes:
        return canonical_bytes(self.unsigned_doc())

    def to_json(self) -> str:
        doc = self.unsigned_doc()
        if self.signature is not None:
            doc["signature"] = {
                "alg": self.signature.alg,
                "key_id": self.signature.key_id,
                "value": self.signature.value,
            }
        return json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def canonical_bytes(doc: dict[str, Any]) -> bytes:
    """Sorted keys, no whitespace, UTF-8; `signature` left out."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def parse_manifest(raw: bytes, root: Path | None = None, where: str = MANIFEST_NAME) -> Manifest:
    """Strictly parse manifest bytes (format 1 or 2); `root` enables the symlink-out check."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{where}: not valid UTF-8 JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: top level is not a JSON object")
    fmt = doc.get("format")
    if fmt not in (FORMAT_1, FORMAT_2):
        raise ManifestError(f"{where}: format is {fmt!r}, expected {FORMAT_2!r} (or {FORMAT_1!r})")
    version = _opt(doc, "version", str, where)
    step = doc.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ManifestError(f"{where}: step must be a non-negative integer, got {step!r}")
    parent = _opt(doc, "parent", str, where)
    created_at = _opt(doc, "created_at", str, where)
    if version is not None:
        check_version_label(version, where)
    hash_alg: str | None = None
    if fmt == FORMAT_2:
        hash_alg = doc.get("hash_alg")
        if hash_alg not in HASH_ALGORITHMS:
            raise ManifestError(f"{where}: hash_alg is {hash_alg!r}, expected one of {list(HASH_ALGORITHMS)}")
    keys = {"path", "bytes", "crc32c"} | ({hash_alg} if hash_alg else set())
    raw_files = doc.get("files")
    if not isinstance(raw_files, list):
        raise ManifestError(f"{where}: 'files' must be a list")
    files: list[ManifestFile] = []
    seen: set[str] = set()
    for i, item in enumerate(raw_files):
        if not isinstance(item, dict) or set(item) != keys:
            raise ManifestError(f"{where}: files[{i}] must have exactly {', '.join(sorted(keys))}")
        path = item["path"]
        try:
            check_relative_path(path, root)
        except ManifestError as exc:
            raise ManifestError(f"{where}: files[{i}]: {exc}") from None
        if path == MANIFEST_NAME:
            raise ManifestError(f"{where}: files[{i}]: the manifest may not list itself")
        if path in seen:
            raise ManifestError(f"{where}: file {path!r} listed twice")
        seen.add(path)
        size, crc = item["bytes"], item["crc32c"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{where}: file {path!r}: bytes must be a non-negative integer")
        if not isinstance(crc, str) or len(crc) != 8 or any(c not in "0123456789abcdef" for c in crc):
            raise ManifestError(f"{where}: file {path!r}: crc32c must be 8 lowercase hex digits, got {crc!r}")
        strong = ""
        if hash_alg is not None:
            strong = item[hash_alg]
            if not is_hex_digest(hash_alg, strong):
                raise ManifestError(
                    f"{where}: file {path!r}: {hash_alg} must be 64 lowercase hex digits, got {strong!r:.80}"
                )
        files.append(ManifestFile(path, size, crc, strong, hash_alg))
    files.sort(key=lambda f: f.path)
    signature = None
    if "signature" in doc and doc["signature"] is not None:
        sig = doc["signature"]
        if not isinstance(sig, dict) or not all(
            isinstance(sig.get(k), str) and sig.get(k) for k in ("alg", "key_id", "value")
        ):
            raise ManifestError(f"{where}: signature must have string alg, key_id and value")
        signature = Signature(sig["alg"], sig["key_id"], sig["value"])
    known = {"format", "version", "step", "parent", "created_at", "files", "signature"}
    if fmt == FORMAT_2:
        known |= {"hash_alg", "digest"}
    extra = {k: v for k, v in doc.items() if k not in known}
    manifest = Manifest(version, step, parent, created_at, files, signature, extra, fmt, hash_alg)
    if fmt == FORMAT_2 and doc.get("digest") != manifest.digest:
        raise ManifestError(
            f"{where}: digest {doc.get('digest')!r:.80} does not match its files' hashes "
            f"({manifest.digest})"
        )
    return manifest


def _opt(doc: dict[str, Any], key: str, typ: type, where: str) -> Any:
    value = doc.get(key)
    if value is not None and not isinstance(value, typ):
        raise ManifestError(f"{where}: {key} must be a {typ.__name__} or null, got {value!r}")
    return value


def load_manifest(directory: str | Path) -> Manifest:
    """Read (bounded, regular file only, inside the checkpoint) and strictly validate the manifest."""
    root = Path(directory)
    try:
        raw = read_small_file(root, MANIFEST_NAME, MANIFEST_CAP_BYTES)
    except SmallFileMissing:
        raise ManifestError(f"{root / MANIFEST_NAME}: no manifest") from None
    except SmallFileError as exc:
        raise ManifestError(str(exc)) from None
    return parse_manifest(raw, root, str(root / MANIFEST_NAME))


def list_checkpoint_files(directory: str | Path) -> list[str]:
    """Every file under the checkpoint (relative posix paths, sorted) except the manifest and its tmp.

    Symlinks to files inside the checkpoint are listed; symlinks leaving it raise ManifestError.
    """
    root = Path(directory)
    real_root = root.resolve()
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for name in list(dirnames):
            p = base / name
            if p.is_symlink():  # os.walk does not descend into it; judge it as an entry
                filenames.append(name)
                dirnames.remove(name)
        for name in filenames:
            p = base / name
            rel = p.relative_to(root).as_posix()
            if rel == MANIFEST_NAME or (base == root and name.startswith(_TMP_PREFIX)):
                continue
            if p.is_symlink() and not p.resolve().is_relative_to(real_root):
                raise ManifestError(f"{rel}: symlink leaving the checkpoint (-> {p.resolve()})")
            if not p.is_file():
                raise ManifestError(f"{rel}: not a regular file")
            out.append(rel)
    return sorted(out)


def publish(
    directory: str | Path,
    version: str | None = None,
    step: int | None = None,
    parent: str | None = None,
    signer: Signer | None = None,
    *,
    hash_alg: str = DEFAULT_HASH_ALG,
    threads: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Hash every file (CRC32C and `hash_alg`, one read) and write a format-2 manifest atomically, last.

    The version defaults to the directory name. tmp + fsync + rename, then the directory is fsynced.
    `extra`: more top-level keys, signed with the rest (a LoRA adapter's `adapter` name and
    `base_model`: daemon.formats.adapter).
    """
    root = Path(directory)
    if not root.is_dir():
        raise ManifestError(f"{root}: not a directory")
    if hash_alg not in HASH_ALGORITHMS:
        raise ManifestError(f"hash algorithm {hash_alg!r} unknown; known: {list(HASH_ALGORITHMS)}")
    rels = list_checkpoint_files(root)
    if not rels:
        raise ManifestError(f"{root}: nothing to publish (no files)")
    digests = hash_files([root / r for r in rels], alg=hash_alg, threads=threads)
    files = [ManifestFile(r, d.bytes, d.crc32c, d.hash, hash_alg) for r, d in zip(rels, digests, strict=True)]
    manifest = Manifest(
        version=version if version is not None else root.resolve().name,
        step=step,
        parent=parent,
        created_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        files=files,
        extra=dict(extra or {}),
        format=FORMAT_2,
        hash_alg=hash_alg,
    )
    parse_manifest(manifest.to_json().encode(), None, "new manifest")  # same rules as readers apply
    if signer is not None:
        value = signer.sign(manifest.canonical())
        manifest = replace(manifest, signature=Signature(signer.alg, signer.key_id, value))
    _write_atomically(root / MANIFEST_NAME, manifest.to_json().encode("utf-8"))
    return manifest


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)  # make the rename itself durable
    finally:
        os.close(dfd)
