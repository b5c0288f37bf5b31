"""The trainer side: publish a checkpoint as a delta against a base, or as a full anchor.

    publish_delta(new_dir, base_dir, out_dir, rule=AnchorRule())

`new_dir` and `base_dir` hold full checkpoints (the base's manifest gives its version, digest
and chain). The new manifest, with its `delta` section, is written into `new_dir` (so it can be
the next delta's base) and, last, into `out_dir`, after the delta files: `out_dir` is what a
daemon fetches (a new version folder in the watched folder). When the anchor rule says so, the
full files are copied to `out_dir` instead and the manifest has no delta section. When the chain
has more than one link, a compacted delta from the anchor goes into `out_dir` too
(daemon.delta.compact), before the manifest.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from daemon.delta.anchors import AnchorRule
from daemon.delta.codec import DeltaError
from daemon.delta.compact import compact_chain
from daemon.delta.section import KEY, DeltaSpec, delta_path, parse
from daemon.delta.tree import encode_dir
from daemon.formats import MANIFEST_NAME
from daemon.hashing import DEFAULT_HASH_ALG
from daemon.manifest import (
    Manifest,
    ManifestError,
    Signer,
    list_checkpoint_files,
    load_manifest,
    publish,
)


@dataclass(frozen=True, slots=True)
class Published:
    manifest: Manifest
    spec: DeltaSpec | None  # None: a full checkpoint (an anchor)
    anchor_reason: str | None  # why it is full, when it is
    encodings: dict[str, int]  # result bytes per chunk encoding (same, sparse, xor, full)
    compact_skipped: str | None = None  # why no compacted delta was written, when the chain could use one


def base_chain(base_dir: Path) -> tuple[Manifest, str, int, int]:
    """The base's manifest and its chain: (manifest, anchor version, chain bytes, chain length)."""
    m = load_manifest(base_dir)
    if m.digest is None or m.version is None:
        raise ManifestError(f"{base_dir}: the base needs a format-2 manifest with a version")
    missing = [f.path for f in m.files if not (base_dir / f.path).is_file() or (base_dir / f.path).stat().st_size != f.bytes]
    if missing:
        raise ManifestError(f"{base_dir}: holds a delta or an incomplete checkpoint, not the full files "
                            f"({missing[0]} missing or short): give the folder of the full base")  # fmt: skip
    spec = parse(m, str(base_dir / MANIFEST_NAME))
    if spec is None:
        return m, m.version, 0, 0
    return m, spec.anchor, spec.chain_bytes, spec.chain_length


def publish_delta(
    directory: str | os.PathLike[str],
    base: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    version: str | None = None,
    step: int | None = None,
    parent: str | None = None,
    signer: Signer | None = None,
    hash_alg: str = DEFAULT_HASH_ALG,
    threads: int | None = None,
    rule: AnchorRule | None = None,
    compact: bool | None = None,
    anchor_dir: str | os.PathLike[str] | None = None,
) -> Published:
    """`compact`: also write the compacted delta from the anchor (daemon.delta.compact); None (the
    default): when the chain has more than one link and the anchor's folder is found. `anchor_dir`:
    the anchor's full files (default: the folder of the anchor's name beside `base`)."""
    new_dir, base_dir, out_dir = Path(directory), Path(base), Path(out)
    rule = rule or AnchorRule()
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ManifestError(f"{out_dir}: not empty; the delta is written into a new folder")
    if out_dir.resolve() in (new_dir.resolve(), base_dir.resolve()):
        raise ManifestError(f"{out_dir}: the delta goes into a folder of its own, not {new_dir} or {base_dir}")
    base_m, anchor, chain_bytes, chain_length = base_chain(base_dir)
    assert base_m.version is not None and base_m.digest is not None
    base_spec = parse(base_m, str(base_dir / MANIFEST_NAME))
    anchor_digest = base_m.digest if base_spec is None else base_spec.anchor_digest
    rels = list_checkpoint_files(new_dir)
    if not rels:
        raise ManifestError(f"{new_dir}: nothing to publish (no files)")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with ThreadPoolExecutor(max(1, threads or os.cpu_count() or 1), thread_name_prefix="delta-enc") as pool:
            enc = encode_dir(new_dir, base_dir, {f.path for f in base_m.files}, rels, out_dir, delta_path, pool,
                             hash_alg, threads)  # fmt: skip
            full_bytes = sum((new_dir / r).stat().st_size for r in rels)
            why = rule.full_now(chain_length, chain_bytes, enc.delta_bytes, full_bytes)
            if why is not None:  # an anchor: the full files go out instead
                shutil.rmtree(out_dir)
                out_dir.mkdir(parents=True)
                m = publish(new_dir, version, step, parent, signer, hash_alg=hash_alg, threads=threads)
                for rel in rels:
                    (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(new_dir / rel, out_dir / rel)
                _write_last(out_dir, m)
                return Published(m, None, why, enc.encodings)
            spec = DeltaSpec(base_m.version, base_m.digest, enc.files, enc.delta_bytes, full_bytes, anchor,
                             chain_bytes + enc.delta_bytes, chain_length + 1, anchor_digest, enc.tensors_changed,
                             enc.elements_changed)  # fmt: skip
            compacted, skipped = compact_chain(spec, new_dir, base_dir, rels, out_dir, pool, hash_alg, threads,
                                               compact, anchor_dir)  # fmt: skip
        spec = replace(spec, compacted=compacted)
        extra: dict[str, Any] = {KEY: spec.to_doc(hash_alg)}
        m = publish(new_dir, version, step, parent if parent is not None else base_m.version, signer,
                    hash_alg=hash_alg, threads=threads, extra=extra)  # fmt: skip
        _write_last(out_dir, m)
        return Published(m, spec, None, enc.encodings, skipped)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _write_last(out_dir: Path, m: Manifest) -> None:
    """The manifest into `out_dir`, atomically and last: the commit signal."""
    tmp = out_dir / f".{MANIFEST_NAME}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(m.to_json().encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / MANIFEST_NAME)


__all__ = ["DeltaError", "Published", "base_chain", "publish_delta"]
