"""The push routes: a trainer uploads a checkpoint file by file, then commits it with its signed manifest.

    PUT    /v1/push/{version}/files/{path}?alg=blake3   one file, streamed to disk -> its digest
    POST   /v1/push/{version}/commit                    body: the signed hotswap-manifest.json
    DELETE /v1/push/{version}                           drop what was uploaded for it

Every route needs `Authorization: Bearer <token>` (401; requests with an `Origin` are 403). Each
file is streamed into `<path>/.incoming/<version>/` (a `.part` file renamed when complete), hashed
(CRC32C + the strong hash) as it arrives: never held whole in memory. The commit checks the
manifest's HMAC-SHA256 (or Ed25519) signature against the configured keys (403), then that every
listed file was uploaded and hashed to the listed bytes, CRC32C and strong hash (digests computed
here, from the bytes, never taken from the sender), and only then renames the folder to
`<path>/<version>/` and hands it to the pipeline.

Limits: a checkpoint over `max_checkpoint_bytes` is 413 (by Content-Length before any byte, else
as soon as the count passes it); per client (its address) more than `max_concurrent_uploads`
uploads at once or more requests than the token bucket allows is 429 with Retry-After. Committing
a version that exists with the same content digest answers 200 and registers nothing new (one
checkpoint); with other content 409. A client that disconnects mid-file leaves no `.part`; an
upload folder idle for `upload_timeout_s` is removed by the janitor (`PushState.sweep`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from anyio import to_thread
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from daemon.auth import ControlGuard
from daemon.checks.signatures import SignatureError, verify_manifest_signature
from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.formats.smallfile import MANIFEST_CAP_BYTES
from daemon.hashing import HASH_ALGORITHMS, DigestMismatch, FileDigest, FileHasher
from daemon.logging import get_logger
from daemon.manifest import ManifestError, check_relative_path, load_manifest, parse_manifest

log = get_logger(__name__)
WRITE_BYTES = 4 * 1024 * 1024  # body bytes gathered before one write (+ hash) off the event loop
INCOMING = ".incoming"


@dataclass
class Limits:
    max_checkpoint_bytes: int
    max_concurrent_uploads: int
    rate_per_s: float
    burst: int
    upload_timeout_s: float


@dataclass
class _Session:
    """One version being uploaded: its folder, the digests computed so far, the uploads in flight."""

    folder: Path
    files: dict[str, FileDigest] = field(default_factory=dict)
    active: int = 0
    touched: float = field(default_factory=time.monotonic)

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.files.values())


class _Bucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> float:
        """0 when a request may go, else seconds until one may."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate if self.rate > 0 else 3600.0


class PushState:
    """Everything the routes share; thread-safe (handlers run on the event loop and in threads)."""

    def __init__(self, root: Path, limits: Limits, hmac_keys: dict[str, Path], ed25519_keys: dict[str, Path],
                 on_commit: Callable[[str, Path], None]) -> None:  # fmt: skip
        self.root = root
        self.incoming = root / INCOMING
        self.limits = limits
        self.hmac_keys, self.ed25519_keys = hmac_keys, ed25519_keys
        self.on_commit = on_commit
        self.lock = threading.Lock()
        self.sessions: dict[str, _Session] = {}
        self.uploads: dict[str, int] = {}  # client -> uploads in flight
        self.buckets: dict[str, _Bucket] = {}

    def session(self, version: str) -> _Session:
        with self.lock:
            s = self.sessions.get(version)
            if s is None:
                s = self.sessions[version] = _Session(self.incoming / version)
            s.touched = time.monotonic()
            return s

    def sweep(self) -> list[Path]:
        """Remove upload folders idle longer than the timeout (a client that went away)."""
        now = time.monotonic()
        removed: list[Path] = []
        with self.lock:
            for version, s in list(self.sessions.items()):
                if s.active == 0 and now - s.touched > self.limits.upload_timeout_s:
                    del self.sessions[version]
                    shutil.rmtree(s.folder, ignore_errors=True)
                    removed.append(s.folder)
            known = {s.folder.name for s in self.sessions.values()}
        if self.incoming.is_dir():  # left by an earlier run of the daemon
            for child in self.incoming.iterdir():
                if child.name not in known:
                    shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
                    removed.append(child)
        if removed:
            log.info("removed abandoned uploads", folders=[str(p) for p in removed])
        return removed


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def _check_version(version: str) -> str | None:
    if not version or "/" in version or version.startswith(".") or len(version) > 200:
        return f"version {version!r} is not a usable label"
    return None


def push_router(state: PushState, token: str) -> APIRouter:
    guard = ControlGuard(token, allow_remote_host=True)

    def limited(request: Request) -> None:
        with state.lock:
            wait = state.buckets.setdefault(_client(request), _Bucket(state.limits.rate_per_s,
                                                                      state.limits.burst)).take()  # fmt: skip
        if wait > 0:
            raise HTTPException(429, "too many requests from this client", headers={"Retry-After": f"{wait:.0f}"})

    router = APIRouter(prefix="/v1/push", dependencies=[Depends(limited), Depends(guard)])

    @router.put("/{version}/files/{path:path}")
    async def put_file(version: str, path: str, request: Request, alg: str = "blake3") -> JSONResponse:
        problem = _check_version(version)
        try:
            check_relative_path(path)
        except ManifestError as exc:
            problem = problem or str(exc)
        if path == MANIFEST_NAME or path.startswith(INCOMING):
            problem = problem or f"{path}: the manifest comes with the commit, not as a file"
        if alg not in HASH_ALGORITHMS:
            problem = problem or f"alg {alg!r} unknown; known: {list(HASH_ALGORITHMS)}"
        if problem:
            return _error(400, problem)
        client = _client(request)
        session = state.session(version)
        limit = state.limits.max_checkpoint_bytes
        length = request.headers.get("content-length")
        already = session.bytes - (session.files[path].bytes if path in session.files else 0)
        if length is not None and length.isdigit() and limit and already + int(length) > limit:
            return _error(413, f"{version}: {already + int(length)} bytes would pass the {limit}-byte limit")
        with state.lock:
            if state.uploads.get(client, 0) >= state.limits.max_concurrent_uploads:
                return _error(429, f"at most {state.limits.max_concurrent_uploads} uploads at once per client",
                              **{"Retry-After": "1"})  # fmt: skip
            state.uploads[client] = state.uploads.get(client, 0) + 1
            session.active += 1
        target = session.folder / path
        part = target.with_name(f".{target.name}.part-{os.getpid()}-{threading.get_ident()}-{id(request)}")
        fd = -1
        try:
            await to_thread.run_sync(lambda: target.parent.mkdir(parents=True, exist_ok=True))
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            hasher = FileHasher(alg)
            buf = bytearray()

            def flush(data: bytes) -> None:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                hasher.update(data)

            async for chunk in request.stream():
                buf += chunk
                if limit and already + hasher.bytes_fed + len(buf) > limit:
                    return _error(413, f"{version}: passed the {limit}-byte limit")
                if len(buf) >= WRITE_BYTES:
                    data, buf = bytes(buf), bytearray()
                    await to_thread.run_sync(flush, data)
                    session.touched = time.monotonic()
            if buf:
                await to_thread.run_sync(flush, bytes(buf))
            os.close(fd)
            fd = -1
            os.replace(part, target)
            digest = hasher.result()
            with state.lock:
                session.files[path] = digest
                session.touched = time.monotonic()
            return JSONResponse({"path": path, "bytes": digest.bytes, "crc32c": digest.crc32c, alg: digest.hash})
        except ClientDisconnect:
            log.info("client went away mid-upload", version=version, path=path, client=client)
            return _error(400, "client disconnected")
        finally:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
            with state.lock:
                state.uploads[client] -= 1
                session.active -= 1
                session.touched = time.monotonic()

    @router.post("/{version}/commit")
    async def commit(version: str, request: Request) -> JSONResponse:
        problem = _check_version(version)
        if problem:
            return _error(400, problem)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MANIFEST_CAP_BYTES:
                return _error(413, f"manifest over {MANIFEST_CAP_BYTES} bytes")
        return await to_thread.run_sync(_commit, state, version, bytes(raw), _client(request))

    @router.delete("/{version}")
    def abort(version: str) -> JSONResponse:
        with state.lock:
            s = state.sessions.get(version)
            if s is not None and s.active:
                return _error(409, f"{version}: {s.active} upload(s) in flight")
            state.sessions.pop(version, None)
        if _check_version(version) is None:
            shutil.rmtree(state.incoming / version, ignore_errors=True)
        return JSONResponse({"version": version, "dropped": True})

    return router


def _commit(state: PushState, version: str, raw: bytes, client: str) -> JSONResponse:
    try:
        manifest = parse_manifest(raw, None, f"{version}/{MANIFEST_NAME}")
    except ManifestError as exc:
        return _error(400, str(exc))
    try:
        verify_manifest_signature(manifest, state.hmac_keys, state.ed25519_keys)
    except SignatureError as exc:
        return _error(403, str(exc))
    if manifest.version != version:
        return _error(400, f"the manifest's version {manifest.version!r} is not {version!r}")
    if manifest.weak or manifest.digest is None:
        return _error(400, f"{manifest.format}: push needs a format-2 manifest (strong per-file hashes)")
    limit = state.limits.max_checkpoint_bytes
    if limit and manifest.total_bytes > limit:
        return _error(413, f"{version}: {manifest.total_bytes} bytes, over the {limit}-byte limit")
    final = state.root / version
    with state.lock:
        session = state.sessions.get(version)
        if final.exists():
            try:
                existing = load_manifest(final).digest
            except ManifestError:
                existing = None
            if existing != manifest.digest:
                return _error(409, f"{version} exists with other content ({existing}); this is {manifest.digest}")
            if session is not None and session.active == 0:
                del state.sessions[version]
                shutil.rmtree(session.folder, ignore_errors=True)
            state.on_commit(version, final)  # a no-op when registered; registers it when an earlier try failed
            return JSONResponse({"version": version, "digest": manifest.digest, "status": "exists"})
        if session is None:
            return _error(400, f"{version}: nothing uploaded (or it timed out)")
        if session.active:
            return _error(409, f"{version}: {session.active} upload(s) still in flight")
        listed = {f.path for f in manifest.files}
        for f in manifest.files:
            got = session.files.get(f.path)
            if got is None:
                return _error(400, f"{f.path}: listed in the manifest but not uploaded")
            try:
                got.check(f, f.path)
            except DigestMismatch as exc:
                return _error(422, f"uploaded file does not match the manifest: {exc}")
        extra = sorted(set(session.files) - listed)
        if extra:
            return _error(400, f"{extra[0]}: uploaded but not listed in the manifest")
        (session.folder / MANIFEST_NAME).write_bytes(raw)
        os.replace(session.folder, final)
        del state.sessions[version]
    log.info("push committed", version=version, client=client, files=len(manifest.files),
             bytes=manifest.total_bytes, digest=manifest.digest)  # fmt: skip
    state.on_commit(version, final)
    return JSONResponse({"version": version, "digest": manifest.digest, "status": "committed"})


def clear_incoming(root: Path) -> None:
    """Start clean: upload folders of a previous run cannot be resumed (their digests were in memory)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(root / INCOMING)
    (root / INCOMING).mkdir(mode=0o700, parents=True, exist_ok=True)

