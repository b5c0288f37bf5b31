"""Encode a whole checkpoint folder against a base folder: one delta file per changed file, hashed.

    encode_dir(new_dir, base_dir, base_paths, rels, out_dir, place, pool, hash_alg, threads) -> Encoded

Shared by the delta (against the base, daemon.delta.build) and the compacted delta (against the
anchor, daemon.delta.compact); `place(rel)` says where a file's delta goes inside `out_dir`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from daemon.bytepipe import hash_files
from daemon.delta.container import changed_counts, encode_file, map_file, write_file
from daemon.delta.section import DeltaFile
from daemon.manifest import ManifestFile


@dataclass(frozen=True, slots=True)
class Encoded:
    files: tuple[DeltaFile, ...]
    encodings: dict[str, int]  # result bytes per chunk encoding
    tensors_changed: int
    elements_changed: int

    @property
    def delta_bytes(self) -> int:
        return sum(f.file.bytes for f in self.files)


def encode_dir(new_dir: Path, base_dir: Path, base_paths: set[str], rels: list[str], out_dir: Path,
               place: Callable[[str], str], pool: ThreadPoolExecutor, hash_alg: str,
               threads: int | None) -> Encoded:  # fmt: skip
    """Encode every file of `new_dir` against `base_dir` into `out_dir/place(rel)`, hashed."""
    written: list[tuple[str, str]] = []  # (delta path, target)
    encodings = {"same": 0, "sparse": 0, "xor": 0, "full": 0}
    tensors = elements = 0
    for rel in rels:
        new = map_file(new_dir / rel)
        old = map_file(base_dir / rel) if rel in base_paths else None
        header, payloads, chunks = encode_file(rel, new, old, pool)
        for c in chunks:
            encodings[c.enc] += c.length
        t, e = changed_counts(rel, new, old, chunks)
        tensors, elements = tensors + t, elements + e
        if old is not None and all(c.enc == "same" for c in chunks) and len(old) == len(new):
            continue  # unchanged: the base's file serves as it is
        write_file(out_dir / place(rel), header, payloads)
        written.append((place(rel), rel))
    digests = hash_files([out_dir / p for p, _ in written], alg=hash_alg, threads=threads)
    files = tuple(DeltaFile(p, t, ManifestFile(p, d.bytes, d.crc32c, d.hash, hash_alg))
                  for (p, t), d in zip(written, digests, strict=True))  # fmt: skip
    return Encoded(files, encodings, tensors, elements)
