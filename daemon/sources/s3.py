"""`type = "s3"`: checkpoints under `s3://bucket/prefix/<name>/`, each with its hotswap-manifest.json.

A periodic listing (APScheduler, `poll_interval_s`) is the truth. With `sqs_queue_url`, S3 event
notifications read from that queue only trigger an immediate listing: events are at-least-once,
unordered and may lag, so nothing is decided from them.

A checkpoint is committed once its manifest object exists AND every object the manifest lists
exists with the listed size: uploaders put objects in any order (sync tools do not put the
manifest last), and multipart objects' ETags are not MD5s, so sizes from the listing decide and
the bytes are judged after download. A manifest that does not parse is handed on as well (its
parse error logged), so the fetch step rejects it with that error instead of the source waiting.

A checkpoint's version is its folder's name, and a manifest that names a version must name that
one: folders are listed in name order, so a folder `aaa/` whose manifest claimed `legit` would
otherwise be registered, and fetched into `cache_dir/legit/`, before the real `legit/`. A
mismatch, or a folder name that cannot be a label (daemon.formats.names), is refused: logged once
with both names, shown under `refused` in /status, never emitted, looked at again only when its
manifest object changes.

The fetch step downloads into `cache_dir/<version>/` (daemon.sources.s3fetch: parallel ranged GETs,
resumable, verified against the manifest and S3's FULL_OBJECT CRC32C, renamed into place only
where nothing complete is; never deleting another copy); the retention hook keeps that folder under
`cache_max_bytes`, never deleting a protected version.

Credentials come from boto3's standard chain (environment, shared config/`profile`, instance or
task role); none are stored here and none are logged.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import boto3
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import BaseScheduler
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from daemon.common import get_logger
from daemon.delta import DeltaError, fetched_files
from daemon.formats import MANIFEST_NAME
from daemon.manifest import version_problem
from daemon.sources.base import DiscoveredCheckpoint, Emit, FetchError, FetchItem, Progress, SourceType
from daemon.sources.cache import prune_cache
from daemon.sources.commit import natural
from daemon.sources.s3fetch import FetchStats, fetch_checkpoint, read_manifest
from daemon.sources.settings import S3SourceConfig

log = get_logger(__name__)
SQS_WAIT_S = 5  # long-poll length: also how long `stop` may wait for the hint thread


def make_client(config: S3SourceConfig, service: str = "s3") -> Any:
    """A boto3 client from the standard credential chain (thread-safe; shared by the range threads)."""
    session = boto3.session.Session(profile_name=config.profile or None, region_name=config.region or None)
    boto_config = BotoConfig(
        max_pool_connections=config.concurrency + 4,
        retries={"max_attempts": config.max_attempts, "mode": "standard"},
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
    )
    return session.client(service, endpoint_url=config.endpoint_url or None, config=boto_config)


class S3Source:
    """Lists one bucket prefix; emits each committed checkpoint once; fetches into its cache."""

    config_type: ClassVar[type[S3SourceConfig]] = S3SourceConfig

    def __init__(self, config: S3SourceConfig, emit: Emit, scheduler: BaseScheduler | None = None) -> None:
        self.config = config
        self.label = config.label
        self.emit = emit
        self.bucket = config.bucket
        self.prefix = config.key_prefix
        self.cache = Path(config.cache_dir).expanduser().absolute()
        self.client = make_client(config)
        self._scheduler = scheduler
        self._own_scheduler = scheduler is None
        self._job_id = f"s3-list:{self.label}"
        self._emitted: set[str] = set()
        self._waiting: dict[str, str] = {}  # name -> why not committed yet (logged when it changes)
        self._refused: dict[str, tuple[str, str]] = {}  # name -> (its manifest's ETag, why): logged once
        self._scan_lock = threading.Lock()
        self._stop = threading.Event()
        self._sqs_thread: threading.Thread | None = None
        self.last_fetch: dict[str, FetchStats] = {}  # version -> what the last fetch did (status, tests)
        self.errors_total = 0  # failed listings since start (hotswap_source_errors_total)
        self._failing: tuple[int, str] | None = None  # (failed listings in a row, the last error)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        if self._scheduler is None:
            self._scheduler = BackgroundScheduler(daemon=True)
        self._scheduler.add_job(self.scan, "interval", seconds=self.config.poll_interval_s, id=self._job_id,
                                max_instances=1, coalesce=True, replace_existing=True,
                                next_run_time=datetime.now(UTC))  # fmt: skip
        if self._own_scheduler:
            self._scheduler.start()
        if self.config.sqs_queue_url:
            self._sqs_thread = threading.Thread(target=self._hints, name="s3-hints", daemon=True)
            self._sqs_thread.start()
        log.info("source started", source=self.label, endpoint=self.config.endpoint_url or "aws",
                 poll_s=self.config.poll_interval_s, sqs=bool(self.config.sqs_queue_url))  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        if self._scheduler is not None:
            if self._own_scheduler and self._scheduler.running:
                self._scheduler.shutdown(wait=False)
            elif self._scheduler.get_job(self._job_id) is not None:
                self._scheduler.remove_job(self._job_id)
        if self._sqs_thread is not None:
            self._sqs_thread.join(timeout=SQS_WAIT_S + 5)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.label, "type": "s3", "bucket": self.bucket, "prefix": self.prefix,
                               "endpoint_url": self.config.endpoint_url or None,
                               "cache_dir": str(self.cache)}  # fmt: skip
        if self._refused:  # folders never emitted, with the reason (also logged once)
            out["refused"] = {name: why for name, (_etag, why) in sorted(dict(self._refused).items())}
        return out

    def health_problem(self) -> str | None:
        """Why this source cannot see new checkpoints now (the daemon's /health), or None."""
        if self._failing is None:
            return None
        n, error = self._failing
        return (f"listing s3://{self.bucket}/{self.prefix} failed {n} time{'s' if n > 1 else ''} in a row: "
                f"{error[:300]}")  # fmt: skip

    def list_now(self) -> None:
        """Run the listing as soon as possible (an SQS hint)."""
        if self._scheduler is not None and self._scheduler.get_job(self._job_id) is not None:
            self._scheduler.modify_job(self._job_id, next_run_time=datetime.now(UTC))

    # -- listing --------------------------------------------------------------------------

    def scan(self) -> list[DiscoveredCheckpoint]:
        """One listing: emit every checkpoint that became committed; return what was emitted."""
        with self._scan_lock:
            try:
                groups, committed_at = self._list()
            except (BotoCoreError, ClientError) as exc:
                self.errors_total += 1
                self._failing = ((self._failing[0] if self._failing else 0) + 1, " ".join(str(exc).split()))
                log.warning("listing the bucket failed", source=self.label, error=str(exc), in_a_row=self._failing[0])
                return []
            if self._failing is not None:
                log.info("listing the bucket works again", source=self.label, after_failures=self._failing[0])
                self._failing = None
            out: list[DiscoveredCheckpoint] = []
            for name in [n for n in self._refused if MANIFEST_NAME not in groups.get(n, {})]:
                del self._refused[name]  # its manifest is gone: a new one is judged afresh
            # oldest manifest first (then s2 before s10): the arrival order that orders versions without a step
            for name in sorted(groups, key=lambda n: (committed_at.get(n, 0.0), natural(n))):
                objects = groups[name]
                if name in self._emitted or MANIFEST_NAME not in objects:
                    continue
                if self._refused.get(name, ("", ""))[0] == objects[MANIFEST_NAME][1]:
                    continue  # refused, and its manifest has not changed since
                item = self._committed(name, objects)
                if item is None:
                    continue
                try:
                    self.emit(item)
                except Exception:  # not recorded (database down): the next listing tries again
                    log.exception("recording a discovered checkpoint failed", version=item.version)
                    continue
                self._emitted.add(name)
                self._waiting.pop(name, None)
                self._refused.pop(name, None)
                out.append(item)
            return out

    def _list(self) -> tuple[dict[str, dict[str, tuple[int, str]]], dict[str, float]]:
        """name -> {relative key: (size, ETag)} for every object under the prefix, and name ->
        when its manifest was written (LastModified, epoch seconds)."""
        groups: dict[str, dict[str, tuple[int, str]]] = {}
        committed_at: dict[str, float] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                name, _, rel = obj["Key"][len(self.prefix):].partition("/")
                if name and rel and not name.startswith("."):
                    groups.setdefault(name, {})[rel] = (int(obj["Size"]), str(obj.get("ETag", "")))
                    if rel == MANIFEST_NAME and isinstance(obj.get("LastModified"), datetime):
                        committed_at[name] = obj["LastModified"].timestamp()
        return groups, committed_at

    def _committed(self, name: str, objects: dict[str, tuple[int, str]]) -> DiscoveredCheckpoint | None:
        key = f"{self.prefix}{name}/{MANIFEST_NAME}"
        where = f"s3://{self.bucket}/{self.prefix}{name}/"
        why = version_problem(name)
        if why is not None:
            self._refuse(name, objects, f"{where}: the folder's name is no version label: {why}")
            return None
        try:
            _raw, manifest = read_manifest(self.client, self.bucket, key, self.config.retry_after_s)
        except FetchError as exc:
            if exc.retry_after_s is not None:
                return None  # the store is down: the next listing asks again
            log.warning("manifest does not parse; handing it on to be rejected", source=self.label,
                        name=name, error=exc.reason)  # fmt: skip
        else:
            if manifest.version is not None and manifest.version != name:
                self._refuse(name, objects, f"{where} holds a manifest for version {manifest.version!r}: "
                             f"a version is taken only from the folder of its name ({name!r})")  # fmt: skip
                return None
            try:
                files = fetched_files(manifest, where)
            except DeltaError:
                files = []  # a malformed delta section: handed on, and the fetch says why
            for f in files:
                have = objects.get(f.path)
                why = (f"{f.path} not uploaded yet" if have is None else
                       f"{f.path} has {have[0]} of {f.bytes} bytes" if have[0] != f.bytes else "")  # fmt: skip
                if why:
                    if self._waiting.get(name) != why:
                        self._waiting[name] = why
                        log.debug("not committed yet", source=self.label, name=name, reason=why)
                    return None
        return DiscoveredCheckpoint(source=self.label, directory=None, version=name, signal="manifest",
                                    uri=where, detected_at=datetime.now(UTC))  # fmt: skip

    def _refuse(self, name: str, objects: dict[str, tuple[int, str]], why: str) -> None:
        """Never emitted; logged once (again only when its manifest object changes)."""
        self._refused[name] = (objects[MANIFEST_NAME][1], why)
        self._waiting.pop(name, None)
        log.warning("checkpoint refused", source=self.label, folder=name, reason=why)

    def _hints(self) -> None:
        sqs = make_client(self.config, "sqs")
        url = self.config.sqs_queue_url
        while not self._stop.is_set():
            try:
                resp = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=SQS_WAIT_S)
                messages = resp.get("Messages", [])
                if messages:
                    sqs.delete_message_batch(QueueUrl=url, Entries=[
                        {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])  # fmt: skip
                    log.debug("S3 event hint; listing now", source=self.label, messages=len(messages))
                    self.list_now()
            except (BotoCoreError, ClientError) as exc:
                log.warning("reading S3 event hints failed", source=self.label, error=str(exc))
                self._stop.wait(min(self.config.poll_interval_s, 30.0))

    # -- fetch and retention -----------------------------------------------------------------

    def fetch(self, item: FetchItem, progress: Progress) -> Path:
        bucket, _, key_prefix = item.uri.removeprefix("s3://").partition("/")
        name = key_prefix.rstrip("/").rsplit("/", 1)[-1]
        if bucket != self.bucket or not key_prefix.startswith(self.prefix) or not name:
            raise FetchError(f"{item.uri}: not under this source's s3://{self.bucket}/{self.prefix}")
        # a version comes only from the folder of its name (see the module docstring), and lands in
        # the cache folder of its name: never into, or over, another version's
        if name != item.version or version_problem(name) is not None:
            raise FetchError(f"{item.uri}: version {item.version!r} is fetched only from a folder of that name, "
                             f"not from {name!r}")  # fmt: skip
        dest = self.cache / name
        stats = fetch_checkpoint(self.client, self.bucket, key_prefix, dest, progress,
                                 concurrency=self.config.concurrency, part_bytes=self.config.part_bytes,
                                 retry_after_s=self.config.retry_after_s, compacted=item.compacted)  # fmt: skip
        self.last_fetch[item.version] = stats
        log.info("downloaded", source=self.label, version=item.version, bytes=stats.downloaded_bytes,
                 reused=stats.reused_bytes, full_object_crcs=stats.full_object_crcs,
                 encoding="compacted" if item.compacted else stats.encoding)  # fmt: skip
        return dest

    def prune(self, protected: frozenset[Path]) -> list[Path]:
        return prune_cache(self.cache, self.config.cache_max_bytes, protected, label=self.label)


# What daemon.sources.SOURCE_TYPES["s3"] names; mypy checks it against the protocol.
_TYPE: SourceType = S3Source
