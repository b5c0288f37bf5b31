"""The runner's jobs for LoRA adapters, per adapter name, and what their results mean.

Each adapter name has its own serving / last_good / pinned (daemon.registry.adapters); its jobs
never touch the base's. They run on the service's runner thread like every job (queued as
commands, so a base rollout is not held up by them for long: an adapter load pauses nothing):

    deploy      a newly verified version: superseded when a newer one of the same name waits
                or serves; left waiting while the name is pinned; else rolled onto every worker
                that serves adapters (daemon.controller.adapter_rollout), then the health
                window of that adapter's requests (daemon.controller.health_window); a failure
                rolls the name back
    rollback    the name back to its last_good (or the version deployed before, or --to V)
    pin/unpin   hold the name on one version; unpin lets the newest waiting one deploy
    reconcile   every worker serves each name's serving version (after a relaunch, a restart,
                a crash: level-triggered, from what the workers report)

A version refused by a worker (or failing its post-check or health window) is rejected with the
reason and the workers keep (or get back) the previous version; a worker that did not answer
leaves the version verified, tried again by the next reconcile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.checks import CheckSettings
from daemon.common import get_logger
from daemon.config import RolloutSettings
from daemon.controller.adapter_base import BaseBinding
from daemon.controller.adapter_rollout import AdapterRollout
from daemon.controller.commands import OPEN
from daemon.controller.health_window import Fallback, HealthWindow, OpenWindow, reject_or_retry
from daemon.controller.queue import CommandError
from daemon.controller.served import ServedVersions
from daemon.registry import (
    DEPLOYABLE,
    WAITING,
    AdapterJournal,
    AdapterVersion,
    CheckpointStatus,
    FailureKind,
    Journal,
    RolloutOutcome,
    RolloutTrigger,
)
from daemon.rollout import Stepped, WindowVerdict, newer

log = get_logger(__name__)
C, T = CheckpointStatus, RolloutTrigger


class AdapterDecisions:
    def __init__(self, journal: Journal, adapters: AdapterJournal, rollout: AdapterRollout, settings: RolloutSettings,
                 interrupted: Callable[[], bool], checks: CheckSettings | None = None, *,
                 served: ServedVersions, submit: Callable[[int], None] = lambda _id: None) -> None:  # fmt: skip
        self.journal = journal
        self.adapters = adapters
        self.rollout = rollout
        self.settings = settings
        self.health_window = HealthWindow(journal, settings, interrupted)  # shutdown: a health window decides nothing
        self.window: OpenWindow | None = None  # a deploy's health window, open: the runner steps it (settle)
        self.served = served  # the one writer of each name's serving and last_good
        self.submit = submit  # the service's: a version to deploy (again)
        # each served adapter held to the serving base (daemon/controller/adapter_base.py)
        self.binding = BaseBinding(journal, adapters, rollout, checks or CheckSettings(), served)

    # -- jobs ------------------------------------------------------------------------------
    def deploy_new(self, checkpoint_id: int, hold: bool = False) -> dict[str, Any]:
        """`hold`: a health window is left open (`window`) for the runner to step (`settle`);
        else it is stepped to its verdict here (an unpin's or a reconcile's deploy)."""
        av = self.adapters.adapter_of(checkpoint_id)
        if av is None:
            return {"outcome": "skipped", "reason": "not an adapter with a name"}
        if av.checkpoint.status not in WAITING:
            return {"version": av.version, "outcome": "skipped", "status": av.checkpoint.status}
        newest = self.adapters.newest_waiting(av.name)
        serving = self.adapters.alias(av.name, "serving")
        for other in (newest, serving):
            if other is not None and other.checkpoint.id != av.checkpoint.id and newer(other.checkpoint, av.checkpoint):
                self.journal.move_status(av.checkpoint.id, C.SUPERSEDED, f"superseded by {other.version} (adapter {av.name})")
                return {"version": av.version, "outcome": "superseded", "by": other.version}
        pinned = self.adapters.alias(av.name, "pinned")
        if pinned is not None and pinned.checkpoint.id != av.checkpoint.id:
            self.journal.note(av.checkpoint.id, f"adapter {av.name} is pinned to {pinned.version}: waits for "
                                                f"`hotswap unpin --adapter {av.name}`")  # fmt: skip
            return {"version": av.version, "outcome": "waiting", "pinned": pinned.version}
        off_base = self.binding.fits(av)
        if off_base is not None:
            self.journal.move_status(av.checkpoint.id, C.REJECTED, f"adapter {av.name}: {off_base}")
            return {"version": av.version, "outcome": "rejected", "reason": off_base}
        result = self.rollout.deploy(av, trigger=T.NEW, previous=serving)
        out: dict[str, Any] = {"rollout_id": result.rollout_id, "adapter": av.name, "version": av.version,
                               "outcome": result.outcome.value, "reason": result.reason}  # fmt: skip
        if result.outcome == RolloutOutcome.SUCCEEDED:
            self.mark_serving(av, serving, f"adapter {av.name}: serving on every worker (rollout {result.rollout_id})")
            if self.settings.health_window_s <= 0:
                self.served.mark_adapter_last_good(av.name, av)
            elif hold:
                self.window = self.health_window.open(_AdapterWindow(self, av, serving), result.rollout_id)
                out["health_window"] = OPEN
            else:
                out.update(self.health_window.watch(_AdapterWindow(self, av, serving), result.rollout_id))
        elif result.kind == FailureKind.UNREACHABLE:
            self.journal.note(av.checkpoint.id, f"rollout {result.rollout_id}: {result.reason}; tried again when the "
                                                "worker is back")  # fmt: skip
        else:
            where = serving.version if serving else "no version of it"
            self.journal.move_status(av.checkpoint.id, C.REJECTED,
                                     f"rollout {result.rollout_id} failed: {result.reason}; workers serve {where}")  # fmt: skip
        return out

    def _deployable(self, version: str) -> AdapterVersion:
        av = self.adapters.by_version(version)
        if av is None:
            raise CommandError(f"unknown adapter version {version!r} (see `hotswap history --adapter NAME`)", 404)
        if not av.checkpoint.verified or av.checkpoint.status not in DEPLOYABLE:
            raise CommandError(f"adapter version {version!r} is {av.checkpoint.status}: only verified versions can be deployed")
        if not av.checkpoint.local_path:
            raise CommandError(f"adapter version {version!r} has no local copy on this host")
        off_base = self.binding.fits(av)
        if off_base is not None:
            raise CommandError(f"adapter version {version!r}: {off_base}")
        return av

    def rollback(self, name: str | None, to: str | None, by: str = "operator") -> dict[str, Any]:
        if to is not None:
            target = self._deployable(to)
            name = target.name
        if name is None:
            raise CommandError("an adapter rollback needs the adapter's name or --to VERSION", 422)
        serving = self.adapters.alias(name, "serving")
        if to is None:
            last_good = self.adapters.alias(name, "last_good")
            candidate = last_good if last_good is not None and serving is not None and last_good.checkpoint.id != \
                serving.checkpoint.id else self.adapters.previous_deployed(name, serving.checkpoint.id if serving else -1)
            if candidate is None:
                raise CommandError(f"adapter {name}: nothing to roll back to (no earlier version was deployed)")
            target = self._deployable(candidate.version)
        pinned = self.adapters.alias(name, "pinned")
        if pinned is not None and pinned.checkpoint.id != target.checkpoint.id:
            raise CommandError(f"adapter {name} is pinned to {pinned.version}: run `hotswap unpin --adapter {name}` first")
        result = self.rollout.deploy(target, trigger=T.ROLLBACK, previous=serving,
                                     detail={"by": by, "from": serving.version if serving else None})  # fmt: skip
        if result.outcome == RolloutOutcome.SUCCEEDED:
            if serving is not None and serving.checkpoint.id != target.checkpoint.id:
                self.journal.checkpoint_event(serving.checkpoint.id, "rolled_back",
                                              {"to": target.version, "by": by}, result.rollout_id)  # fmt: skip
            self.mark_serving(target, serving, f"adapter {name}: restored by operator rollback (rollout {result.rollout_id})")
            self.served.mark_adapter_last_good(name, target)
        return {"rollout_id": result.rollout_id, "adapter": name, "version": target.version,
                "outcome": result.outcome.value, "reason": result.reason, "from": serving.version if serving else None}  # fmt: skip

    def pin(self, version: str, force: bool = False, by: str = "operator") -> dict[str, Any]:
        target = self._deployable(version)
        if target.checkpoint.status == C.REJECTED and not force:
            raise CommandError(f"adapter version {version!r} was rejected: pin it anyway with --force")
        serving = self.adapters.alias(target.name, "serving")
        self.adapters.set_alias(target.name, "pinned", target.checkpoint.id)
        self.journal.checkpoint_event(target.checkpoint.id, "pinned", {"by": by, "force": force, "adapter": target.name}, None)
        result = self.rollout.deploy(target, trigger=T.MANUAL, previous=serving, detail={"by": by, "pin": True})
        if result.outcome == RolloutOutcome.SUCCEEDED:
            self.mark_serving(target, serving, f"adapter {target.name}: pinned by operator (rollout {result.rollout_id})")
            self.served.mark_adapter_last_good(target.name, target)
        else:
            self.adapters.set_alias(target.name, "pinned", None)
        return {"rollout_id": result.rollout_id, "adapter": target.name, "outcome": result.outcome.value,
                "pinned": target.version if result.outcome == RolloutOutcome.SUCCEEDED else None, "reason": result.reason}  # fmt: skip

    def unpin(self, name: str, by: str = "operator") -> dict[str, Any]:
        was = self.adapters.alias(name, "pinned")
        self.adapters.set_alias(name, "pinned", None)
        if was is not None:
            self.journal.checkpoint_event(was.checkpoint.id, "unpinned", {"by": by, "adapter": name}, None)
        waiting = self.adapters.newest_waiting(name)
        serving = self.adapters.alias(name, "serving")
        nxt = waiting if waiting is not None and (serving is None or newer(waiting.checkpoint, serving.checkpoint)) else None
        out: dict[str, Any] = {"adapter": name, "unpinned": was.version if was else None, "outcome": "unpinned",
                               "next": nxt.version if nxt else None}  # fmt: skip
        if nxt is not None:
            out["deployed"] = self.deploy_new(nxt.checkpoint.id)
        return out

    def reconcile(self) -> dict[str, Any]:
        """Every adapter-serving worker onto each name's serving version; newer waiting versions
        (held back by an unreachable worker) are deployed."""
        rebased = self.binding.rebase()  # the base may have changed while the daemon was down
        windows = self.resume_windows()
        loaded: dict[str, list[str]] = {}
        for name in self.adapters.names():
            serving = self.adapters.alias(name, "serving")
            if serving is None:
                continue
            drifted = []
            for h in self.rollout.workers():
                try:
                    if not self.rollout.serves(h, serving):
                        drifted.append(h.name)
                except Exception as exc:  # noqa: BLE001 - an unreachable worker is reconciled when it is back
                    log.info("adapter_reconcile_skipped", worker=h.name, adapter=name, error=str(exc))
            if drifted:
                result = self.rollout.deploy(serving, trigger=T.ROLLBACK, previous=serving, only=drifted,
                                             detail={"by": "reconcile"})  # fmt: skip
                loaded[name] = drifted if result.outcome == RolloutOutcome.SUCCEEDED else []
        for name in sorted(set(self.adapters.names()) | set(self.adapters.waiting_names())):
            waiting = self.adapters.newest_waiting(name)
            serving = self.adapters.alias(name, "serving")
            if waiting is not None and self.adapters.alias(name, "pinned") is None and (
                    serving is None or newer(waiting.checkpoint, serving.checkpoint)):
                self.deploy_new(waiting.checkpoint.id)
        return {"outcome": "reconciled" if loaded or rebased or windows else "in sync", "loaded": loaded,
                "rebased": rebased, "windows": windows}  # fmt: skip

    def resume_windows(self) -> dict[str, str]:
        """Each name whose serving version never finished its health window (the daemon stopped
        inside it, or a command cut it short) is watched again now: a version is last_good only
        after a window, and a bad one is rolled back rather than left serving untrusted. Run on
        every reconcile (one is queued at each start), never beside a window: jobs run one at a
        time on the runner thread. Returns each re-watched name's verdict."""
        out: dict[str, str] = {}
        if self.settings.health_window_s <= 0:
            return out
        for name in self.adapters.names():
            serving = self.adapters.alias(name, "serving")
            last_good = self.adapters.alias(name, "last_good")
            if serving is None or (last_good is not None and last_good.checkpoint.id == serving.checkpoint.id):
                continue
            fresh = self.journal.checkpoint(serving.checkpoint.id)
            rid = self.journal.last_rollout_of(serving.checkpoint.id)
            if fresh is None or fresh.status != C.DEPLOYED or rid is None:
                continue  # rejected (its rollback failed: said where it failed) or never rolled out here
            log.info("adapter_health_window_resumed", adapter=name, version=serving.version,
                     last_good=last_good.version if last_good else None)  # fmt: skip
            out[name] = self.health_window.watch(_AdapterWindow(self, serving, last_good), rid)["health_window"]
        return out

    def drifted(self) -> bool:
        """Some adapter-serving worker does not serve a name's serving version (for the health poll)."""
        for name in self.adapters.names():
            serving = self.adapters.alias(name, "serving")
            if serving is None:
                continue
            for h in self.rollout.workers():
                try:
                    if not self.rollout.serves(h, serving):
                        return True
                except Exception:  # noqa: BLE001 - not answering: the base's poll reports it
                    continue
        return False

    def settle(self) -> dict[str, Any] | None:
        """One step of the open health window; None while it stays open, else its verdict's result."""
        assert self.window is not None
        out = self.health_window.settle(self.window)
        if out is not None:
            self.window = None
        return out

    # -- registry ----------------------------------------------------------------------------
    def mark_serving(self, av: AdapterVersion, previous: AdapterVersion | None, message: str) -> None:
        self.served.mark_adapter_serving(av, previous, message, self.binding.served)


@dataclass
class _AdapterWindow:
    """An adapter name's part in a health window over `av` (a daemon.controller.health_window.Watched)."""

    of: AdapterDecisions
    av: AdapterVersion
    previous: AdapterVersion | None  # None: a failed window unloads the name
    retried: bool = False  # a worker stopped answering, not the version's fault: deployed again

    def __post_init__(self) -> None:
        self.checkpoint, self.about = self.av.checkpoint, {"adapter": self.av.name, "version": self.av.version}

    def start(self, interrupted: Callable[[], bool]) -> Stepped:
        return self.of.rollout.window(self.av, self.of.settings, interrupted)

    def passed(self) -> None:
        self.of.served.mark_adapter_last_good(self.av.name, self.av)

    def fallback(self) -> Fallback:
        return Fallback(self.previous.version if self.previous else None)

    def reject(self, verdict: WindowVerdict, why: str) -> None:
        self.retried = reject_or_retry(self.of.journal, self.of.settings, self.av.checkpoint.id, verdict,
                                       f"adapter {self.av.name}: {why}")  # fmt: skip

    def roll_back(self, verdict: WindowVerdict, rid: int) -> dict[str, Any]:
        """Every worker onto the previous version (or the name unloaded); serving follows what succeeded."""
        d, name, to = self.of, self.av.name, self.previous
        if to is None:
            for h in d.rollout.workers():
                with h.busy:
                    d.rollout.restore(h, None, name, None)
            d.served.clear_adapter_serving(name)
            outcome = "unloaded"
        else:
            result = d.rollout.deploy(to, trigger=T.ROLLBACK, previous=to, detail={"by": "health_window"})
            outcome = result.outcome.value
            if result.outcome != RolloutOutcome.SUCCEEDED:
                return {"rollback_outcome": outcome}  # a worker still drifted: the reconcile that fixes it retries
            d.mark_serving(to, None, f"adapter {name}: restored by health_window (rollout {result.rollout_id})")
            d.served.mark_adapter_last_good(name, to)
        if self.retried:  # a worker stopped answering, not the version's fault: deployed again (bounded)
            d.submit(self.av.checkpoint.id)
        return {"rollback_outcome": outcome}
