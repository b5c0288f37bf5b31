"""Helpers for fleet tests: checkpoint rows seeded straight into a shared registry."""

from __future__ import annotations

from pathlib import Path

from daemon.registry import Registry
from daemon.registry.models import Checkpoint
from daemon.registry.status import CheckpointStatus


def seed_versions(reg: Registry, root: Path, statuses: dict[str, CheckpointStatus]) -> dict[str, int]:
    """One verified-looking row per version (its folder made under `root`), in step order."""
    ids = {}
    with reg.session() as s:
        for step, (v, st) in enumerate(statuses.items()):
            (root / v).mkdir(parents=True)
            c = Checkpoint(version=v, source="local:/x", uri=f"file:///x/{v}", local_path=str(root / v), step=step,
                           status=st.value)  # fmt: skip
            s.add(c)
            s.flush()
            ids[v] = c.id
    with reg.session() as s:  # verified_at set: they passed their checks on the registering host
        for c in s.query(Checkpoint):
            c.verified_at = c.discovered_at
    return ids
