"""File hashes: CRC32C and a cryptographic hash (BLAKE3 or SHA-256) from one read of the bytes.

CRC32C catches accidents; it is linear, so anyone can change a file and patch 4 bytes
to keep it. The strong hash is what a signed manifest protects and what transports
compare with (docs/concepts/checkpoints.md "Committed: when a checkpoint is read").

The digests of whole files (`hash_files`) come from the one byte pipeline,
`daemon.bytepipe.files`, which reads each byte once and feeds it to these hashes.

For a transport that checks while it loads, the API is `FileHasher` (see its docstring):

    hasher = FileHasher(expected.hash_alg)          # "blake3" or "sha256"
    for offset, chunk in chunks_in_file_order:      # header bytes first, then the data
        hasher.update_at(offset, chunk)
    hasher.result().check(expected, path)           # raises DigestMismatch
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import blake3 as _blake3

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_HASH_ALG",
    "HASH_ALGORITHMS",
    "DigestMismatch",
    "FileDigest",
    "FileHasher",
    "content_digest",
    "is_hex_digest",
    "new_strong_hash",
]

@functools.cache
def crc32c_lib() -> ModuleType:
    """crc32c, imported on first use: its import reads package metadata (~20 ms), which every
    reader of a config (`hotswap status`, through daemon.checks) would pay without hashing."""
    import crc32c

    return crc32c


# BLAKE3 by default: on this project's machines it hashes 4-5x faster than SHA-256 per core and,
# being a tree hash, splits one large file over every core; SHA-256 is sequential per file
# (bench/RESULTS.md "Verify: CRC32C and strong hashes"). SHA-256 stays for tools that expect it.
HASH_ALGORITHMS: tuple[str, ...] = ("blake3", "sha256")
DEFAULT_HASH_ALG = "blake3"
HEX_LENGTH: dict[str, int] = {"blake3": 64, "sha256": 64}
CHUNK_BYTES = 8 * 1024 * 1024  # per read; big enough for BLAKE3 to split it across threads


class StrongHash(Protocol):
    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_strong_hash(alg: str, *, threads: int = 1) -> StrongHash:
    """An incremental hasher for `alg`; `threads` > 1 lets BLAKE3 split each update."""
    if alg == "blake3":
        return _blake3.blake3(max_threads=max(1, threads))
    if alg == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash algorithm {alg!r}; known: {list(HASH_ALGORITHMS)}")


def is_hex_digest(alg: str, value: object) -> bool:
    n = HEX_LENGTH.get(alg)
    return (
        n is not None
        and isinstance(value, str)
        and len(value) == n
        and all(c in "0123456789abcdef" for c in value)
    )


class DigestMismatch(ValueError):
    """Bytes read do not match the verified digest; the message names the file and what differs."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    """What one file's bytes hash to: size, CRC32C (8 hex) and the strong hash (hex) with its name."""

    bytes: int
    crc32c: str
    hash_alg: str | None  # None when only the CRC was computed
    hash: str  # "" when only the CRC was computed

    def check(self, expected: Any, path: str) -> None:
        """Raise DigestMismatch unless this equals `expected` (anything with bytes/crc32c/hash/hash_alg).

        The strong hash decides; the CRC is compared too, so a mismatch says whether the
        change kept the CRC (a deliberate edit) or not (corruption).
        """
        want_alg = getattr(expected, "hash_alg", None)
        want_hash = getattr(expected, "hash", "") or ""
        want_crc = getattr(expected, "crc32c", "") or ""
        if getattr(expected, "bytes", self.bytes) != self.bytes:
            raise DigestMismatch(f"{path}: {self.bytes} bytes read, {expected.bytes} verified")
        if want_hash:
            if want_alg != self.hash_alg:
                raise DigestMismatch(f"{path}: hashed with {self.hash_alg}, verified with {want_alg}")
            if want_hash != self.hash:
                kept = " (its CRC32C still matches: changed on purpose)" if want_crc == self.crc32c else ""
                raise DigestMismatch(
                    f"{path}: {self.hash_alg} {self.hash[:16]}... does not match the verified "
                    f"{want_hash[:16]}...{kept}"
                )
        if want_crc and want_crc != self.crc32c:
            raise DigestMismatch(f"{path}: crc32c {self.crc32c} does not match the verified {want_crc}")
        if not want_hash and not want_crc:
            raise DigestMismatch(f"{path}: no verified digest to compare with")


class FileHasher:
    """CRC32C and the strong hash of one file, fed its bytes in order: each chunk goes to both.

    Not thread-safe: one thread (e.g. a transport's consumer) feeds it, in file order.
    `update_at(offset, data)` is `update` plus a check that nothing was skipped or repeated.
    Both hashes release the GIL, so a reader thread can hash while others read.
    """

    __slots__ = ("alg", "_strong", "_crc", "_fed")

    def __init__(self, alg: str | None = DEFAULT_HASH_ALG, *, threads: int = 1) -> None:
        self.alg = alg
        self._strong = new_strong_hash(alg, threads=threads) if alg is not None else None
        self._crc = 0
        self._fed = 0

    @property
    def bytes_fed(self) -> int:
        return self._fed

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._crc = crc32c_lib().crc32c(view, self._crc)
        if self._strong is not None:
            self._strong.update(view)
        self._fed += len(view)

    def update_at(self, offset: int, data: Any) -> None:
        if offset != self._fed:
            raise ValueError(f"bytes fed out of order: got offset {offset}, expected {self._fed}")
        self.update(data)

    @property
    def crc32c(self) -> str:
        return f"{self._crc:08x}"

    def hexdigest(self) -> str:
        return self._strong.hexdigest() if self._strong is not None else ""

    def result(self) -> FileDigest:
        return FileDigest(self._fed, self.crc32c, self.alg, self.hexdigest())


def content_digest(files: Iterable[Any], alg: str) -> str:
    """`<alg>:<hex>`: the strong hash over `path NUL bytes NUL hash LF` of every file, in path order.

    `files` are anything with `path`, `bytes` and `hash` (hex of `alg`). Paths hold no
    NUL and hashes have a fixed length, so the encoding is unambiguous; any language
    can recompute it. This is what duplicate detection compares.
    """
    h = new_strong_hash(alg)
    for f in sorted(files, key=lambda f: f.path):
        if getattr(f, "hash_alg", alg) != alg or not is_hex_digest(alg, f.hash):
            raise ValueError(f"{f.path}: no {alg} hash to build the content digest from")
        h.update(f"{f.path}\0{f.bytes}\0{f.hash}\n".encode())
    return f"{alg}:{h.hexdigest()}"
