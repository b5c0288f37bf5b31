"""The push routes: a trainer uploads a checkpoint file by file, then commits it with its signed manifest.

    PUT    /v1/push/{version}/files/{path}?alg=blake3   one file, streamed to disk -> its digest
    POST   /v1/push/{version}/commit                    body: the signed hotswap-manifest.json
    DELETE /v1/push/{version}                           drop what was uploaded for it

Every route needs `Authorization: Bearer <token>` (401; requests with an `Origin` are 403), checked
before any limit (daemon.sources.push_gate). Names are checked before anything touches the
filesystem (daemon.formats.names): a bad version or path (NUL, a control character or newline in a
version, a component over 255 bytes, too deep, `..`, absolute, a file where a folder is) is 400
naming the problem. Each file is streamed into `<path>/.incoming/<version>/` (a `.part` file
renamed when complete), hashed
(CRC32C + the strong hash) as it arrives: never held whole in memory. The commit checks the
manifest's HMAC-SHA256 (or Ed25519) signature against the configured keys (403), then that every
listed file was uploaded and hashed to the listed bytes, CRC32C and strong hash (digests computed
here, from the bytes, never taken from the sender), and only then renames the folder to
`<path>/<version>/` and hands it to the pipeline.

Limits: a checkpoint over `max_checkpoint_bytes` is 413 (by Content-Length before any byte, else
as soon as the count passes it); per client (its address) more than `max_concurrent_uploads`
uploads at once is 429 with Retry-After, as are requests past the rate limits (push_gate). An
upload's slot is given back however the request ends (done, refused, failed, cut off). Committing
a version that exists with the same content digest answers 200 and registers nothing new (one
checkpoint); with other content 409. A client that disconnects mid-file leaves no `.part`; an
upload folder idle for `upload_timeout_s` is removed by the janitor (`PushState.sweep`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from anyio import to_thread
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from daemon.checks import SignatureError, verify_manifest_signature
from daemon.common import get_logger
from daemon.delta import DeltaError, shipped_files
from daemon.formats import MANIFEST_CAP_BYTES, MANIFEST_NAME
from daemon.hashing import HASH_ALGORITHMS, DigestMismatch, FileDigest, FileHasher
from daemon.manifest import ManifestError, check_relative_path, load_manifest, parse_manifest, version_problem
from daemon.sources.push_gate import Limits, PushGate, client_address

log = get_logger(__name__)
WRITE_BYTES = 4 * 1024 * 1024  # body bytes gathered before one write (+ hash) off the event loop
INCOMING = ".incoming"


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


class PushState:
    """Everything the routes share; thread-safe (handlers run on the event loop and in threads)."""

    def __init__(self, root: Path, limits: Limits, hmac_keys: dict[str, Path], ed25519_keys: dict[str, Path],
                 on_commit: Callable[[str, Path], None], gate: PushGate | None = None) -> None:  # fmt: skip
        self.root = root
        self.incoming = root / INCOMING
        self.limits = limits
        self.hmac_keys, self.ed25519_keys = hmac_keys, ed25519_keys
        self.on_commit = on_commit
        self.lock = threading.Lock()
        self.sessions: dict[str, _Session] = {}
        self.uploads: dict[str, int] = {}  # client -> uploads in flight
        self.gate = gate  # the routes' token check and rate limits (push_router sets it)

    def take_slot(self, client: str, session: _Session) -> bool:
        """One of the client's `max_concurrent_uploads`; False when all are in use."""
        with self.lock:
            if self.uploads.get(client, 0) >= self.limits.max_concurrent_uploads:
                return False
            self.uploads[client] = self.uploads.get(client, 0) + 1
            session.active += 1
            return True

    def give_slot(self, client: str, session: _Session) -> None:
        """Give back what `take_slot` took (called from a `finally` nothing can skip)."""
        with self.lock:
            left = self.uploads.get(client, 0) - 1
            if left > 0:
                self.uploads[client] = left
            else:
                self.uploads.pop(client, None)
            session.active = max(0, session.active - 1)
            session.touched = time.monotonic()

    def path_conflict(self, version: str, path: str) -> str | None:
        """A file uploaded where `path` needs a folder, or the other way round."""
        with self.lock:
            s = self.sessions.get(version)
            files = set(s.files) if s is not None else set()
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in files:
                return f"{path}: {'/'.join(parts[:i])} is an uploaded file, not a folder"
        if any(f.startswith(path + "/") for f in files):
            return f"{path}: is a folder of uploaded files, not a file"
        return None

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
        if self.gate is not None:
            self.gate.prune()
        return removed


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def _file_problem(state: PushState, version: str, path: str, alg: str) -> str | None:
    """Why this PUT's names cannot be used (400), checked before anything touches the filesystem."""
    problem = version_problem(version)
    if problem is not None:
        return problem
    try:
        check_relative_path(path)
    except ManifestError as exc:
        return str(exc)
    if path == MANIFEST_NAME or path.startswith(INCOMING):
        return f"{path}: the manifest comes with the commit, not as a file"
    if alg not in HASH_ALGORITHMS:
        return f"alg {alg!r} unknown; known: {list(HASH_ALGORITHMS)}"
    return state.path_conflict(version, path)


def push_router(state: PushState, token: str) -> APIRouter:
    if state.gate is None:
        state.gate = PushGate(token, state.limits)
    router = APIRouter(prefix="/v1/push", dependencies=[Depends(state.gate)])

    @router.put("/{version}/files/{path:path}")
    async def put_file(version: str, path: str, request: Request, alg: str = "blake3") -> JSONResponse:
        problem = _file_problem(state, version, path, alg)
        if problem:
            return _error(400, problem)
        client = client_address(request)
        session = state.session(version)
        limit = state.limits.max_checkpoint_bytes
        length = request.headers.get("content-length")
        already = session.bytes - (session.files[path].bytes if path in session.files else 0)
        if length is not None and length.isdigit() and limit and already + int(length) > limit:
            return _error(413, f"{version}: {already + int(length)} bytes would pass the {limit}-byte limit")
        if not state.take_slot(client, session):
            return _error(429, f"at most {state.limits.max_concurrent_uploads} uploads at once per client",
                          **{"Retry-After": "1"})  # fmt: skip
        try:
            return await _receive(state, session, version, path, alg, request, already)
        finally:
            state.give_slot(client, session)

    @router.post("/{version}/commit")
    async def commit(version: str, request: Request) -> JSONResponse:
        problem = version_problem(version)
        if problem:
            return _error(400, problem)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MANIFEST_CAP_BYTES:
                return _error(413, f"manifest over {MANIFEST_CAP_BYTES} bytes")
        return await to_thread.run_sync(_commit, state, version, bytes(raw), client_address(request))

    @router.delete("/{version}")
    def abort(version: str) -> JSONResponse:
        problem = version_problem(version)
        if problem:
            return _error(400, problem)
        with state.lock:
            s = state.sessions.get(version)
            if s is not None and s.active:
                return _error(409, f"{version}: {s.active} upload(s) in flight")
            state.sessions.pop(version, None)
        shutil.rmtree(state.incoming / version, ignore_errors=True)
        return JSONResponse({"version": version, "dropped": True})

    return router


async def _receive(state: PushState, session: _Session, version: str, path: str, alg: str, request: Request,
                   already: int) -> JSONResponse:  # fmt: skip
    """Stream one file into the session's folder, hashing it; the caller holds the upload slot."""
    limit = state.limits.max_checkpoint_bytes
    target = session.folder / path
    part = target.with_name(f".part-{secrets.token_hex(8)}")  # short: any valid name leaves room for it
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
        log.info("client went away mid-upload", version=version, path=path, client=client_address(request))
        return _error(400, "client disconnected")
    except OSError as exc:  # the names were checked: the disk (full, not writable) or a racing upload
        log.warning("writing an upload failed", version=version, path=path, error=str(exc))
        return _error(500, f"{path}: cannot be written here ({exc.strerror or exc})")
    finally:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError, ValueError):
            part.unlink()


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
        try:
            moved = shipped_files(manifest, f"{version}/{MANIFEST_NAME}")  # a delta: its (and its compacted) delta files
        except DeltaError as exc:
            return _error(400, str(exc))
        listed = {f.path for f in moved}
        for f in moved:
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
    log.info("push committed", version=version, client=client, files=len(moved),
             bytes=sum(f.bytes for f in moved), digest=manifest.digest)  # fmt: skip
    state.on_commit(version, final)
    return JSONResponse({"version": version, "digest": manifest.digest, "status": "committed"})


def clear_incoming(root: Path) -> None:
    """Start clean: upload folders of a previous run cannot be resumed (their digests were in memory)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(root / INCOMING)
    (root / INCOMING).mkdir(mode=0o700, parents=True, exist_ok=True)

