"""Fleet mode: this host's own copy of a version another host registered, fetched by this host's
source (the same `[[sources]]` label here: an S3 prefix, a shared folder) and recorded as this
host's location. Called by the fleet agent (`daemon.fleet.FleetAgent.fetch`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from daemon.common.logging import bind_version, get_logger
from daemon.registry import hosts
from daemon.registry import queries as q
from daemon.registry.db import Registry
from daemon.sources.base import FetchItem, Source
from daemon.sources.commit import fingerprint

log = get_logger(__name__)


def fetch_here(registry: Registry, sources: Mapping[str, Source], checkpoint_id: int) -> bool:
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
    except Exception as exc:  # FetchError or an OS fault: the fleet agent tries again later
        vlog.warning("fetching this host's copy failed", reason=str(exc))
        return False
    with registry.session() as s:
        ckpt = q.get_checkpoint_by_id(s, checkpoint_id)
        if ckpt is None:
            return False
        hosts.record_copy(s, ckpt, str(directory), fingerprint(Path(directory)))
    vlog.info("fetched this host's copy", directory=str(directory))
    return True
