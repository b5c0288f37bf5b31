"""Downloading one checkpoint from S3 into a cache folder: parallel ranged GETs, resumable, verified.

    fetch_checkpoint(client, bucket, key_prefix, dest, ...) -> FetchStats

The manifest object is read first (bounded, strictly parsed). Every listed file is fetched as
`part_bytes` ranges by `concurrency` threads, each range streamed straight into its place in the
file (`pwrite`; never a whole object in memory) with `If-Match: <ETag>` so an object replaced
mid-download is noticed. Work in progress lives in `<cache>/.partial-<name>/`; each finished range
is appended to `<file>.hsparts`, so a download interrupted by a store outage resumes with the
ranges already on disk, and a verified file is listed in `.hotswap-done` and not fetched again.

A file counts only once its bytes hash to the manifest's CRC32C and strong hash, and, where S3
reports a FULL_OBJECT CRC32C for it, to that too. A resumed file that does not match is fetched
once more from scratch before the checkpoint is rejected (a crash may have lost written ranges);
a fresh one that does not match rejects it with the file named. Only then is the manifest
written and the folder renamed to `<cache>/<name>`.

`<cache>/<name>` is the cache folder of the version `name` (the manifest must name no other). A
fetch never deletes a complete copy there: the same manifest is reused as it is, another one
(other content under the same label) refuses the fetch and stays. Only a folder without a manifest
(this version's incomplete remnant: the manifest is written last) is replaced, and only after the
new download is complete: it is moved aside, the download renamed into place, then it is removed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import secrets
import shutil
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from daemon.bytepipe import hash_files
from daemon.common import get_logger
from daemon.delta import DeltaError, fetched_files, is_delta
from daemon.formats import MANIFEST_CAP_BYTES, MANIFEST_NAME
from daemon.hashing import DigestMismatch
from daemon.manifest import Manifest, ManifestError, ManifestFile, parse_manifest
from daemon.sources.base import FetchError, Progress

log = get_logger(__name__)

STREAM_CHUNK = 1024 * 1024  # bytes read from a response body per write
DONE_FILE = ".hotswap-done"
STATE_FILE = ".hotswap-fetch"  # the manifest's digest the partial folder belongs to
PARTS_SUFFIX = ".hsparts"
_RETRYABLE_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500",
                    "ExpiredToken", "AccessDenied", "403", "PreconditionFailed", "412"}  # fmt: skip


@dataclass
class FetchStats:
    files: int = 0
    total_bytes: int = 0
    downloaded_bytes: int = 0  # fetched from the store in this call
    reused_bytes: int = 0  # already on disk from an interrupted earlier call
    full_object_crcs: int = 0  # files whose S3 FULL_OBJECT CRC32C was compared
    encoding: str = "full"  # "delta": the files are a delta checkpoint's, rebuilt on this host from its base


class _Stopped(Exception):
    pass


def store_error(what: str, exc: Exception, retry_after_s: float) -> FetchError:
    """A FetchError for a failed S3 call: passing causes (network, 5xx, throttling) are retried."""
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in ("NoSuchKey", "404", "NoSuchBucket"):
            return FetchError(f"{what}: not in the store any more ({code})")
        retry = code in _RETRYABLE_CODES or status.startswith("5")
        return FetchError(f"{what}: S3 said {code or status}", retry_after_s=retry_after_s if retry else None)
    return FetchError(f"{what}: store unreachable ({type(exc).__name__}: {exc})", retry_after_s=retry_after_s)


def read_manifest(client: Any, bucket: str, key: str, retry_after_s: float) -> tuple[bytes, Manifest]:
    where = f"s3://{bucket}/{key}"
    try:
        head = client.head_object(Bucket=bucket, Key=key)
        if head["ContentLength"] > MANIFEST_CAP_BYTES:
            raise FetchError(f"{where}: {head['ContentLength']} bytes, over the {MANIFEST_CAP_BYTES}-byte cap")
        raw = client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{MANIFEST_CAP_BYTES - 1}")["Body"].read()
    except (BotoCoreError, ClientError) as exc:
        raise store_error(where, exc, retry_after_s) from None
    try:
        return raw, parse_manifest(raw, None, where)
    except ManifestError as exc:
        raise FetchError(str(exc)) from None


class _Ticker:
    """Byte counter shared by the range threads; feeds `progress` and, on a TTY, a rich bar."""

    def __init__(self, progress: Progress, total: int, label: str, done: int) -> None:
        self.progress = progress
        self.total = total
        self.done = done
        self.lock = threading.Lock()
        self._bar: Any = None
        if sys.stderr.isatty():
            from rich.progress import DownloadColumn, Progress as Bar, TransferSpeedColumn  # noqa: I001

            self._bar = Bar(*Bar.get_default_columns(), DownloadColumn(), TransferSpeedColumn(), transient=True)
            self._task = self._bar.add_task(label, total=total, completed=done)
            self._bar.start()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            done = self.done
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
        self.progress(done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _full_object_crc(head: dict[str, Any]) -> str | None:
    """S3's CRC32C of the whole object as 8 hex digits, when it is a FULL_OBJECT checksum."""
    value = head.get("ChecksumCRC32C")
    if not value or "-" in value or head.get("ChecksumType") == "COMPOSITE":
        return None  # composite (per-part) checksums cannot be compared with a whole-file CRC
    try:
        return base64.b64decode(value).hex()
    except ValueError:
        return None


@dataclass
class _File:
    entry: ManifestFile
    path: Path
    key: str
    etag: str
    s3_crc: str | None
    parts: list[tuple[int, int]]  # (index, first byte) still to fetch
    reused: int


def fetch_checkpoint(
    client: Any,
    bucket: str,
    key_prefix: str,  # "<prefix><name>/"
    dest: Path,
    progress: Progress,
    *,
    concurrency: int = 8,
    part_bytes: int = 64 * 1024 * 1024,
    retry_after_s: float = 10.0,
    hash_threads: int | None = None,
    compacted: bool = False,
) -> FetchStats:
    """Download and verify one checkpoint into `dest` (see the module docstring)."""
    raw, manifest = read_manifest(client, bucket, key_prefix + MANIFEST_NAME, retry_after_s)
    if manifest.version is not None and manifest.version != dest.name:
        raise FetchError(f"s3://{bucket}/{key_prefix}: its manifest is for version {manifest.version!r}, "
                         f"not {dest.name!r}: not fetched into {dest}")  # fmt: skip
    try:
        entries = fetched_files(manifest, f"s3://{bucket}/{key_prefix}{MANIFEST_NAME}", compacted)  # a delta: its delta files
    except DeltaError as exc:
        raise FetchError(str(exc)) from None
    total = sum(e.bytes for e in entries)
    encoding = "delta" if is_delta(manifest) else "full"
    if _occupied(dest, raw, manifest, entries):
        return FetchStats(len(entries), total, 0, total, encoding=encoding)
    partial = dest.with_name(f".partial-{dest.name}")
    identity = hashlib.sha256(raw).hexdigest() + "\n"
    state = partial / STATE_FILE
    if partial.is_dir() and (not state.is_file() or state.read_text() != identity):
        shutil.rmtree(partial)  # this version's download of another manifest (its content changed)
    partial.mkdir(parents=True, exist_ok=True)
    state.write_text(identity)
    stats = FetchStats(files=len(entries), total_bytes=total, encoding=encoding)
    for attempt in range(2):
        bad = _fetch_files(client, bucket, key_prefix, partial, manifest, entries, progress, stats,
                           concurrency, part_bytes, retry_after_s, hash_threads, fresh=attempt > 0)  # fmt: skip
        if not bad:
            break
        if attempt == 1 or not bad[1]:
            raise FetchError(bad[0])
        log.warning("a resumed file did not verify; fetching it again from scratch", reason=bad[0])
    (partial / MANIFEST_NAME).write_bytes(raw)
    (partial / DONE_FILE).unlink(missing_ok=True)
    state.unlink(missing_ok=True)
    if _occupied(dest, raw, manifest, entries):  # asked again: another fetch of the same manifest finished first
        shutil.rmtree(partial, ignore_errors=True)
        return stats
    _install(partial, dest)
    return stats


def _occupied(dest: Path, raw: bytes, manifest: Manifest, entries: list[ManifestFile]) -> bool:
    """True when `dest` already holds this manifest's download of `entries`; False when it may be made
    (absent, a remnant without a manifest, or the same manifest with other files: a delta's own files
    where its compacted ones are wanted, or the other way round); FetchError when it holds anything
    else, which stays."""
    if not os.path.lexists(dest):
        return False
    if dest.is_symlink() or not dest.is_dir():
        raise FetchError(f"{dest}: is not a folder of the cache; not replaced")
    try:
        held = (dest / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        return False  # the manifest is written last: an incomplete copy of this version
    except OSError as exc:
        raise FetchError(f"{dest}: cannot be read ({exc.strerror}); not replaced") from None
    if held == raw:
        return all((dest / e.path).is_file() and (dest / e.path).stat().st_size == e.bytes for e in entries)
    try:
        other = parse_manifest(held, None, str(dest / MANIFEST_NAME)).digest
    except ManifestError:
        other = "unreadable"
    raise FetchError(f"{dest}: the cache holds another copy of {dest.name} ({other}); the store's is "
                     f"{manifest.digest}: not replaced (a version's content does not change; remove it to "
                     "fetch this one)")  # fmt: skip


def _install(partial: Path, dest: Path) -> None:
    """Rename the finished download into place; a remnant there is moved aside first, then removed."""
    aside = None
    if os.path.lexists(dest):
        aside = dest.with_name(f".replaced-{dest.name}-{secrets.token_hex(4)}")
        os.rename(dest, aside)
    try:
        os.rename(partial, dest)
    except OSError as exc:
        if aside is not None:
            with contextlib.suppress(OSError):
                os.rename(aside, dest)
        raise FetchError(f"{dest}: cannot be put in place ({exc.strerror}); the download stays in {partial}") from None
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _done_set(partial: Path) -> set[str]:
    try:
        return set((partial / DONE_FILE).read_text().splitlines())
    except FileNotFoundError:
        return set()


def _fetch_files(
    client: Any,
    bucket: str,
    key_prefix: str,
    partial: Path,
    manifest: Manifest,
    entries: list[ManifestFile],
    progress: Progress,
    stats: FetchStats,
    concurrency: int,
    part_bytes: int,
    retry_after_s: float,
    hash_threads: int | None,
    *,
    fresh: bool,
) -> tuple[str, bool] | None:
    """Fetch and verify every file not done yet; (reason, was resumed) for the first that fails."""
    done = set() if fresh else _done_set(partial)
    if fresh:
        (partial / DONE_FILE).unlink(missing_ok=True)
    todo: list[_File] = []
    reused = 0
    for entry in entries:
        path = partial / entry.path
        if entry.path in done and path.is_file() and path.stat().st_size == entry.bytes:
            reused += entry.bytes
            continue
        key = key_prefix + entry.path
        try:
            head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        except (BotoCoreError, ClientError) as exc:
            raise store_error(entry.path, exc, retry_after_s) from None
        if head["ContentLength"] != entry.bytes:
            return f"{entry.path}: the store holds {head['ContentLength']} bytes, the manifest lists {entry.bytes}", False
        etag = str(head.get("ETag", ""))
        todo.append(_plan(entry, path, key, etag, _full_object_crc(head), part_bytes, fresh))
        reused += todo[-1].reused
    stats.reused_bytes = reused
    ticker = _Ticker(progress, stats.total_bytes, manifest.version or partial.name, reused)
    stop = threading.Event()
    try:
        with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="s3-range") as pool:
            futures: dict[str, list[Future[int]]] = {}
            for f in todo:
                futures[f.entry.path] = [
                    pool.submit(_fetch_range, client, bucket, f, index, first, part_bytes, ticker, stop, retry_after_s)
                    for index, first in f.parts
                ]
            try:
                for f in todo:
                    for fut in futures[f.entry.path]:
                        stats.downloaded_bytes += fut.result()
                    reason = _verify_file(f, manifest, stats, hash_threads)
                    if reason is not None:
                        f.path.unlink(missing_ok=True)
                        f.path.with_name(f.path.name + PARTS_SUFFIX).unlink(missing_ok=True)
                        return reason, f.reused > 0
                    with open(partial / DONE_FILE, "a") as out:
                        out.write(f.entry.path + "\n")
                    f.path.with_name(f.path.name + PARTS_SUFFIX).unlink(missing_ok=True)
            finally:  # done, failed or a file did not verify: nothing more is fetched
                stop.set()
                for fl in futures.values():
                    for fut in fl:
                        fut.cancel()
    finally:
        ticker.close()
    return None


def _plan(entry: ManifestFile, path: Path, key: str, etag: str, s3_crc: str | None, part_bytes: int,
          fresh: bool) -> _File:  # fmt: skip
    """Which ranges of this file are still to fetch; the sparse file is created at its full size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    parts_file = path.with_name(path.name + PARTS_SUFFIX)
    have: set[int] = set()
    if not fresh and path.is_file() and parts_file.is_file():
        lines = parts_file.read_text().splitlines()
        if lines and lines[0] == etag:  # same object as before the interruption
            have = {int(x) for x in lines[1:] if x.isdigit()}
    if not have:
        parts_file.write_text(etag + "\n")
        with open(path, "wb") as out:
            out.truncate(entry.bytes)
    n = -(-entry.bytes // part_bytes)
    parts = [(i, i * part_bytes) for i in range(n) if i not in have]
    reused = sum(min(part_bytes, entry.bytes - i * part_bytes) for i in have if i < n)
    return _File(entry, path, key, etag, s3_crc, parts, reused)


def _fetch_range(client: Any, bucket: str, f: _File, index: int, first: int, part_bytes: int,
                 ticker: _Ticker, stop: threading.Event, retry_after_s: float) -> int:  # fmt: skip
    if stop.is_set():
        raise _Stopped
    last = min(first + part_bytes, f.entry.bytes) - 1
    got = 0
    try:
        resp = client.get_object(Bucket=bucket, Key=f.key, Range=f"bytes={first}-{last}", IfMatch=f.etag)
        fd = os.open(f.path, os.O_WRONLY)
        try:
            for chunk in resp["Body"].iter_chunks(STREAM_CHUNK):
                if stop.is_set():
                    raise _Stopped
                if got + len(chunk) > last - first + 1:
                    raise FetchError(f"{f.entry.path}: the store sent more bytes than the range asked for")
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(fd, view, first + got)
                    view = view[n:]
                    got += n
                ticker.add(len(chunk))
        finally:
            os.close(fd)
    except (BotoCoreError, ClientError, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, ConnectionError):
            raise FetchError(f"{f.entry.path}: cannot write the cache ({exc})") from None
        raise store_error(f.entry.path, exc, retry_after_s) from None
    if got != last - first + 1:
        raise FetchError(f"{f.entry.path}: range {first}-{last} cut short at {got} bytes",
                         retry_after_s=retry_after_s)  # fmt: skip
    with open(f.path.with_name(f.path.name + PARTS_SUFFIX), "a") as out:
        out.write(f"{index}\n")
    return got


def _verify_file(f: _File, manifest: Manifest, stats: FetchStats, hash_threads: int | None) -> str | None:
    """None when the file's bytes match the manifest (and S3's FULL_OBJECT CRC32C); else the reason."""
    digest = hash_files([f.path], alg=manifest.hash_alg, threads=hash_threads)[0]
    try:
        digest.check(f.entry, f.entry.path)
    except DigestMismatch as exc:
        return f"downloaded file does not match the manifest: {exc}"
    if f.s3_crc is not None:
        stats.full_object_crcs += 1
        if f.s3_crc != digest.crc32c:
            return f"{f.entry.path}: crc32c {digest.crc32c} does not match S3's FULL_OBJECT checksum {f.s3_crc}"
    return None

