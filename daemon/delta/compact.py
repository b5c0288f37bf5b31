"""The compacted delta: one delta from the chain's anchor straight to the new version.

A host without the base (a late joiner, or one that lost its copy) would otherwise fetch every link
of the chain since the anchor and rebuild each in turn; with the compacted delta it fetches the
anchor plus one delta, usually about one link's bytes, and rebuilds once. The trainer writes it
beside the delta, under `hotswap-compact/` in the same version folder (so no source mistakes it for
a version), and lists it, hashes and all, in the signed manifest (daemon.delta.section).

    compact_chain(spec, new_dir, base_dir, rels, out_dir, pool, ...) -> (compacted spec | None, why not)

It needs the anchor's full files: `anchor_dir`, else the folder named after the anchor beside the
base (the layout `hotswap publish` leaves: one full folder per version). When asked for (`compact`
True) and impossible, that is an error; by default (None) it is skipped with the reason, and so is
a compacted delta that would not be smaller than the chain it replaces.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from daemon.delta.errors import DeltaError
from daemon.delta.section import COMPACT_DIR, DeltaSpec, compact_path, parse
from daemon.delta.tree import encode_dir
from daemon.formats import MANIFEST_NAME
from daemon.manifest import Manifest, ManifestError, load_manifest


def find_anchor(spec: DeltaSpec, base_dir: Path, anchor_dir: Path | None) -> tuple[Path, Manifest]:
    """The anchor's folder of full files and its manifest, checked against the chain; raises DeltaError."""
    where = anchor_dir if anchor_dir is not None else base_dir.parent / spec.anchor
    try:
        m = load_manifest(where)
    except (ManifestError, OSError) as exc:
        raise DeltaError(f"the anchor {spec.anchor}'s folder {where} has no readable manifest ({exc}): "
                         "give it with --anchor-dir") from None  # fmt: skip
    if m.version != spec.anchor or m.digest is None:
        raise DeltaError(f"{where}: its manifest is for {m.version!r}, not the chain's anchor {spec.anchor}")
    if parse(m, str(where / MANIFEST_NAME)) is not None:
        raise DeltaError(f"{where}: {spec.anchor} is published as a delta there, not the anchor's full files")
    if spec.anchor_digest is not None and m.digest != spec.anchor_digest:
        raise DeltaError(f"{where}: the anchor there has digest {m.digest}, the chain's is {spec.anchor_digest}: "
                         "another checkpoint under the anchor's name")  # fmt: skip
    for f in m.files:
        p = where / f.path
        if not p.is_file() or p.stat().st_size != f.bytes:
            raise DeltaError(f"{where}: {f.path} is missing or short: not the anchor's full files")
    return where, m


def compact_chain(spec: DeltaSpec, new_dir: Path, base_dir: Path, rels: list[str], out_dir: Path,
                  pool: ThreadPoolExecutor, hash_alg: str, threads: int | None, compact: bool | None,
                  anchor_dir: str | os.PathLike[str] | None) -> tuple[DeltaSpec | None, str | None]:  # fmt: skip
    """(the compacted delta's spec, None) once its files are in `out_dir`, or (None, why not)."""
    if compact is False:
        return None, None
    if spec.chain_length < 2:
        return None, None  # the base is the anchor: the delta itself is the compacted one
    try:
        where, m = find_anchor(spec, base_dir, Path(anchor_dir) if anchor_dir is not None else None)
        assert m.digest is not None
        enc = encode_dir(new_dir, where, {f.path for f in m.files}, rels, out_dir, compact_path, pool, hash_alg,
                         threads)  # fmt: skip
    except DeltaError as exc:
        if compact:
            raise
        shutil.rmtree(out_dir / COMPACT_DIR, ignore_errors=True)
        return None, str(exc)
    if enc.delta_bytes >= spec.chain_bytes:
        shutil.rmtree(out_dir / COMPACT_DIR, ignore_errors=True)
        why = (f"the compacted delta ({enc.delta_bytes} bytes) is not smaller than the chain since "
               f"{spec.anchor} ({spec.chain_bytes} bytes)")  # fmt: skip
        if compact:
            raise DeltaError(why)
        return None, why
    return DeltaSpec(spec.anchor, m.digest, enc.files, enc.delta_bytes, spec.full_bytes, spec.anchor, enc.delta_bytes,
                     1, m.digest), None  # fmt: skip
