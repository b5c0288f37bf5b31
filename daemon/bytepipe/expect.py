"""What a read is checked against: the verified per-file digests of a checkpoint (`Expect`).

The registry records them at verify; the daemon sends them with every update (the request's
`expect`) and to the loader with every stage; whoever reads the bytes hashes them and compares
(daemon.bytepipe.check.LoadCheck).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BadUpdateRequest", "Expect", "ExpectedFile", "Reference", "reference_for"]

# strongest first; the first two are daemon.hashing.HASH_ALGORITHMS (this module imports no hash library:
# the vLLM worker extension imports it inside vLLM's venv)
REFERENCE_ALGS = ("blake3", "sha256", "crc32c")


class BadUpdateRequest(ValueError):
    """An update request that does not say what it must (the worker answers 422)."""


@dataclass(frozen=True, slots=True)
class ExpectedFile:
    """A file of the verified checkpoint as the registry recorded it: size and digests by algorithm."""

    path: str
    bytes: int
    digests: Mapping[str, str] = field(default_factory=dict)  # e.g. {"crc32c": "8f3a21c0", "sha256": "9f2c..."}


@dataclass(frozen=True, slots=True)
class Expect:
    """What the registry verified, for the worker to check the bytes it reads against."""

    digest: str | None = None  # content digest
    tensors: int | None = None  # tensor count
    files: tuple[ExpectedFile, ...] = ()  # per-file digests (check while loading)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if self.digest is not None:
            doc["digest"] = self.digest
        if self.tensors is not None:
            doc["tensors"] = self.tensors
        if self.files:
            doc["files"] = [{"path": f.path, "bytes": f.bytes, "digests": dict(f.digests)} for f in self.files]
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> Expect:
        if doc is None:
            return cls()
        if not isinstance(doc, dict):
            raise BadUpdateRequest("'expect' must be an object {digest, tensors, files}")
        digest, tensors, files = doc.get("digest"), doc.get("tensors"), doc.get("files") or []
        if digest is not None and not isinstance(digest, str):
            raise BadUpdateRequest("expect.digest must be a string")
        if tensors is not None and (not isinstance(tensors, int) or isinstance(tensors, bool) or tensors < 0):
            raise BadUpdateRequest("expect.tensors must be a non-negative integer")
        if not isinstance(files, list):
            raise BadUpdateRequest("expect.files must be a list of {path, bytes, digests}")
        parsed = []
        for i, f in enumerate(files):
            ok = (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("bytes"), int)
                  and isinstance(f.get("digests", {}), dict)
                  and all(isinstance(k, str) and isinstance(v, str) for k, v in f.get("digests", {}).items()))  # fmt: skip
            if not ok:
                raise BadUpdateRequest(f"expect.files[{i}] must be {{path: str, bytes: int, digests: {{alg: hex}}}}")
            parsed.append(ExpectedFile(f["path"], f["bytes"], dict(f.get("digests", {}))))
        return cls(digest, tensors, tuple(parsed))


@dataclass(frozen=True, slots=True)
class Reference:
    """What one file must hash to: size and one digest (the strongest the registry has)."""

    path: str
    bytes: int
    alg: str  # "blake3" | "sha256" | "crc32c"
    value: str

    @property
    def strong(self) -> bool:
        return self.alg != "crc32c"


def reference_for(f: ExpectedFile) -> Reference | None:
    """The digest to check `f` with: BLAKE3, else SHA-256, else CRC32C; None when it has none."""
    for alg in REFERENCE_ALGS:
        value = f.digests.get(alg)
        if value:
            return Reference(f.path, f.bytes, alg, value.lower())
    return None
