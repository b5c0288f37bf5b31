"""LoRA adapters belong to a base: what happens to each served adapter when the serving base changes.

An adapter version is verified against the base that served when it arrived (its compat check
records that base); each later base it passes on is an `adapter_base_verified` event
(daemon.registry.adapters). Each served adapter name is held to a base before any worker takes
that base (`prepare`, called by the rollout engine after its preflight), so no adapter serves for
a moment on a base it was not verified on; and again after every base job, and before an adapter
is deployed, against the base that then serves (`rebase`, level-triggered: a daemon restarted
half way does it on its first pass):

    verified on it      nothing to do
    checks.adapter_on_base_change = "reverify" (default)
                        compat and the forward canary (KL and top-1 bounds of the adapter over the
                        base) run again, with the serving base as reference; passed: recorded, and
                        each worker's probe under the adapter is recorded again on the new base
    failed, or "unload" the name is unloaded on every worker (an `adapter_unloaded` event per
                        worker, an `adapter_unbound` event on the version), the version retired,
                        `last_good` moved to the newest version of the name already verified on the
                        serving base (deployed, when there is one) or cleared; the problem
                        `adapter_not_on_base` names the adapter until a version of it serves again

Unloaded in `prepare`, the replacement waits for `rebase`: it must be verified on the base that
then serves. When that base never came to serve (its rollout failed or was superseded) and the
unloaded version fits the base that does, it is loaded again (a `base_change_undone` rollout).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from daemon.checks import CheckSettings
from daemon.common import get_logger
from daemon.controller.adapter_rollout import AdapterRollout
from daemon.controller.served import ServedVersions
from daemon.registry import (
    AdapterJournal,
    AdapterVersion,
    CheckpointRef,
    CheckpointStatus,
    Journal,
    RolloutOutcome,
    RolloutTrigger,
)

log = get_logger(__name__)
ON_BASE_CHANGE = ("reverify", "unload")
C = CheckpointStatus


def bases_of(ref: CheckpointRef) -> set[str]:
    return {ref.version} | ({ref.digest} if ref.digest else set())


class BaseBinding:
    """Holds every served adapter to the serving base (see the module docstring)."""

    def __init__(self, journal: Journal, adapters: AdapterJournal, rollout: AdapterRollout, checks: CheckSettings,
                 versions: ServedVersions) -> None:  # fmt: skip
        self.journal = journal
        self.adapters = adapters
        self.rollout = rollout
        self.checks = checks
        self.versions = versions  # the one writer of each name's serving and last_good
        self.unbound: dict[str, str] = {}  # adapter name -> why it serves nothing (the problem)
        self._reprobe_due: set[str] = set()  # re-verified by `prepare`: probes recorded again after the rollout
        self._unloaded_for: dict[str, tuple[AdapterVersion, int]] = {}  # by `prepare`: name -> (version, base id)

    def problems(self) -> list[tuple[str, str]]:
        return sorted(self.unbound.items())

    def served(self, name: str) -> None:
        """A version of `name` serves again: its problem ends."""
        self.unbound.pop(name, None)

    def fits(self, av: AdapterVersion, base: CheckpointRef | None = None) -> str | None:
        """None when `av` may serve on `base` (default: the serving base), verified on it or
        re-verified now and recorded; else why not."""
        base = base or self.journal.alias("serving")
        if base is None or bases_of(base) & self.adapters.verified_bases(av.checkpoint.id):
            return None
        if self.checks.adapter_on_base_change == "unload":
            return (f"verified on base {', '.join(sorted(self.adapters.verified_bases(av.checkpoint.id))) or '?'}, "
                    f"not on the base {base.version} (checks.adapter_on_base_change = \"unload\")")  # fmt: skip
        return self._reverify(av, base)

    def _reverify(self, av: AdapterVersion, base: CheckpointRef) -> str | None:
        from daemon.checks import run_checks  # the forward canary's imports only when an adapter needs them

        if not av.checkpoint.local_path or not base.local_path:
            return f"no local copy of {av.version if not av.checkpoint.local_path else base.version} to check"
        forward = ("forward",) if "forward" in self.checks.enabled else ()
        settings = dataclasses.replace(self.checks, enabled=("headers", "compat", *forward), hmac_keys={},
                                       ed25519_keys={}, require_manifest=False, stage_device="off")  # fmt: skip
        report = run_checks(Path(av.checkpoint.local_path), settings, reference=Path(base.local_path))
        detail: dict[str, Any] = {r.name: r.detail for r in report.results if r.name in ("compat", "forward")}
        log.info("adapter_reverified", adapter=av.name, version=av.version, base=base.version, ok=report.ok,
                 reason=report.reason)  # fmt: skip
        if not report.ok:
            return f"re-verified on the base {base.version}: {report.reason}"
        self.adapters.record_base_verified(av.checkpoint.id, base.version, base.digest, {"checks": detail})
        return None

    def prepare(self, base: CheckpointRef) -> None:
        """Before any worker takes `base`: each served adapter re-verified on it (its probes
        recorded again by the `rebase` after the rollout), or unloaded everywhere now."""
        for name in self.adapters.names():
            serving = self.adapters.alias(name, "serving")
            if serving is None or bases_of(base) & self.adapters.verified_bases(serving.checkpoint.id):
                continue
            why = self.fits(serving, base)
            if why is None:
                self._reprobe_due.add(name)
            else:
                self._unload(serving, base, why)
                self._unloaded_for[name] = (serving, base.id)

    def rebase(self) -> dict[str, Any]:
        """Every served adapter name onto the serving base: kept (re-verified) or unloaded; and
        each name `prepare` unloaded replaced, or loaded again when its base never came."""
        out: dict[str, Any] = {}
        base = self.journal.alias("serving")
        for name, (av, for_base) in list(self._unloaded_for.items()):
            del self._unloaded_for[name]
            if base is None:
                continue
            if base.id != for_base and bases_of(base) & self.adapters.verified_bases(av.checkpoint.id):
                out[name] = self._load_again(av, base)
            else:
                out[name] = self._replace(av, base)
        for name in self.adapters.names():
            serving = self.adapters.alias(name, "serving")
            if serving is None or base is None:
                continue
            if bases_of(base) & self.adapters.verified_bases(serving.checkpoint.id):
                if name in self._reprobe_due:  # re-verified before the rollout; its probe moved with the base
                    self._reprobe_due.discard(name)
                    self._reprobe(serving)
                    out[name] = "kept"
                continue
            why = self.fits(serving)
            if why is None:
                self._reprobe(serving)
                out[name] = "kept"
            else:
                self._unload(serving, base, why)
                out[name] = self._replace(serving, base)
        return out

    def _reprobe(self, av: AdapterVersion) -> None:
        """The probe under the adapter changed with the base: record it again on each worker."""
        self.rollout.forget_probes(av.name)
        for h in self.rollout.workers():
            try:
                with h.busy:
                    self.rollout.recheck(h, av)
            except Exception as exc:  # noqa: BLE001 - a worker not answering is reconciled when it is back
                log.warning("adapter_reprobe_failed", worker=h.name, adapter=av.name, error=str(exc))

    def _unload(self, av: AdapterVersion, base: CheckpointRef, why: str) -> None:
        """`av` fails `base`: off every worker, no serving, retired, last_good moved, the problem."""
        name = av.name
        log.warning("adapter_not_on_base", adapter=name, version=av.version, base=base.version, reason=why)
        failed: list[str] = []
        for h in self.rollout.workers():
            try:
                with h.busy:
                    self.rollout.restore(h, None, name, None)  # unload, an `adapter_unloaded` event
            except Exception as exc:  # noqa: BLE001 - said in the event and the problem
                failed.append(h.name)
                log.error("adapter_unload_failed", worker=h.name, adapter=name, error=str(exc))
        self.versions.clear_adapter_serving(name)
        self.journal.checkpoint_event(av.checkpoint.id, "adapter_unbound",
                                      {"adapter": name, "base": base.version, "reason": why, "not_unloaded": failed}, None)  # fmt: skip
        fresh = self.journal.checkpoint(av.checkpoint.id)
        if fresh is not None and fresh.status == C.DEPLOYED:
            self.journal.move_status(av.checkpoint.id, C.RETIRED, f"adapter {name}: unloaded: {why}")
        self.versions.mark_adapter_last_good(name, self._good_on(av, base))
        self.unbound[name] = (f"adapter {name} {av.version} unloaded from every worker"
                              + (f" (not from {', '.join(failed)})" if failed else "") + f": {why}")  # fmt: skip

    def _good_on(self, av: AdapterVersion, base: CheckpointRef) -> AdapterVersion | None:
        """The newest other version of the name already verified on `base` (re-verifying each old
        one would run a canary apiece)."""
        return next((v for v in self.adapters.versions_of(av.name) if v.checkpoint.id != av.checkpoint.id
                     and bases_of(base) & self.adapters.verified_bases(v.checkpoint.id)), None)  # fmt: skip

    def _replace(self, av: AdapterVersion, base: CheckpointRef) -> str:
        """After `_unload`, with `base` serving: its last good version on that base serves, if any."""
        good = self._good_on(av, base)
        self.versions.mark_adapter_last_good(av.name, good)
        if good is None or not self._serve(good, {"by": "base_change", "base": base.version},
                                           f"{good.version} (verified on base {base.version}) replaces {av.version}"):  # fmt: skip
            return "unloaded"
        return f"replaced by {good.version}"

    def _load_again(self, av: AdapterVersion, base: CheckpointRef) -> str:
        """`prepare` unloaded `av` for a base that never came to serve; it fits `base`, which does."""
        if not self._serve(av, {"by": "base_change_undone", "base": base.version},
                           f"{av.version} serves again: the base it was unloaded for did not come to serve"):  # fmt: skip
            return "unloaded"
        self.versions.mark_adapter_last_good(av.name, av)
        return "loaded again"

    def _serve(self, av: AdapterVersion, detail: dict[str, Any], why: str) -> bool:
        """`av` onto every worker (a rollback rollout); its name's serving when that succeeded."""
        result = self.rollout.deploy(av, trigger=RolloutTrigger.ROLLBACK, previous=None, detail=detail)
        if result.outcome != RolloutOutcome.SUCCEEDED:
            return False
        self.versions.mark_adapter_serving(av, None, f"adapter {av.name}: {why} (rollout {result.rollout_id})", self.served)
        return True
