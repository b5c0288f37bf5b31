"""Fleet mode: this host's own copy of a version another host registered, fetched by this host's
source (the same `[[sources]]` label here: an S3 prefix, a shared folder) and recorded as this
host's location. Called by the fleet agent (`daemon.fleet.FleetAgent.fetch`).

A delta version's copy is rebuilt from this host's copy of its base (`rebuild`, given by the
daemon: daemon.pipeline.deltas.rebuild_copy). A host without the base (a late joiner) takes one of
two ways, whichever moves fewer bytes by the registry's figures (`plan`):

* the compacted delta, when the version ships one (daemon.delta.compact): the anchor (fetched
  first unless this host has it) plus the compacted delta's files, one rebuild;
* the chain: the base first, and so on down to a link this host has or the anchor, then each link
  rebuilt in order.

A compacted delta that cannot be used (missing from the store, corrupt, not listed) is logged with
its reason and the chain is taken instead. A link that cannot be fetched leaves the version without
a copy here and the agent tries again later, never with a half-built directory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from sqlalchemy.orm import Session

from daemon.common import bind_version, get_logger
from daemon.delta import BaseMissing, DeltaError, fetched_files, is_delta
from daemon.manifest import ManifestError, load_manifest
from daemon.registry import Checkpoint, Registry, hosts
from daemon.registry import queries as q
from daemon.sources import FetchItem, Source, fingerprint

log = get_logger(__name__)
# (checkpoint id, fetched directory, from the compacted delta) -> the directory to serve
Rebuild = Callable[[int, Path, bool], Path]
Fetched = Callable[[str, str, int], None]  # (source, "delta" | "full", bytes): hotswap_fetched_bytes_total
CHAIN_DEPTH = 256  # links fetched for one version at most (the anchor rule keeps chains far shorter)


def _here(s: Session, ckpt: Checkpoint) -> bool:
    path = hosts.local_path(s, ckpt.id)
    return path is not None and Path(path).is_dir()


def plan(s: Session, ckpt: Checkpoint) -> tuple[bool, int, int]:
    """(take the compacted delta, its bytes to fetch, the chain's) for a delta version this host has
    no copy of. Both ways fetch the anchor unless it is here; the chain stops at a link held here.
    A chain with a gap or a loop takes the compacted delta (it skips the links; the chain would
    fail, and names the gap when the compacted delta fails too)."""
    if ckpt.encoding != "delta" or not ckpt.delta_base or ckpt.compacted_bytes is None:
        return False, 0, 0
    if not ckpt.compacted_from:
        return False, 0, 0
    anchor = q.get_checkpoint(s, ckpt.compacted_from)
    if anchor is None:
        return False, 0, 0
    compact = ckpt.compacted_bytes + (0 if _here(s, anchor) else anchor.total_bytes or 0)
    chain, link, seen = 0, ckpt, {ckpt.version}
    while True:
        chain += link.fetched_bytes or 0  # a link's delta bytes (unknown: counted as none, so the chain wins)
        base = q.get_checkpoint(s, link.delta_base) if link.delta_base else None
        if base is None or base.version in seen or len(seen) > CHAIN_DEPTH:
            return True, compact, chain  # a gap or a loop: the chain cannot work, the compacted delta may
        seen.add(base.version)
        if _here(s, base):
            break
        if base.encoding != "delta":  # the anchor, not here
            chain += base.total_bytes or 0
            break
        link = base
    return compact < chain, compact, chain


def _fetch(source: Source, item: FetchItem, label: str, on_fetched: Fetched | None) -> Path:
    """The source's fetch; what it brought in is counted (the listed bytes of the files it holds for it)."""
    directory = source.fetch(item, lambda _done, _total: None)
    if on_fetched is not None:
        try:
            m = load_manifest(directory)
            moved = fetched_files(m, str(directory), item.compacted)
        except (ManifestError, DeltaError):
            return directory  # the rebuild or the checks say why
        on_fetched(label, "delta" if is_delta(m) else "full", sum(f.bytes for f in moved))
    return directory


def fetch_here(registry: Registry, sources: Mapping[str, Source], checkpoint_id: int,
               rebuild: Rebuild | None = None, depth: int = 0, on_fetched: Fetched | None = None) -> bool:  # fmt: skip
    """True when this host has its own copy now."""
    with registry.session() as s:
        ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
        if ckpt is None:
            return False
        item, label = FetchItem(ckpt.id, ckpt.version, ckpt.uri), ckpt.source
        base = q.get_checkpoint(s, ckpt.delta_base) if ckpt.delta_base else None
        has_base = base is not None and _here(s, base)  # then the delta itself is the cheapest way
        compact, compact_bytes, chain_bytes = (False, 0, 0) if rebuild is None or has_base else plan(s, ckpt)
    vlog = bind_version(log, item.version, source=label)
    source = sources.get(label)
    if source is None:
        vlog.info("no copy on this host and its source is not configured here")
        return False
    directory: Path | None = None
    if compact and rebuild is not None:
        vlog.info("no copy of its base on this host: taking the anchor and the compacted delta",
                  bytes=compact_bytes, chain_bytes=chain_bytes)  # fmt: skip
        try:
            directory = _compacted(registry, sources, source, item, rebuild, depth, on_fetched)
        except Exception as exc:  # a missing or corrupt compacted delta: the chain still works
            vlog.warning("the compacted delta cannot be used: replaying the chain instead", reason=str(exc))
    try:
        if directory is None:
            directory = _fetch(source, item, label, on_fetched)
            if rebuild is not None:
                directory = _rebuilt(registry, sources, item, directory, rebuild, depth, on_fetched)
    except Exception as exc:  # FetchError, DeltaError or an OS fault: the fleet agent tries again later
        vlog.warning("fetching this host's copy failed", reason=str(exc))
        return False
    with registry.session() as s:
        ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
        if ckpt is None:
            return False
        hosts.record_copy(s, ckpt, str(directory), fingerprint(Path(directory)))
    vlog.info("fetched this host's copy", directory=str(directory))
    return True


def _compacted(registry: Registry, sources: Mapping[str, Source], source: Source, item: FetchItem,
               rebuild: Rebuild, depth: int, on_fetched: Fetched | None) -> Path:  # fmt: skip
    directory = _fetch(source, replace(item, compacted=True), source.label, on_fetched)
    try:
        return rebuild(item.checkpoint_id, directory, True)
    except BaseMissing as missing:  # the anchor is not here: fetch it, then rebuild once
        if not fetch_here(registry, sources, missing.base_id, rebuild, depth + 1, on_fetched):
            raise DeltaError(f"{missing}; fetching the anchor failed (see the line above)") from None
        return rebuild(item.checkpoint_id, directory, True)


def _rebuilt(registry: Registry, sources: Mapping[str, Source], item: FetchItem, directory: Path,
             rebuild: Rebuild, depth: int, on_fetched: Fetched | None) -> Path:  # fmt: skip
    try:
        return rebuild(item.checkpoint_id, directory, False)
    except BaseMissing as missing:
        if depth >= CHAIN_DEPTH:
            raise DeltaError(f"its chain is longer than {CHAIN_DEPTH} links: publish a full version") from None
        log.info("no copy of its base on this host: fetching the chain first", version=item.version,
                 reason=str(missing), depth=depth + 1)  # fmt: skip
        if not fetch_here(registry, sources, missing.base_id, rebuild, depth + 1, on_fetched):
            raise DeltaError(f"{missing}; fetching it failed (see the line above)") from None
        return rebuild(item.checkpoint_id, directory, False)
