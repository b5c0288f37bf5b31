"""Checkpoint sources: where committed checkpoints come from, chosen by `[[sources]] type`.

    SOURCE_TYPES   type name -> "module:Class" of a `daemon.sources.base.SourceType`
    source_type(name) -> the class;  build_source(config, emit, scheduler) -> a running-ready Source

How to add a source type (e.g. `s3`): write `daemon/sources/s3.py` with a config dataclass
(`validate(key)` raises `ValueError("{key}.field: ...")`, `label` property) and a class with
`config_type = ThatConfig`, `__init__(config, emit, scheduler)`, `start`, `stop`, `describe`,
`fetch` (download into its cache; `FetchError` on failure) and `prune` (its cache only); then add
one line here: `"s3": "daemon.sources.s3:S3Source"`. The config loader, the coordinator's fetch
step, `/status` and the retention job pick it up by name; nothing else changes.

Entries are imported by name on first use, so a daemon that only watches folders never imports
another source's client library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from daemon import public_face
from daemon.sources.base import DiscoveredCheckpoint, Emit, FetchError, FetchItem, Source, SourceType

if TYPE_CHECKING:
    from daemon.sources.commit import fingerprint

SOURCE_TYPES: dict[str, str] = {
    "local": "daemon.sources.local:LocalSource",
    "s3": "daemon.sources.s3:S3Source",
    "push": "daemon.sources.push:PushSource",
}


# type name -> its `[[sources]]` table's dataclass, from a light module: reading a config (every
# CLI command) imports no watcher, scheduler, S3 client or web server (tests/cli: import bound)
SOURCE_CONFIGS: dict[str, str] = {
    "local": "daemon.sources.settings:LocalSourceConfig",
    "s3": "daemon.sources.settings:S3SourceConfig",
    "push": "daemon.sources.settings:PushSourceConfig",
}


def source_config_type(name: str) -> type[Any]:
    """The dataclass of a `[[sources]]` table of type `name` (without importing the source)."""
    if name not in SOURCE_CONFIGS:  # a type registered without a light entry: its class names it
        return source_type(name).config_type
    module, attr = SOURCE_CONFIGS[name].split(":")
    return cast(type[Any], getattr(importlib.import_module(module), attr))


def source_type(name: str) -> SourceType:
    module, attr = SOURCE_TYPES[name].split(":")
    return cast(SourceType, getattr(importlib.import_module(module), attr))


def build_source(config: Any, emit: Emit, scheduler: Any = None) -> Source:
    """The source for one parsed `[[sources]]` entry (its `type` picks the class)."""
    return source_type(config.type)(config, emit, scheduler)


__all__ = [
    "DiscoveredCheckpoint", "Emit", "FetchError", "FetchItem", "SOURCE_CONFIGS", "SOURCE_TYPES", "Source",
    "build_source", "fingerprint", "source_config_type", "source_type"
]

__getattr__ = public_face(__name__)
