"""Moving every worker's LoRA adapter `name` to one version, with no pause, and back on failure.

Unlike a base rollout no worker leaves RUNNING: base traffic is never held, and each engine swaps
the adapter beside the base (the reference worker atomically between requests; vLLM in place
with `load_inplace`; SGLang by unload then load). Workers are moved one at a time, in
`[[workers]]` order, each step recorded before the next starts (a `rollouts` row with transport
"adapter", an `events` row per worker):

    load      the client hands the engine the verified directory (the engine-file check and the
              reference worker's own hash make sure only verified bytes are read)
    check     the worker lists `name` on that version (or that directory), and a greedy probe
              with `model: name` is finite and, for a version this worker served before, gives
              the tokens it gave then (a rollback is checked against what it restores)
    failure   the workers already moved get the previous version back (or lose `name`, when
              there was none); a worker that refused keeps what it served: never a mix

    rollout = AdapterRollout(journal, adapters_journal, fleet, stager)
    result = rollout.deploy(version, trigger=..., previous=...)      # daemon.rollout.engine.RolloutResult
    window = rollout.window(version, settings, interrupted)          # the health window of that adapter
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, cast

from daemon.common import get_logger
from daemon.config import RolloutSettings
from daemon.engines import (
    AdapterRequest,
    ServesAdapters,
    UpdateRefused,
    WorkerClient,
    WorkerError,
    WorkerUnreachable,
)
from daemon.registry import (
    AdapterJournal,
    AdapterVersion,
    FailureKind,
    Journal,
    RolloutOutcome,
    RolloutTrigger,
)
from daemon.rollout import HealthWatch, RolloutResult, WorkerHandle, WorkerSet, health, registry_expect

log = get_logger(__name__)
TRANSPORT = "adapter"  # `rollouts.transport` of an adapter rollout (crash recovery leaves them to the reconcile)


class AdapterStepFailed(Exception):
    def __init__(self, worker: str, reason: str, kind: FailureKind, *, kept: bool = False) -> None:
        super().__init__(reason if reason.startswith(f"worker {worker}") else f"worker {worker}: {reason}")
        self.worker, self.kind, self.kept = worker, kind, kept  # kept: refused, it serves what it did


class AdapterRollout:
    def __init__(self, journal: Journal, adapters: AdapterJournal, fleet: WorkerSet) -> None:
        self.journal = journal
        self.adapters = adapters
        self.fleet = fleet
        self._tokens: dict[tuple[str, str, str], list[int]] = {}  # (worker, name, version) -> first probe

    def workers(self) -> list[WorkerHandle]:
        """The workers that serve adapters (others are left out, and said so at start)."""
        return [h for h in self.fleet if h.client.capabilities.adapters]

    @staticmethod
    def client(h: WorkerHandle) -> ServesAdapters:
        return cast(ServesAdapters, h.client)

    def serves(self, h: WorkerHandle, av: AdapterVersion) -> bool:
        """Whether `h` serves `av` under its name now (by version, or by directory for engines)."""
        served = self.client(h).adapters().get(av.name)
        if served is None:
            return False
        if served.version is not None:
            return served.version == av.version
        return bool(served.path and av.checkpoint.local_path
                    and os.path.realpath(served.path) == os.path.realpath(av.checkpoint.local_path))  # fmt: skip

    # -- a rollout -------------------------------------------------------------------------
    def deploy(self, av: AdapterVersion, *, trigger: RolloutTrigger, previous: AdapterVersion | None,
               only: Collection[str] | None = None, detail: dict[str, Any] | None = None) -> RolloutResult:  # fmt: skip
        handles = [h for h in self.workers() if only is None or h.name in only]
        rid = self.journal.start_rollout(
            av.checkpoint.id, trigger=trigger, transport=TRANSPORT, mode="live",
            detail={"adapter": av.name, "version": av.version, "fallback": previous.version if previous else None,
                    "workers": [h.name for h in handles], "base_model": av.base_model, **(detail or {})},
        )  # fmt: skip
        log.info("adapter_rollout_started", rollout=rid, adapter=av.name, version=av.version, trigger=trigger)
        moved: list[WorkerHandle] = []
        for h in handles:
            try:
                with h.busy:  # the health poll looks at it between steps, never during one
                    if self._one(h, rid, av, back=trigger == RolloutTrigger.ROLLBACK):
                        moved.append(h)
            except AdapterStepFailed as failed:
                return self._fail(rid, av, previous, h, failed, moved)
        self.journal.finish_rollout(rid, RolloutOutcome.SUCCEEDED, {"moved": [h.name for h in moved]})
        log.info("adapter_rollout_succeeded", rollout=rid, adapter=av.name, version=av.version)
        return RolloutResult(rid, RolloutOutcome.SUCCEEDED, moved=[h.name for h in moved])

    def _one(self, h: WorkerHandle, rid: int | None, av: AdapterVersion, *, back: bool = False) -> bool:
        """`h` onto `av`; False when it serves it already. Raises AdapterStepFailed."""
        client = self.client(h)
        try:
            served = client.adapters().get(av.name)
            if served is not None and self.serves(h, av):
                return False
            path = av.checkpoint.local_path
            if not path:
                raise AdapterStepFailed(h.name, f"{av.version} has no local copy on this host", FailureKind.REFUSED)
            request = AdapterRequest(av.name, av.version, path, registry_expect(self.journal, av.checkpoint),
                                     replace=served is not None)  # fmt: skip
            t0 = time.perf_counter()
            result = client.load_adapter(request)
            load_ms = (time.perf_counter() - t0) * 1e3
            tokens = self._post_check(h, av)
        except UpdateRefused as exc:
            self.adapters.worker_event(h.name, "adapter_refused", rid, av.checkpoint,
                                       {"adapter": av.name, "version": av.version, "error": str(exc)})  # fmt: skip
            raise AdapterStepFailed(h.name, str(exc), FailureKind.REFUSED, kept=True) from None
        except WorkerUnreachable as exc:
            raise AdapterStepFailed(h.name, str(exc), FailureKind.UNREACHABLE) from None
        except WorkerError as exc:
            raise AdapterStepFailed(h.name, str(exc), FailureKind.ERROR) from None
        self.adapters.worker_loaded(h.name, av.name, av.checkpoint, rid,
                                    {"ms": round(load_ms, 3), "worker_ms": round(result.duration_ms, 3),
                                     "probe_tokens": tokens, "back": back, "replaced": served is not None},
                                    duration_ms=(time.perf_counter() - t0) * 1e3)  # fmt: skip
        log.info("adapter_loaded", worker=h.name, adapter=av.name, version=av.version, ms=round(load_ms, 1))
        return True

    def _post_check(self, h: WorkerHandle, av: AdapterVersion) -> list[int]:
        """The worker lists `av`, and its probe under the adapter is the one recorded for it."""
        if not self.serves(h, av):
            raise AdapterStepFailed(h.name, f"after the load it does not list {av.name} on {av.version}", FailureKind.MISMATCH)
        version, tokens = self.client(h).adapter_probe(av.name)
        if version is not None and version != av.version:
            raise AdapterStepFailed(h.name, f"probe under {av.name} ran on {version!r}, expected {av.version!r}",
                                    FailureKind.MISMATCH)  # fmt: skip
        key = (h.name, av.name, av.version)
        known = self._tokens.setdefault(key, tokens)
        if known != tokens:
            raise AdapterStepFailed(h.name, f"probe under {av.name} {av.version} gives {tokens}, but gave {known} when "
                                    "this worker served it before: not the verified adapter", FailureKind.MISMATCH)  # fmt: skip
        return tokens

    def forget_probes(self, name: str) -> None:
        """The probes recorded under `name` were on another base: the next check records them again."""
        for key in [k for k in self._tokens if k[1] == name]:
            del self._tokens[key]

    def recheck(self, h: WorkerHandle, av: AdapterVersion) -> list[int]:
        """The post-check of a loaded adapter again (its probe recorded when forgotten)."""
        try:
            return self._post_check(h, av)
        except WorkerError as exc:
            raise AdapterStepFailed(h.name, str(exc), FailureKind.ERROR) from None

    def _fail(self, rid: int, av: AdapterVersion, previous: AdapterVersion | None, h: WorkerHandle,
              failed: AdapterStepFailed, moved: list[WorkerHandle]) -> RolloutResult:  # fmt: skip
        """Everyone this rollout moved (and the failed worker, unless it kept what it served)
        goes back to `previous`, or loses the name when there was none."""
        unrecovered: list[str] = []
        back = moved if failed.kept else [*moved, h]
        for w in reversed(back):
            try:
                with w.busy:
                    self.restore(w, rid, av.name, previous)
            except (AdapterStepFailed, WorkerError) as exc:
                log.error("adapter_restore_failed", worker=w.name, adapter=av.name, error=str(exc))
                unrecovered.append(w.name)
        detail = {"reason": str(failed), "worker": failed.worker, "kind": failed.kind.value,
                  "restored_to": previous.version if previous else None, "rolled_back": [w.name for w in moved],
                  "unrecovered": unrecovered}  # fmt: skip
        self.journal.finish_rollout(rid, RolloutOutcome.FAILED, detail)
        log.warning("adapter_rollout_failed", rollout=rid, adapter=av.name, version=av.version, **detail)
        return RolloutResult(rid, RolloutOutcome.FAILED, str(failed), unrecovered=unrecovered, kind=failed.kind)

    def restore(self, h: WorkerHandle, rid: int | None, name: str, previous: AdapterVersion | None) -> None:
        if previous is not None:
            self._one(h, rid, previous, back=True)
            return
        if name in self.client(h).adapters():
            self.client(h).unload_adapter(name)
            self.adapters.worker_loaded(h.name, name, None, rid, {"back": True})

    # -- the health window of one adapter --------------------------------------------------
    def window(self, av: AdapterVersion, settings: RolloutSettings, interrupted: Callable[[], bool]) -> HealthWatch:
        """daemon.rollout.health over this adapter's requests: its error rate on each worker (where
        the engine counts per adapter) and its greedy probes (finite, the recorded tokens)."""
        views = [WorkerHandle(spec=h.spec, client=cast(WorkerClient, _AdapterView(h, av, self._tokens)), url=h.url)
                 for h in self.workers()]  # fmt: skip
        return health.HealthWatch(WorkerSet(views), settings, interrupted, av.version)


@dataclass
class _AdapterView:
    """What the health window asks of a worker, answered for one adapter of it."""

    handle: WorkerHandle
    av: AdapterVersion
    tokens: dict[tuple[str, str, str], list[int]]

    @property
    def name(self) -> str:
        return self.handle.name

    def counters(self) -> dict[str, int]:
        c = cast(ServesAdapters, self.handle.client).adapter_counters(self.av.name)
        return c if c is not None else {"requests_total": 0, "requests_failed": 0}

    def probe(self) -> str:
        version, tokens = cast(ServesAdapters, self.handle.client).adapter_probe(self.av.name)
        known = self.tokens.get((self.handle.name, self.av.name, self.av.version))
        if known is not None and tokens != known:
            return f"{self.av.name} with other tokens than {self.av.version} gave ({tokens} != {known})"
        return version or self.av.version


__all__ = ["TRANSPORT", "AdapterRollout", "AdapterStepFailed"]
