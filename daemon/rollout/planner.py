"""The rolling plan: which workers leave RUNNING together, in which order, in which mode.

Groups roll one after another in the order they first appear in `[[workers]]`;
inside a group, workers go in batches of the group's `max_unavailable`, so at
most that many of its workers are out of RUNNING at any time.

Drain mode never takes a whole group out of rotation: a drain batch holding every worker of
its group (a group of one worker, in every rollout) would leave a load balancer nothing to send
to, and the worker's own serving routes answer 503 while it drains. Such a batch pauses instead
(requests wait for the update and are then served), when each of its workers can pause without
losing requests (`pauses_safely`); else it drains, and its `reason` says the group is out of
rotation for the update. The rollout records each batch's reason.

Which checkpoint is "newer" (`newer`): the manifest's training `step` when both have one
(step-999 arriving after step-1000 is older), else, and on equal steps, arrival order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from daemon.config import RolloutMode, RolloutSettings, WorkerSpec
from daemon.engines import Capabilities
from daemon.registry import CheckpointRef


@dataclass(frozen=True, slots=True)
class Batch:
    group: str
    mode: RolloutMode
    workers: tuple[str, ...]
    # set when the batch holds every worker of its group in drain mode: why it pauses instead,
    # or why it drains anyway (the group is then out of rotation during the update)
    reason: str | None = None

    @property
    def out_of_rotation(self) -> bool:
        """The whole group leaves rotation with this batch (drained although it is all of it)."""
        return self.reason is not None and self.mode == "drain"


def pauses_safely(spec: WorkerSpec, capabilities: Capabilities) -> bool:
    """The worker can hold its requests through an update: it pauses, and not by aborting what
    is in flight (an engine worker's `pause_mode = "abort"`)."""
    return bool(capabilities.pause_modes) and spec.pause_mode != "abort"


def plan(
    workers: Sequence[WorkerSpec],
    settings: RolloutSettings,
    only: Collection[str] | None = None,
    can_pause: Callable[[WorkerSpec], bool] = lambda _spec: True,
) -> list[Batch]:
    """Batches for a rollout over `workers` (restricted to the names in `only` when given).
    `can_pause(spec)`: whether that worker pauses safely (default: every one does)."""
    order: list[str] = []
    members: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}  # every worker of the group, in `only` or not
    specs = {w.name: w for w in workers}
    for w in workers:
        if w.group not in members:  # group order comes from the whole fleet, filtered or not
            order.append(w.group)
            members[w.group] = []
        sizes[w.group] = sizes.get(w.group, 0) + 1
        if only is None or w.name in only:
            members[w.group].append(w.name)
    batches: list[Batch] = []
    for group in order:
        g = settings.group(group)
        names = members[group]
        size = max(1, g.max_unavailable)
        for i in range(0, len(names), size):
            batch = Batch(group=group, mode=g.mode, workers=tuple(names[i : i + size]))
            if batch.mode == "drain" and len(batch.workers) == sizes[group]:
                batch = _keep_in_rotation(batch, [w for w in batch.workers if not can_pause(specs[w])])
            batches.append(batch)
    return batches


def _keep_in_rotation(batch: Batch, cannot_pause: list[str]) -> Batch:
    """A drain batch that is its whole group: paused instead, unless a worker of it cannot pause."""
    n = len(batch.workers)
    who = f"only worker of group {batch.group}" if n == 1 else f"all {n} workers of group {batch.group} in one batch"
    if not cannot_pause:
        return Batch(batch.group, "pause", batch.workers, f"{who}: paused instead of drained")
    return Batch(batch.group, "drain", batch.workers,
                 f"{who}: drained, the group is out of rotation during the update "
                 f"({', '.join(cannot_pause)} cannot pause without losing requests)")  # fmt: skip


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
