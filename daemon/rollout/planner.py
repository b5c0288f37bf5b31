"""The rolling plan: which workers leave RUNNING together, in which order, in which mode.

Groups roll one after another in the order they first appear in `[[workers]]`;
inside a group, workers go in batches of the group's `max_unavailable`, so at
most that many of its workers are out of RUNNING at any time.

Which checkpoint is "newer" (`newer`): the manifest's training `step` when both have one
(step-999 arriving after step-1000 is older), else, and on equal steps, arrival order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from daemon.config import RolloutMode, RolloutSettings, WorkerSpec
from daemon.registry.journal import CheckpointRef


@dataclass(frozen=True, slots=True)
class Batch:
    group: str
    mode: RolloutMode
    workers: tuple[str, ...]


def plan(
    workers: Sequence[WorkerSpec],
    settings: RolloutSettings,
    only: Collection[str] | None = None,
) -> list[Batch]:
    """Batches for a rollout over `workers` (restricted to the names in `only` when given)."""
    order: list[str] = []
    members: dict[str, list[str]] = {}
    for w in workers:
        if w.group not in members:  # group order comes from the whole fleet, filtered or not
            order.append(w.group)
            members[w.group] = []
        if only is None or w.name in only:
            members[w.group].append(w.name)
    batches: list[Batch] = []
    for group in order:
        g = settings.group(group)
        names = members[group]
        size = max(1, g.max_unavailable)
        for i in range(0, len(names), size):
            batches.append(Batch(group=group, mode=g.mode, workers=tuple(names[i : i + size])))
    return batches


def modes_of(batches: Sequence[Batch]) -> str:
    """The rollout's mode for the `rollouts.mode` column: drain, pause or mixed."""
    modes = {b.mode for b in batches}
    if len(modes) == 1:
        return modes.pop()
    return "mixed" if modes else "none"


def newer(a: CheckpointRef, b: CheckpointRef) -> bool:
    """`a` is newer than `b`: by the manifest's step when both have one, else by arrival (id)."""
    if a.step is not None and b.step is not None and a.step != b.step:
        return a.step > b.step
    return a.id > b.id


def newest(refs: Sequence[CheckpointRef]) -> CheckpointRef | None:
    best: CheckpointRef | None = None
    for r in refs:
        if best is None or newer(r, best):
            best = r
    return best
