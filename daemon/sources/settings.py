"""The `[[sources]]` tables' dataclasses, one per source type (`type = "local"`, `"s3"`, `"push"`).

They live apart from the sources themselves so that reading a config (every CLI command, e.g.
`hotswap status`) imports no file watcher, scheduler, S3 client or web server: only the running
source needs those (daemon.sources.local, .s3, .push).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from daemon.common import is_loopback

COMMIT_SIGNALS = ("manifest", "index", "marker")  # the local source's commit signals (daemon.sources.commit)
GIB = 1024**3


@dataclass
class LocalSourceConfig:
    """`[[sources]]` with `type = "local"` (the default)."""

    path: str  # required: folder whose subdirectories are checkpoints
    type: Literal["local"] = "local"  # which kind of source this table is (daemon.sources.SOURCE_TYPES)
    name: str = ""  # label stored in checkpoints.source; "" = "local:<path>"
    commit_signals: list[str] = field(default_factory=lambda: list(COMMIT_SIGNALS))  # checked in this order
    quiet_period_s: float = 2.0  # index signal: shard sizes unchanged this long
    commit_timeout_s: float = 600.0  # a manifest listing missing/short files waits this long after the last change
    marker_names: list[str] = field(default_factory=lambda: ["_SUCCESS", "commit_success.txt", "COMMITTED"])  # "marker" signal: any of these files in the folder commits it
    rescan_interval_s: float = 10.0  # safety net for missed filesystem events
    create: bool = True  # create the folder if it does not exist
    # with create = false: a folder missing at start stops the daemon (exit 2) instead of being
    # waited for; either way a folder missing while the daemon runs makes /health answer 503
    required: bool = False

    def validate(self, key: str) -> None:
        if not self.path:
            raise ValueError(f"{key}.path: must not be empty")
        for s in self.commit_signals:
            if s not in COMMIT_SIGNALS:
                raise ValueError(f"{key}.commit_signals: {s!r} is not one of {', '.join(COMMIT_SIGNALS)}")
        if not self.commit_signals:
            raise ValueError(f"{key}.commit_signals: at least one signal is needed")
        if self.quiet_period_s < 0:
            raise ValueError(f"{key}.quiet_period_s: must be >= 0")
        if self.commit_timeout_s < 0:
            raise ValueError(f"{key}.commit_timeout_s: must be >= 0")
        if self.rescan_interval_s <= 0:
            raise ValueError(f"{key}.rescan_interval_s: must be > 0")
        if "marker" in self.commit_signals and not self.marker_names:
            raise ValueError(f"{key}.marker_names: the marker signal needs at least one name")

    @property
    def label(self) -> str:
        return self.name or f"{self.type}:{self.path}"

    def preflight_problem(self) -> str | None:
        """Why the daemon must not start (daemon.process.preflight), or None."""
        root = Path(self.path).expanduser().absolute()
        if self.required and not self.create and not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            return f"path: watched folder {root} {what} (create = false, required = true)"
        return None



@dataclass
class S3SourceConfig:
    """`[[sources]]` with `type = "s3"`."""

    bucket: str  # required
    type: Literal["s3"] = "s3"  # which kind of source this table is (daemon.sources.SOURCE_TYPES)
    prefix: str = ""  # checkpoints are <prefix><name>/...; a trailing "/" is added when missing
    name: str = ""  # label stored in checkpoints.source; "" = "s3://<bucket>/<prefix>"
    endpoint_url: str = ""  # any S3-compatible store (MinIO, Ceph, R2, moto); "" = AWS
    region: str = ""  # "" = from the credential chain's config
    profile: str = ""  # a shared-config profile; "" = the default chain
    poll_interval_s: float = 30.0  # how often the prefix is listed (the listing is the truth)
    sqs_queue_url: str = ""  # optional: S3 event notifications, used as hints only
    concurrency: int = 8  # parallel ranged GETs per fetch
    part_bytes: int = 64 * 1024 * 1024  # bytes per ranged GET
    cache_dir: str = "~/.cache/hotswap/s3"  # downloads go to <cache_dir>/<name>/
    cache_max_bytes: int = 0  # retention keeps the cache under this; 0 = no limit
    retry_after_s: float = 10.0  # store unreachable during a fetch: try again this much later
    max_attempts: int = 4  # botocore's retries per request (standard mode)
    connect_timeout_s: float = 10.0  # botocore connect timeout per request
    read_timeout_s: float = 60.0  # botocore read timeout per request

    def validate(self, key: str) -> None:
        if not self.bucket or "/" in self.bucket:
            raise ValueError(f"{key}.bucket: must be a bucket name (no '/'), got {self.bucket!r}")
        if self.prefix.startswith("/"):
            raise ValueError(f"{key}.prefix: must not start with '/'")
        for name in ("poll_interval_s", "retry_after_s", "connect_timeout_s", "read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{key}.{name}: must be > 0")
        if self.concurrency < 1 or self.max_attempts < 1:
            raise ValueError(f"{key}.concurrency and max_attempts: must be >= 1")
        if self.part_bytes < 1024 * 1024:
            raise ValueError(f"{key}.part_bytes: must be at least 1 MiB")
        if self.cache_max_bytes < 0:
            raise ValueError(f"{key}.cache_max_bytes: must be >= 0")

    @property
    def key_prefix(self) -> str:
        return self.prefix if not self.prefix or self.prefix.endswith("/") else self.prefix + "/"

    @property
    def label(self) -> str:
        return self.name or f"s3://{self.bucket}/{self.key_prefix}"



@dataclass
class PushSourceConfig:
    """`[[sources]]` with `type = "push"`."""

    path: str  # required: the registry folder; a committed push becomes <path>/<version>/
    token_file: str  # required: the bearer token clients send (one line; keep it 0600)
    type: Literal["push"] = "push"  # which kind of source this table is (daemon.sources.SOURCE_TYPES)
    name: str = ""  # label stored in checkpoints.source; "" = "push:<listen>"
    listen: str = "127.0.0.1:8781"  # host:port of the push listener ("0.0.0.0:8781" for other hosts)
    hmac_keys: dict[str, str] = field(default_factory=dict)  # key_id -> shared key file (as [checks])
    ed25519_keys: dict[str, str] = field(default_factory=dict)  # key_id -> public key file (as [checks])
    tls_cert_file: str = ""  # with tls_key_file: serve HTTPS
    tls_key_file: str = ""  # the private key of tls_cert_file
    tls_client_ca_file: str = ""  # clients must present a certificate signed by this CA (mTLS)
    max_checkpoint_bytes: int = 1024 * GIB  # a checkpoint larger than this is refused (413)
    max_concurrent_uploads: int = 8  # per client address
    rate_per_s: float = 50.0  # requests per second with the valid token, per credential and per client address
    burst: int = 100  # requests allowed at once above rate_per_s
    auth_failures_per_s: float = 1.0  # wrong or missing tokens per client address; never limits the valid token
    auth_failure_burst: int = 20  # wrong or missing tokens allowed at once above auth_failures_per_s (then 429)
    upload_timeout_s: float = 600.0  # an upload folder idle this long is removed
    max_bytes: int = 0  # retention: keep <path> under this many bytes; 0 = no limit
    allow_insecure_remote: bool = False  # plain HTTP on a non-loopback listen (the token in clear text)

    def validate(self, key: str) -> None:
        if not self.path:
            raise ValueError(f"{key}.path: must not be empty")
        if not self.token_file:
            raise ValueError(f"{key}.token_file: must name the file holding the bearer token")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"{key}.listen: {self.listen!r} is not host:port (e.g. 0.0.0.0:8781)")
        if not is_loopback(host) and not self.tls_cert_file and not self.allow_insecure_remote:
            raise ValueError(f"{key}.listen: {self.listen} is not loopback and there is no TLS: set tls_cert_file "
                             "and tls_key_file, or allow_insecure_remote = true to send the token in clear text")  # fmt: skip
        if not self.hmac_keys and not self.ed25519_keys:
            raise ValueError(f"{key}.hmac_keys: a push is accepted only with a signed manifest: configure a key")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError(f"{key}.tls_cert_file and tls_key_file: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError(f"{key}.tls_client_ca_file: client certificates need TLS (tls_cert_file)")
        if self.max_checkpoint_bytes <= 0 or self.max_concurrent_uploads < 1 or self.burst < 1:
            raise ValueError(f"{key}: max_checkpoint_bytes, max_concurrent_uploads and burst must be positive")
        if self.rate_per_s <= 0 or self.upload_timeout_s <= 0 or self.max_bytes < 0:
            raise ValueError(f"{key}: rate_per_s and upload_timeout_s must be > 0, max_bytes >= 0")
        if self.auth_failures_per_s <= 0 or self.auth_failure_burst < 1:
            raise ValueError(f"{key}: auth_failures_per_s must be > 0 and auth_failure_burst >= 1")

    @property
    def label(self) -> str:
        return self.name or f"push:{self.listen}"
