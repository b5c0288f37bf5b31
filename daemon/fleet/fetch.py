"""Fleet mode: this host's own copy of a version another host registered, fetched by this host's
source (the same `[[sources]]` label here: an S3 prefix, a shared folder) and recorded as this
host's location. Called by the fleet agent (`daemon.fleet.FleetAgent.fetch`).

A delta version's copy is rebuilt from this host's copy of its base (`rebuild`, given by the
daemon: daemon.pipeline.deltas.rebuild_copy). A host without the base (a late joiner) fetches
the base first, and so on down the chain to the last full version (the anchor), then rebuilds
each link in order; a link that cannot be fetched leaves the version without a copy here and the
agent tries again later, never with a half-built directory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from daemon.common.logging import bind_version, get_logger
from daemon.delta import DeltaError
from daemon.delta.section import BaseMissing
from daemon.registry import hosts
from daemon.registry import queries as q
from daemon.registry.db import Registry
from daemon.sources.base import FetchItem, Source
from daemon.sources.commit import fingerprint

log = get_logger(__name__)
Rebuild = Callable[[int, Path], Path]  # (checkpoint id, fetched directory) -> the directory to serve
CHAIN_DEPTH = 256  # links fetched for one version at most (the anchor rule keeps chains far shorter)


def fetch_here(registry: Registry, sources: Mapping[str, Source], checkpoint_id: int,
               rebuild: Rebuild | None = None, depth: int = 0) -> bool:  # fmt: skip
    """True when this host has its own copy now."""
    with registry.session() as s:
        ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
        if ckpt is None:
            return False
        item, label = FetchItem(ckpt.id, ckpt.version, ckpt.uri), ckpt.source
    vlog = bind_version(log, item.version, source=label)
    source = sources.get(label)
    if source is None:
        vlog.info("no copy on this host and its source is not configured here")
        return False
    try:
        directory = source.fetch(item, lambda _done, _total: None)
        if rebuild is not None:
            directory = _rebuilt(registry, sources, item, directory, rebuild, depth)
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


def _rebuilt(registry: Registry, sources: Mapping[str, Source], item: FetchItem, directory: Path,
             rebuild: Rebuild, depth: int) -> Path:  # fmt: skip
    try:
        return rebuild(item.checkpoint_id, directory)
    except BaseMissing as missing:
        if depth >= CHAIN_DEPTH:
            raise DeltaError(f"its chain is longer than {CHAIN_DEPTH} links: publish a full version") from None
        log.info("no copy of its base on this host: fetching the chain first", version=item.version,
                 reason=str(missing), depth=depth + 1)  # fmt: skip
        if not fetch_here(registry, sources, missing.base_id, rebuild, depth + 1):
            raise DeltaError(f"{missing}; fetching it failed (see the line above)") from None
        return rebuild(item.checkpoint_id, directory)
