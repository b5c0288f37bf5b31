"""The rebuild step, between fetch and verify: a delta checkpoint becomes a full version directory.

A fetched checkpoint whose manifest has a `delta` section (daemon.delta) names its base by version
and content digest. The base must be registered, not rejected, verified with that very digest,
and have a copy on this host; the chain (base of base ...) must not lead back to the version
itself. The delta is then rebuilt from the base's files, re-hashed against the digests they were
verified with, into `<state_dir>/deltas/<version>` (whole or absent), and that directory is what
the checks verify and the rollout serves. Every refusal is one line naming the problem, and the
checkpoint is rejected with it; a base still being verified makes it wait and try again.

A rebuild may recycle a stale rebuilt directory (`pick_recycle`: one retention would delete, whose
files have the result's paths and sizes): its files are overwritten in place, several times faster
than writing fresh ones (daemon.delta.rebuild). Retention deleting it would leave its row as it is;
so does recycling, plus a `files_recycled` event on it naming the version that took them.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.bytepipe import hash_files
from daemon.checks import CheckSettings, SignatureError, verify_manifest_signature
from daemon.common import get_logger
from daemon.delta import BaseMissing, DeltaError, DeltaSpec, parse, rebuild_delta, reusable_size
from daemon.formats import MANIFEST_NAME
from daemon.hashing import DigestMismatch
from daemon.manifest import Manifest, ManifestError, ManifestFile, load_manifest
from daemon.registry import UNFINISHED, Checkpoint, CheckpointFile, CheckpointStatus, Registry, hosts, status
from daemon.registry import queries as q
from daemon.sources import FetchError

C = CheckpointStatus
log = get_logger(__name__)
BASE_PENDING_RETRY_S = 2.0  # the base is still being verified: look again this much later
CHAIN_LIMIT = 10_000


Fetched = Callable[[str, str, int], None]  # (source, "delta" | "full", bytes)


def _no_count(source: str, encoding: str, n: int) -> None:
    pass


class BasePending(Exception):
    """The base is registered but not verified yet: try again later."""


def read_delta(directory: Path) -> tuple[Manifest | None, DeltaSpec | None]:
    """The manifest (None when unreadable: the manifest check says why) and its delta section (None for
    a full checkpoint) of a fetched checkpoint. Raises DeltaError."""
    try:
        m = load_manifest(directory)
    except ManifestError:
        return None, None
    return m, parse(m, str(directory))


def _base(s: Session, version: str, spec: DeltaSpec) -> tuple[Checkpoint, Path, dict[str, ManifestFile]]:
    base = q.get_checkpoint(s, spec.base_version)
    if base is None:
        raise DeltaError(f"base {spec.base_version} is not known here: a gap in the chain (publish or fetch "
                         "the base, or a full version)")  # fmt: skip
    if base.status == C.REJECTED:
        raise DeltaError(f"base {spec.base_version} was rejected ({base.status_message or 'see its checks'}): "
                         "a delta of a rejected version is refused")  # fmt: skip
    if base.status in UNFINISHED or base.status == C.DEFERRED:
        raise BasePending(f"base {spec.base_version} is {base.status}")
    if base.digest != spec.base_digest:
        raise DeltaError(f"base {spec.base_version} has digest {base.digest}, the delta was made against "
                         f"{spec.base_digest}: wrong base")  # fmt: skip
    seen = {version}
    link: Checkpoint | None = base
    while link is not None and link.delta_base is not None:  # a chain leading back is a loop
        if link.version in seen or len(seen) > CHAIN_LIMIT:
            raise DeltaError(f"the chain of {version} loops through {link.version}")
        seen.add(link.version)
        if link.delta_base in seen:
            raise DeltaError(f"the chain of {version} loops: {link.version} is a delta of {link.delta_base}")
        link = q.get_checkpoint(s, link.delta_base)
    path = hosts.local_path(s, base.id)
    if not path or not Path(path).is_dir():
        raise BaseMissing(f"base {spec.base_version} has no copy on this host (was {path}): a gap in the chain",
                          base.id)  # fmt: skip
    rows = s.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == base.id)).all()
    files = {r.path: ManifestFile(r.path, r.bytes, r.crc32c or "", r.hash or "", r.hash_alg) for r in rows}
    if not files or any(not f.hash for f in files.values()):
        raise DeltaError(f"base {spec.base_version} has no verified strong hashes to rebuild from")
    return base, Path(path), files


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    """What a delta checkpoint's rebuild needs, read from the registry in one short session."""

    version: str
    directory: Path  # the fetched delta
    manifest: Manifest
    spec: DeltaSpec
    base_version: str
    base_dir: Path
    base_files: dict[str, ManifestFile]
    recycle: Path | None = None  # a stale rebuilt directory whose files the rebuild overwrites (pick_recycle)


def plan_rebuild(s: Session, ckpt: Checkpoint, delta_root: Path, on_fetched: Fetched = _no_count,
                 keys: CheckSettings | None = None) -> RebuildPlan | None:  # fmt: skip
    """The rebuild `ckpt` needs when it is a delta; None when it is a full checkpoint (its row is
    marked so, in the caller's transaction) or was rebuilt already. Raises DeltaError (refused) or
    BasePending. `on_fetched(source, encoding, bytes)` counts what its source moved, once per checkpoint."""
    directory = Path(ckpt.local_path or "")
    if not ckpt.local_path or directory.resolve().is_relative_to(delta_root.resolve()):
        return None  # no directory yet, or this is the rebuilt one (a resumed checkpoint)
    manifest, spec = read_delta(directory)
    if manifest is None or spec is None:
        if ckpt.encoding is None:
            ckpt.encoding = "full"
            if manifest is not None:
                ckpt.fetched_bytes = manifest.total_bytes
                on_fetched(ckpt.source, "full", manifest.total_bytes)
        return None
    if manifest.version is not None and manifest.version != ckpt.version:
        raise DeltaError(f"its manifest says version {manifest.version}, registered as {ckpt.version}")
    if keys is not None and keys.keys_configured:  # untrusted bytes are never decoded: the signature first
        try:
            verify_manifest_signature(manifest, keys.hmac_keys, keys.ed25519_keys)
        except SignatureError as exc:
            raise DeltaError(f"{MANIFEST_NAME}: {exc}: not rebuilt") from None
    base, base_dir, files = _base(s, ckpt.version, spec)
    return RebuildPlan(ckpt.version, directory, manifest, spec, base.version, base_dir, files)


def record_rebuild(ckpt: Checkpoint, plan: RebuildPlan, rebuilt: Path, delta_bytes: int,
                   on_fetched: Fetched = _no_count) -> None:  # fmt: skip
    """The rebuilt version on its row (in the caller's transaction): it is served from `rebuilt`."""
    spec = plan.spec
    ckpt.local_path = str(rebuilt)
    ckpt.encoding = "delta"
    ckpt.delta_base = plan.base_version
    ckpt.fetched_bytes = delta_bytes
    ckpt.delta_ratio = round(spec.ratio, 9)  # the view's full_bytes (fetched / ratio) stays within a byte or two
    ckpt.tensors_changed, ckpt.elements_changed = spec.tensors_changed, spec.elements_changed
    if spec.compacted is not None:
        ckpt.compacted_from, ckpt.compacted_bytes = spec.compacted.base_version, spec.compacted.delta_bytes
    on_fetched(ckpt.source, "delta", delta_bytes)


def rebuild_copy(registry: Registry, checkpoint_id: int, directory: Path, delta_root: Path,
                 compacted: bool = False, recycle: bool = True) -> Path:  # fmt: skip
    """This host's fetched copy of a registered version (a fleet host's own copy), ready to serve: a full
    one as it is; a delta rebuilt from this host's copy of its base (with `compacted`: of its anchor,
    from the compacted delta's files) into `delta_root/<version>`, its result hashed against the
    digests the version was verified with. Raises DeltaError, BaseMissing (with the base's id: fetch
    that first) when this host has no copy of the base. `recycle`: as run_step's."""
    manifest, spec = read_delta(directory)
    if manifest is None or spec is None:
        return directory
    if compacted:
        if spec.compacted is None:
            raise DeltaError(f"{manifest.version}: its manifest lists no compacted delta")
        spec = spec.compacted
    with registry.session() as s:
        ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
        if ckpt is None:
            raise DeltaError(f"checkpoint {checkpoint_id} is gone from the registry")
        version = ckpt.version
        _base_row, base_dir, files = _base(s, version, spec)
        verified = {r.path: ManifestFile(r.path, r.bytes, r.crc32c or "", r.hash or "", r.hash_alg)
                    for r in s.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint_id))}
        stale = pick_recycle(s, delta_root, version, manifest, spec) if recycle else None
    done = rebuild_delta(directory, manifest, spec, base_dir, files, delta_root / version, recycle=stale)
    if stale is not None and done.recycled_bytes is not None:
        with registry.session() as s:
            note_recycled(s, stale, version, done.recycled_bytes)
    try:
        if sorted(verified) != sorted(f.path for f in manifest.files):
            raise DeltaError(f"{version}: the rebuilt files are not the ones it was verified with")
        rels = sorted(verified)
        for rel, digest in zip(rels, hash_files([done.directory / r for r in rels], alg=manifest.hash_alg or "blake3"),
                               strict=True):  # fmt: skip
            digest.check(verified[rel], rel)
    except (DeltaError, DigestMismatch) as exc:
        shutil.rmtree(done.directory, ignore_errors=True)
        raise DeltaError(f"{version} rebuilt on this host does not match its verified digests: {exc}") from None
    return done.directory


def bases_of_pending(s: Session, delta_root: Path) -> set[str]:
    """This host's copies of the bases that fetched, not yet rebuilt, delta checkpoints name: retention
    keeps them (a rebuilt version is a full directory and needs its base no more)."""
    kept: set[str] = set()
    for ckpt in q.by_status(s, list(UNFINISHED)):
        directory = Path(ckpt.local_path or "")
        if not ckpt.local_path or directory.resolve().is_relative_to(delta_root.resolve()):
            continue
        try:
            spec = read_delta(directory)[1]
        except DeltaError:
            continue  # refused when its turn comes; it needs nothing kept
        base = q.get_checkpoint(s, spec.base_version) if spec is not None else None
        path = hosts.local_path(s, base.id) if base is not None else None
        if path:
            kept.add(path)
    return kept


def protected_paths(s: Session, delta_root: Path) -> frozenset[Path]:
    """What retention keeps on this host (daemon.service prune), recycling too: the directories of
    aliased versions (serving, last good, pinned), of every checkpoint in flight or waiting to be
    deployed, and the bases that fetched deltas are still to be rebuilt from."""
    paths = q.protected_local_paths(s, (*UNFINISHED, *status.WAITING))
    paths |= bases_of_pending(s, delta_root)
    return frozenset(Path(p) for p in paths)


def pick_recycle(s: Session, delta_root: Path, version: str, manifest: Manifest, spec: DeltaSpec) -> Path | None:
    """The stale rebuilt directory (`stale_rebuilt` with what retention protects: one retention would
    delete) holding the most bytes in files of `version`'s rebuilt files' paths and sizes; None when
    none holds any."""
    targets = {d.target for d in spec.files}
    want = {f.path: f.bytes for f in manifest.files if f.path in targets}
    best, most = None, 0
    for d in stale_rebuilt(s, delta_root, protected_paths(s, delta_root)):
        n = sum(size for rel, size in want.items() if reusable_size(d / rel) == size) if d.name != version else 0
        if n > most:
            best, most = d, n
    return best


def note_recycled(s: Session, stale: Path, version: str, nbytes: int) -> None:
    """The stale version whose directory `version`'s rebuild took: its row stays as retention would
    leave it, with a `files_recycled` event."""
    row = q.get_checkpoint(s, stale.name)
    if row is not None:
        q.record_event(s, checkpoint_id=row.id, to_state="files_recycled",
                       detail={"into": version, "directory": str(stale), "bytes": nbytes})  # fmt: skip
    log.info("rebuilt over a stale version's files", version=version, stale=stale.name, bytes=nbytes)


def stale_rebuilt(s: Session, delta_root: Path, protected: frozenset[Path]) -> list[Path]:
    """Rebuilt directories retention may delete: a rejected version's, and a finished one older than
    last good that no alias names and nothing protects. (A trainer's next delta is made against a
    recent version; an older base gone is a named gap in the chain, never a half-built version.)"""
    if not delta_root.is_dir():
        return []
    named = q.aliases(s)
    good = named.get("last_good")
    last_good = q.get_checkpoint(s, good) if good else None
    keep = {p.resolve() for p in protected}
    stale: list[Path] = []
    for child in sorted(delta_root.iterdir()):
        if child.name.startswith(".") or not child.is_dir() or child.resolve() in keep:
            continue  # a rebuild in progress (its hidden folder), or protected
        ckpt = q.get_checkpoint(s, child.name)
        if ckpt is None or ckpt.version in named.values() or ckpt.status in UNFINISHED:
            continue
        if ckpt.status == C.REJECTED or (last_good is not None and ckpt.id < last_good.id):
            stale.append(child)
    return stale


def run_step(registry: Registry, checkpoint_id: int, delta_root: Path, on_fetched: Fetched = _no_count,
             keys: CheckSettings | None = None, recycle: bool = True) -> tuple[bool, str, FetchError | None]:  # fmt: skip
    """The coordinator's rebuild step: (verify may go on, version, why it failed or must wait).

    The rebuild itself (seconds for 16 GB) runs between two short sessions, never inside one: a
    transaction open that long would hold a PostgreSQL connection idle in transaction, and through
    PgBouncer a server connection that the whole fleet shares. `recycle`: overwrite a stale rebuilt
    directory's files (pick_recycle, chosen in the first session)."""
    err: FetchError | None = None
    with registry.session() as s:
        ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
        if ckpt is None or ckpt.status not in UNFINISHED:
            return False, "", None
        version, was = ckpt.version, ckpt.status
        try:
            plan = plan_rebuild(s, ckpt, delta_root, on_fetched, keys)
        except BasePending as exc:
            plan, err = None, FetchError(f"{exc}: waiting for it", retry_after_s=BASE_PENDING_RETRY_S)
        except (DeltaError, OSError) as exc:
            plan, err = None, FetchError(f"delta refused: {exc}")
        else:
            if plan is None:
                return True, version, None
            if recycle:
                plan = replace(plan, recycle=pick_recycle(s, delta_root, version, plan.manifest, plan.spec))
    if plan is not None:
        t0 = time.perf_counter()
        try:
            done = rebuild_delta(plan.directory, plan.manifest, plan.spec, plan.base_dir, plan.base_files,
                                 delta_root / version, recycle=plan.recycle)  # fmt: skip
        except (DeltaError, OSError) as exc:
            err = FetchError(f"delta refused: {exc}")
        else:
            with registry.session() as s:
                ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
                if ckpt is None or ckpt.status not in UNFINISHED:  # deleted or decided meanwhile
                    return False, "", None
                record_rebuild(ckpt, plan, done.directory, done.delta_bytes, on_fetched)
                if plan.recycle is not None and done.recycled_bytes is not None:
                    note_recycled(s, plan.recycle, version, done.recycled_bytes)
            log.info("rebuilt from a delta", version=version, base=plan.spec.base_version,
                     directory=str(done.directory), delta_bytes=plan.spec.delta_bytes,
                     ratio=round(plan.spec.ratio, 4), seconds=round(time.perf_counter() - t0, 2))  # fmt: skip
            return True, version, None
    if was == C.DISCOVERED:  # the failure is recorded from `fetching`, the step it failed in
        with registry.session() as s:
            row = q.get_checkpoint_by_id(s, checkpoint_id)
            if row is not None:
                status.move(s, row, C.FETCHING, "rebuilding from a delta")
    return False, version, err
