"""The daemon's side of a trainer broadcast: rendezvous, per-worker steps, the registry's record.

    POST /v1/broadcast            {version, table, master_address, master_port, backend?, timeout_s?,
                                   bucket_bytes?, step?}
                                  -> 202 {session, group_name, world_size, workers, rollout_id}
    GET  /v1/broadcast/{session}  ?wait_s=N -> 200 the session's result, 202 while it runs

Both need the control token (`daemon.auth.ControlGuard`). `daemon.client.broadcast.BroadcastPush` is the
caller. A session is a rollout like any other, run on its own thread with every worker's
`busy` lock held (so the rollout runner and the health poll wait for it):

1. the version gets a `checkpoints` row (source `broadcast`, status verifying) and a rollout
   (transport `broadcast`, mode `pause`);
2. for every worker at once, through the rollout's `WorkerDriver` (every move is an event):
   pause -> `POST /admin/init_weight_group` (rank 1..N) -> `POST /admin/update {transport:
   "broadcast", table, group_name, restore_from, keep_at (first worker only)}`, which returns
   once the trainer has sent everything and the worker has checked and committed it;
3. every worker must report the same digest of the bytes it received (with signing keys: the
   digest the session's signature vouches for, `daemon.api.broadcast_trust`), and the compat and
   forward checks must pass on the saved copy while every worker is still paused: then the version is
   verified, each worker is post-checked (weight_info + a probe generation) and resumed, and the
   version becomes serving and last good. The first worker saved it under
   `<state_dir>/broadcast/<version>`, the checkpoint's `local_path`, so a later failure or an
   operator rollback can re-install it from disk;
4. anything else (a refused table, a trainer that died, a worker that died, a timeout, a session
   past `[rollout] broadcast_max_pause_s` from its pause (each worker holds its receive to the
   time left: a trainer that stops or crawls is cut off within that bound),
   different digests): every worker goes back to the fallback version (last good) through
   the driver's restore, the checkpoint is rejected and the rollout failed.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from daemon.api.broadcast_trust import Refusal, check_received, signed_digest
from daemon.checks.base import CheckSettings
from daemon.common.auth import ControlGuard
from daemon.common.jsonbody import JsonBodyError, parse_object, read_capped
from daemon.common.logging import get_logger
from daemon.controller.service import RolloutService
from daemon.engines.base import WorkerError
from daemon.engines.builtin import BuiltinWorkerClient
from daemon.registry import status
from daemon.registry.journal import CheckpointRef
from daemon.registry.models import Checkpoint
from daemon.registry.status import CheckpointStatus, RolloutOutcome, RolloutTrigger
from daemon.rollout.driver import StepFailed
from daemon.rollout.failure import FailurePath
from daemon.rollout.stage import Target
from daemon.rollout.states import WorkerHandle, WorkerState
from daemon.transport.base import BadUpdateRequest, UpdateRequest
from daemon.transport.broadcast import (
    DEFAULT_BUCKET_BYTES,
    GroupSpec,
    parse_table,
    table_to_json,
    total_bytes,
)

log = get_logger(__name__)
C = CheckpointStatus
KEEP_SESSIONS = 16
MAX_TABLE_BODY_BYTES = 16 << 20  # a tensor table of ~100k entries; the trainer is authenticated first
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


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


class Broadcasts:
    """Sessions of one daemon: at most one runs at a time."""

    def __init__(self, service: RolloutService, state_dir: Path, checks: CheckSettings | None = None) -> None:
        self.service = service
        self.state_dir = Path(state_dir)
        self.checks = checks
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._running: Session | None = None

    # -- start -------------------------------------------------------------------------------
    def begin(self, body: Any) -> dict[str, Any]:
        version, table, spec = self._parse(body)
        signed = signed_digest(body, version, table, self.checks)  # before any worker is touched
        svc = self.service
        if not svc.wait_ready(0):
            raise Refusal(503, "the daemon is still starting (crash recovery)", retry_after_s=1)
        handles = list(svc.fleet)
        not_ours = [h.name for h in handles if not isinstance(h.client, BuiltinWorkerClient)]
        if not_ours:
            raise Refusal(409, f"broadcast needs reference workers; {', '.join(not_ours)} are not")
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

    def _parse(self, body: Any) -> tuple[str, list[dict[str, Any]], GroupSpec]:
        if not isinstance(body, dict):
            raise Refusal(422, "body must be a JSON object")
        version = body.get("version")
        if not isinstance(version, str) or not version.strip() or len(version) > 200:
            raise Refusal(422, "'version' must be a non-empty string (at most 200 characters)")
        try:
            table = parse_table(body.get("table"))
            spec = GroupSpec.from_json({**body, "rank_offset": 1, "world_size": len(self.service.fleet) + 1,
                                        "group_name": "check"})  # fmt: skip
            bucket = body.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
            if not isinstance(bucket, int) or isinstance(bucket, bool) or not 1 <= bucket <= 1 << 34:
                raise BadUpdateRequest("'bucket_bytes' must be an integer in [1, 16 GiB]")
        except BadUpdateRequest as exc:
            raise Refusal(422, str(exc)) from None
        bound = self.service.settings.broadcast_max_pause_s
        if float(body.get("timeout_s", 0)) > bound:
            raise Refusal(422, f"'timeout_s' {body.get('timeout_s')} is above this daemon's bound on a session's "
                               f"pause ([rollout] broadcast_max_pause_s = {bound:g})")  # fmt: skip
        step = body.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise Refusal(422, "'step' must be an integer")
        return version.strip(), table_to_json(table), spec

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
            spec = {"master_address": body["master_address"], "master_port": body["master_port"], "rank_offset": i + 1,
                    "world_size": len(ses.handles) + 1, "backend": body.get("backend", "gloo"),
                    "group_name": group, "timeout_s": min(timeout_s, left)}  # fmt: skip
            try:
                assert isinstance(h.client, BuiltinWorkerClient)
                h.client._admin("/admin/init_weight_group", "init_weight_group", spec, timeout=timeout_s + 10)
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


def broadcast_router(service: RolloutService, state_dir: Path, guard: ControlGuard,
                     checks: CheckSettings | None = None) -> APIRouter:  # fmt: skip
    """The broadcast routes, behind the daemon's control token (mounted by one line in daemon.service)."""
    sessions = Broadcasts(service, state_dir, checks)
    router = APIRouter(prefix="/v1/broadcast", dependencies=[Depends(guard)])

    @router.post("")
    async def begin(request: Request) -> Response:
        try:  # a tensor table: larger than a control body, still capped in bytes and depth
            body = parse_object(await read_capped(request, MAX_TABLE_BODY_BYTES))
        except JsonBodyError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        try:
            return JSONResponse(await run_in_threadpool(sessions.begin, body), status_code=202)
        except Refusal as exc:
            return exc.response()

    @router.get("/{session}")
    async def result(session: str, wait_s: float = 0.0) -> Response:
        try:
            code, doc = await run_in_threadpool(sessions.result, session, wait_s)
        except Refusal as exc:
            return exc.response()
        return JSONResponse(doc, status_code=code)

    return router
