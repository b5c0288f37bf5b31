"""SIGHUP: re-read the config file and apply what can change while the daemon runs.

Applied in place: rollout thresholds and timeouts (`[rollout]`, except `transport` and
`update_mode`, which the stager was built for), the checks (`[checks]`), and sources
(`[[sources]]`: removed ones stop, new ones start, changed ones restart). Everything else
(`[database]`, `[daemon]`, `[api]`, `[[workers]]`, `[loader]`, `[fleet]`, `[gates]`, `[[webhooks]]`, the two rollout keys above) is logged
as needing a restart and left as it runs. A config that does not load keeps the running one,
and the reason is logged: a typo on SIGHUP never takes serving down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apscheduler.schedulers.base import BaseScheduler

from daemon.common import get_logger
from daemon.config import Config, ConfigError, load_config
from daemon.pipeline import Coordinator
from daemon.sources import Source, build_source

log = get_logger(__name__)
RESTART_ONLY_ROLLOUT = ("transport", "update_mode")
RESTART_ONLY_SECTIONS = ("daemon", "database", "api", "workers", "loader", "fleet", "gates", "webhooks")


@dataclass
class ReloadResult:
    applied: list[str] = field(default_factory=list)  # "rollout.max_error_rate: 0.01 -> 0.5"
    needs_restart: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Reloadable:
    """What a reload may touch: the running config and the parts built from it."""

    config: Config
    coordinator: Coordinator
    scheduler: BaseScheduler
    sources: list[Source]
    rollout_settings: Any | None  # the RolloutSettings object the rollout service shares (mutated in place)
    on_sources: Callable[[list[Source]], None] = lambda _sources: None


def reload_config(target: Reloadable) -> ReloadResult:
    result = ReloadResult()
    try:
        new = load_config(target.config.source_file)
    except (ConfigError, OSError) as exc:
        result.error = str(exc)
        log.error("config reload refused; the running config stays", error=result.error)
        return result
    old = target.config
    for section in RESTART_ONLY_SECTIONS:
        if getattr(old, section) != getattr(new, section):
            result.needs_restart.append(section)
    _apply_rollout(old, new, target, result)
    if old.checks != new.checks:
        result.applied += _diff("checks", old.checks, new.checks)
        target.coordinator.check_settings = new.checks
        old.checks = new.checks
    if old.sources != new.sources:
        _apply_sources(old, new, target, result)
    if result.applied:
        log.info("config reloaded", changed=result.applied)
    else:
        log.info("config reloaded; nothing to apply")
    if result.needs_restart:
        log.warning("config changes that need a daemon restart were not applied", sections=result.needs_restart)
    return result


def _apply_rollout(old: Config, new: Config, target: Reloadable, result: ReloadResult) -> None:
    for name in RESTART_ONLY_ROLLOUT:
        if getattr(old.rollout, name) != getattr(new.rollout, name):
            result.needs_restart.append(f"rollout.{name}")
    changed = [f for f in dataclasses.fields(new.rollout)
               if f.name not in RESTART_ONLY_ROLLOUT and getattr(old.rollout, f.name) != getattr(new.rollout, f.name)]  # fmt: skip
    for f in changed:
        result.applied.append(f"rollout.{f.name}: {getattr(old.rollout, f.name)!r} -> {getattr(new.rollout, f.name)!r}")
        value = getattr(new.rollout, f.name)
        setattr(old.rollout, f.name, value)  # the config object the daemon was built from
        if target.rollout_settings is not None and target.rollout_settings is not old.rollout:
            setattr(target.rollout_settings, f.name, value)


def _apply_sources(old: Config, new: Config, target: Reloadable, result: ReloadResult) -> None:
    # target.sources[i] was built from old.sources[i]; an entry that is unchanged keeps running
    remaining = list(new.sources)
    kept: list[tuple[Any, Source]] = []
    for cfg, source in zip(old.sources, target.sources, strict=True):
        if cfg in remaining:
            remaining.remove(cfg)
            kept.append((cfg, source))
        else:
            source.stop()
            result.applied.append(f"sources: stopped {source.label}")
    for cfg in remaining:
        source = build_source(cfg, target.coordinator.intake, target.scheduler)
        source.start()
        kept.append((cfg, source))
        result.applied.append(f"sources: started {source.label}")
    target.sources[:] = [s for _, s in kept]
    target.coordinator.sources = {s.label: s for _, s in kept}
    old.sources = [c for c, _ in kept]
    target.on_sources(target.sources)


def _diff(prefix: str, a: Any, b: Any) -> list[str]:
    out = []
    for f in dataclasses.fields(a):
        if getattr(a, f.name) != getattr(b, f.name):
            out.append(f"{prefix}.{f.name}: {getattr(a, f.name)!r} -> {getattr(b, f.name)!r}")
    return out
