"""A trainer's broadcast session, driven as a rollout: the workers, the checks, the registry's record.

The HTTP face (parse, authenticate, answer) is daemon.api.broadcast, which hands each session
here once parsed. A session is a rollout like any other, run on its own thread with every
worker's `busy` lock held (so the rollout runner and the health poll wait for it); only workers
whose engine client declares `capabilities.broadcast` take part (daemon.engines.base):

1. the version gets a `checkpoints` row (source `broadcast`, status verifying) and a rollout
   (transport `broadcast`, mode `pause`);
2. for every worker at once, through the rollout's `WorkerDriver` (every move is an event):
   pause -> `init_weight_group` (rank 1..N) -> `POST /admin/update {transport: "broadcast",
   table, group_name, restore_from, keep_at (first worker only)}`, which returns once the
   trainer has sent everything and the worker has checked and committed it;
3. every worker must report the same digest of the bytes it received (with signing keys: the
   digest the session's signature vouches for, `daemon.api.broadcast_trust`), and the compat and
   forward checks must pass on the saved copy while every worker is still paused
   (`check_received`): then the version is verified, each worker is post-checked (weight_info +
   a probe generation) and resumed, and the version becomes serving and last good (through
   daemon.controller.served). The first worker saved it under `<state_dir>/broadcast/<version>`,
   the checkpoint's `local_path`, so a later failure or an operator rollback can re-install it
   from disk;
4. anything else (a refused table, a trainer that died, a worker that died, a timeout, a session
   past `[rollout] broadcast_max_pause_s` from its pause (each worker holds its receive to the
   time left: a trainer that stops or crawls is cut off within that bound),
   different digests): every worker goes back to the fallback version (last good) through
   the driver's restore, the checkpoint is rejected and the rollout failed.

    sessions = BroadcastSessions(service, state_dir, checks)
    sessions.start(version, table, spec, body, signed_digest)   # -> {session, rollout_id, ...}
    sessions.result(session_id, wait_s)                         # -> (200 | 202, the result)
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.checks import CheckSettings, run_checks
from daemon.common import get_logger
from daemon.controller.service import RolloutService
from daemon.engines import WorkerError
from daemon.registry import (
    Checkpoint,
    CheckpointRef,
    CheckpointStatus,
    RolloutOutcome,
    RolloutTrigger,
    status,
)
from daemon.rollout import FailurePath, StepFailed, Target, WorkerHandle, WorkerState
from daemon.transport import DEFAULT_BUCKET_BYTES, GroupSpec, UpdateRequest, parse_table, total_bytes

log = get_logger(__name__)
C = CheckpointStatus
KEEP_SESSIONS = 16
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
RECEIVED_CHECKS = ("compat", "forward")  # the table, finiteness and digest the workers checked already


class Refusal(Exception):
    """A session not started (or not known): `status_code` is what the API answers. `retry_after_s`: the refusal
    is transient (the daemon is starting, a worker is busy, another session runs); the trainer
    may ask again after that many seconds."""

    def __init__(self, status_code: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after_s = retry_after_s


@dataclass
class Session:
    id: str
    version: str
    body: dict[str, Any]
    handles: list[WorkerHandle]
    checkpoint_id: int
    rollout_id: int
    keep_dir: Path
    signed_digest: str | None = None
    started: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None


class BroadcastSessions:
    """Sessions of one daemon: at most one runs at a time."""

    def __init__(self, service: RolloutService, state_dir: Path, checks: CheckSettings | None = None) -> None:
        self.service = service
        self.state_dir = Path(state_dir)
        self.checks = checks
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._running: Session | None = None

    # -- start ---------------------------------------------------------------------------------
    def start(self, version: str, table: list[dict[str, Any]], spec: GroupSpec, body: dict[str, Any],
              signed: str | None) -> dict[str, Any]:  # fmt: skip
        """A parsed and authenticated session (daemon.api.broadcast): every worker taken, the
        version and its rollout recorded, the session's thread started. Raises Refusal."""
        svc = self.service
        if not svc.wait_ready(0):
            raise Refusal(503, "the daemon is still starting (crash recovery)", retry_after_s=1)
        handles = list(svc.fleet)
        not_ours = [h.name for h in handles if not h.client.capabilities.broadcast]
        if not_ours:
            raise Refusal(409, f"broadcast needs reference workers (engine clients with capabilities.broadcast); "
                               f"{', '.join(not_ours)} are not")  # fmt: skip
        if svc.journal.checkpoint_by_version(version) is not None:
            raise Refusal(409, f"version {version!r} is already recorded: every broadcast needs a new version")
        with self._lock:
            if self._running is not None:
                raise Refusal(409, f"broadcast session {self._running.id} ({self._running.version}) is still running",
                              retry_after_s=1)  # fmt: skip
            taken: list[WorkerHandle] = []
            for h in handles:
                if not h.busy.acquire(timeout=0.5):
                    for t in taken:
                        t.busy.release()
                    raise Refusal(409, f"worker {h.name} is busy with a rollout; try again", retry_after_s=1)
                taken.append(h)
            # Only from RUNNING (as the daemon knows it): an UNCERTAIN worker waits for the reconcile
            # job to re-install a known version, an unreachable one for the health poll or a restart.
            not_running = [f"{h.name} is {h.state.value if h.state else 'not known yet'}" for h in handles
                           if h.state != WorkerState.RUNNING]  # fmt: skip
            if not_running:
                for t in taken:
                    t.busy.release()
                raise Refusal(409, f"workers not RUNNING: {', '.join(not_running)}; try again", retry_after_s=1)
            try:
                session = self._record(version, table, spec, body, handles)
                session.signed_digest = signed
            except BaseException:
                for t in taken:
                    t.busy.release()
                raise
            for t in taken:
                t.driven = True  # the session moves them from here (what the problem probe reads)
            self._running = session
            self._sessions[session.id] = session
            while len(self._sessions) > KEEP_SESSIONS:
                self._sessions.pop(next(iter(self._sessions)))
        threading.Thread(target=self._run, args=(session,), name=f"broadcast-{session.id}", daemon=True).start()
        return {"session": session.id, "group_name": f"hotswap-{session.id}", "world_size": len(handles) + 1,
                "workers": [h.name for h in handles], "rollout_id": session.rollout_id,
                "checkpoint_id": session.checkpoint_id}  # fmt: skip

    def _record(self, version: str, table: list[dict[str, Any]], spec: GroupSpec, body: dict[str, Any],
                handles: list[WorkerHandle]) -> Session:  # fmt: skip
        sid = secrets.token_hex(8)
        keep_dir = self.state_dir / "broadcast" / (_SAFE.sub("_", version) + f"-{sid}")
        parsed = parse_table(table)
        journal = self.service.journal
        with journal.registry.session() as s:
            ckpt = status.create(s, version=version, source="broadcast", local_path=str(keep_dir),
                                 uri=f"broadcast://{spec.master_address}:{spec.master_port}/{sid}",
                                 commit_signal="broadcast")  # fmt: skip
            if ckpt is None:
                raise Refusal(409, f"version {version!r} is already recorded")
            ckpt.total_bytes, ckpt.tensor_count, ckpt.step = total_bytes(parsed), len(parsed), body.get("step")
            status.move(s, ckpt, C.VERIFYING, "receiving from the trainer")
            ckpt_id = ckpt.id
        rid = journal.start_rollout(ckpt_id, trigger=RolloutTrigger.NEW, transport="broadcast", mode="pause",
                                    detail={"session": sid, "world_size": len(handles) + 1,
                                            "trainer": f"{spec.master_address}:{spec.master_port}"})  # fmt: skip
        return Session(sid, version, {**body, "table": table}, handles, ckpt_id, rid, keep_dir)

    # -- the session -------------------------------------------------------------------------
    def _run(self, ses: Session) -> None:
        try:
            ses.result = self._drive(ses)
        except Exception as exc:  # a bug: still leave a result and free the workers
            log.exception("broadcast_failed", session=ses.id)
            ses.result = {"session": ses.id, "version": ses.version, "outcome": "failed", "reason": str(exc)}
        finally:
            for h in ses.handles:
                h.driven = False
                h.busy.release()
            with self._lock:
                self._running = None
            ses.done.set()

    def _drive(self, ses: Session) -> dict[str, Any]:
        svc, journal, driver = self.service, self.service.journal, self.service.driver
        serving = journal.alias("serving")
        fallback = svc.engine.fallback_target(svc.decisions.fallback())
        ref = journal.checkpoint(ses.checkpoint_id)
        assert ref is not None
        body, group = ses.body, f"hotswap-{ses.id}"
        max_pause = self.service.settings.broadcast_max_pause_s
        timeout_s = min(float(body.get("timeout_s", 60.0)), max_pause)
        deadline = time.monotonic() + max_pause  # the whole pause, however the trainer paces its sends
        reports: dict[str, dict[str, Any]] = {h.name: {"worker": h.name, "ok": False} for h in ses.handles}

        def one(i: int, h: WorkerHandle) -> None:
            rep = reports[h.name]
            driver.begin(h, ses.rollout_id, "pause", ses.version)
            t0 = time.perf_counter()
            left = max(0.1, deadline - time.monotonic())
            spec = GroupSpec(body["master_address"], body["master_port"], i + 1, len(ses.handles) + 1,
                             body.get("backend", "gloo"), group, min(timeout_s, left))
            try:
                h.client.init_weight_group(spec, timeout_s=timeout_s + 10)
            except WorkerError as exc:
                raise driver.fail(h, ses.rollout_id, "init_weight_group", exc, t0) from exc
            request = UpdateRequest(ses.version, "broadcast", {
                "group_name": group, "table": body["table"],
                "bucket_bytes": body.get("bucket_bytes", DEFAULT_BUCKET_BYTES),
                "restore_from": str(ses.keep_dir),
                "deadline_s": max(0.1, deadline - time.monotonic()),  # the worker's bound on the rest
                **({"keep_at": str(ses.keep_dir)} if i == 0 else {}),
            })  # fmt: skip
            driver.transfer(h, ses.rollout_id, Target(ref, request))
            info = h.client.weight_info()
            rep.update(ok=True, digest=info.digest, receive_ms=(info.extra.get("last_update") or {}).get("receive_ms"))

        def guarded(i: int, h: WorkerHandle) -> None:
            try:
                one(i, h)
            except (StepFailed, WorkerError) as exc:
                reports[h.name]["error"] = str(exc)

        with ThreadPoolExecutor(max_workers=len(ses.handles)) as pool:
            list(pool.map(lambda a: guarded(*a), enumerate(ses.handles)))
        digests = {r.get("digest") for r in reports.values()}
        reason = next((r["error"] for r in reports.values() if "error" in r), None)
        if reason is None and (len(digests) != 1 or None in digests):
            reason = f"workers received different bytes: digests {sorted(map(str, digests))}"
        if reason is None and ses.signed_digest is not None and digests != {ses.signed_digest}:
            reason = (f"the workers' digest {next(iter(digests))} differs from the signed digest "
                      f"{ses.signed_digest}: not the bytes the trainer signed")  # fmt: skip
        digest = next(iter(digests)) if reason is None else None
        checks: list[dict[str, Any]] = []
        if reason is None:  # every worker still paused on the new weights: nobody serves them yet
            ref_dir = Path(serving.local_path) if serving and serving.local_path else None
            reason, checks = check_received(ses.keep_dir, ref_dir if ref_dir and ref_dir.is_dir() else None, self.checks)
        fresh: CheckpointRef | None = None
        if reason is None:
            self._verified(ses, str(digest))
            fresh = journal.checkpoint(ses.checkpoint_id)
            assert fresh is not None
            target = Target(fresh, UpdateRequest(ses.version, "disk", {"path": str(ses.keep_dir)}))
            for h in ses.handles:
                try:
                    driver.finish(h, ses.rollout_id, target)
                except StepFailed as exc:
                    reports[h.name].update(ok=False, error=str(exc))
                    reason = reason or str(exc)
        if reason is None and fresh is not None:
            svc.served.mark_serving(fresh, serving, f"broadcast by the trainer (rollout {ses.rollout_id})")
            svc.served.mark_last_good(fresh)
            journal.finish_rollout(ses.rollout_id, RolloutOutcome.SUCCEEDED, {"digest": digest})
            outcome = RolloutOutcome.SUCCEEDED
        else:
            reason = reason or "the checkpoint row went missing"
            self._undo(ses, fallback, reason, reports)
            outcome = RolloutOutcome.FAILED
        log.info("broadcast_done", session=ses.id, version=ses.version, outcome=outcome.value, reason=reason)
        return {"session": ses.id, "version": ses.version, "outcome": outcome.value, "reason": reason,
                "digest": digest, "rollout_id": ses.rollout_id, "checkpoint_id": ses.checkpoint_id,
                "fallback": fallback.version if fallback else None, "workers": list(reports.values()), "checks": checks,
                "duration_s": round(time.time() - ses.started, 3)}  # fmt: skip

    def _verified(self, ses: Session, digest: str) -> None:
        with self.service.journal.registry.session() as s:
            ckpt = s.get(Checkpoint, ses.checkpoint_id)
            assert ckpt is not None
            ckpt.digest = digest
            status.move(s, ckpt, C.VERIFIED, f"received by {len(ses.handles)} worker(s): table matched, "
                                             "values finite, the same digest on every worker"
                                             + (" (the signed one)" if ses.signed_digest else "")
                                             + "; compat and forward checks passed")  # fmt: skip

    def _undo(self, ses: Session, fallback: Target | None, reason: str, reports: dict[str, dict[str, Any]]) -> None:
        """Every worker back on the fallback version; the checkpoint rejected, the rollout failed."""
        driver, journal = self.service.driver, self.service.journal
        failure = FailurePath(driver)
        why = f"broadcast of {ses.version} failed: {reason}"
        for h in ses.handles:
            t0 = time.perf_counter()
            if h.state is not None and h.state.value not in ("UNHEALTHY", "UNCERTAIN"):
                if h.state.value == "RUNNING" and not reports[h.name].get("ok"):
                    continue  # never left RUNNING (refused before the pause): nothing to undo
                driver.fail(h, ses.rollout_id, "broadcast", f"rolled back: {reason}", t0)
            restored = failure.restore(h, ses.rollout_id, fallback, why, avoid=ses.version)
            if not restored and h.state is not None and h.state.value == "UNHEALTHY":  # dead: its restart command
                restored = failure.restart(h, ses.rollout_id, fallback, why, avoid=ses.version)
            reports[h.name]["restored_to"] = fallback.version if restored and fallback else None
            reports[h.name]["ok"] = False
        journal.move_status(ses.checkpoint_id, C.REJECTED, why[:500])
        journal.finish_rollout(ses.rollout_id, RolloutOutcome.FAILED, {"reason": reason})

    # -- results -----------------------------------------------------------------------------
    def result(self, session: str, wait_s: float) -> tuple[int, dict[str, Any]]:
        with self._lock:
            ses = self._sessions.get(session)
        if ses is None:
            raise Refusal(404, f"no broadcast session {session!r}")
        if not ses.done.wait(max(0.0, min(wait_s, 600.0))) or ses.result is None:
            return 202, {"session": ses.id, "version": ses.version, "outcome": None, "running": True}
        return 200, ses.result


def check_received(directory: Path, reference: Path | None, settings: CheckSettings | None) -> tuple[str | None, list[dict[str, Any]]]:
    """While every worker is still paused on the received weights: the compat check against the
    serving version and the forward canary (with the daemon's `[checks]` bounds) on the copy the
    first worker saved. (the first failure "<check>: <reason>" or None, every check's result)."""
    base = settings or CheckSettings()
    enabled = tuple(n for n in RECEIVED_CHECKS if n in base.enabled)
    if not enabled:
        return None, []
    # the saved copy has no manifest (the signature, if any, was checked on the session)
    only = dataclasses.replace(base, enabled=enabled, hmac_keys={}, ed25519_keys={}, require_manifest=False,
                               stage_device="off")  # fmt: skip
    report = run_checks(directory, only, reference=reference)
    results = [{"name": r.name, "status": r.status, "ms": round(r.duration_ms, 1),
                **({"reason": r.detail.get("reason")} if not r.ok else {})} for r in report.results]  # fmt: skip
    return (None if report.ok else report.reason or "a check failed"), results
