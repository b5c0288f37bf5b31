"""Types shared by every check: settings, one check's result, the whole report, the context."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from daemon.formats import HEADER_CAP_BYTES, SafetensorsHeader, TensorLocation
from daemon.hashing import DEFAULT_HASH_ALG, HASH_ALGORITHMS, FileDigest
from daemon.manifest import Manifest, ManifestFile


class Staged(Protocol):
    """A checkpoint's bytes staged by the crc32c pass (daemon.bytepipe.staged.StagedCopy), read by
    finite and forward; declared here, where its readers are, so the pipeline imports no check."""

    device: str

    @property
    def nbytes(self) -> int: ...

    @property
    def shareable(self) -> bool: ...  # the check process can open it without a copy (isolation)

    @property
    def owned_elsewhere(self) -> bool: ...  # another process (the loader) frees the bytes

    def release(self) -> None: ...


class VerifyStager(Protocol):
    """Where the crc32c pass stages the weight files instead of this process (the ipc loader:
    daemon.transport.ipc_verify.LoaderStager, which matches it without importing it); run_checks
    calls `finish` once the checks are over.

    `holds_bytes`: True when `stage` copies the bytes (the loader), which `checks.stage_device =
    "off"` turns down; False when it only hears that the read began (the disk workers' read
    ahead, daemon.transport.disk.ReadAheadAsk), which holds with any stage_device."""

    holds_bytes: bool

    def stage(self, root: Path, rels: list[str], alg: str,
              on_mapped: Callable[[Any], None] | None = None) -> tuple[list[FileDigest], Staged] | None: ...  # fmt: skip

    def finish(self, ok: bool, files: list[ManifestFile], digest: str | None) -> None: ...


# cheap to dear, the order they run in (docs/concepts/pipeline.md "Checks")
CHECK_NAMES: tuple[str, ...] = ("manifest", "headers", "crc32c", "compat", "finite", "headroom", "forward")

# A check that needs another's result. "crc32c" (which also computes the strong hashes)
# compares against the file list and hashes the "manifest" check reads; without it there
# is nothing to compare with. compat/finite/headroom/forward parse the headers themselves
# (daemon.checks.headers.load_table), so they run that dependency rather than need it.
REQUIRES: dict[str, tuple[str, ...]] = {"crc32c": ("manifest",)}

# fixed token ids used when the checkpoint has no tokenizer; small ids fit any vocabulary >= 64
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 17, 42, 5, 33, 8, 21, 60),
    (1, 3, 3, 3, 9, 27, 11, 2, 44, 19, 7, 50),
    (1, 63, 0, 31, 12),
)
# fixed text prompts, run through the checkpoint's tokenizer when it ships one
DEFAULT_TEXTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
)


ENGINE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(slots=True)
class CheckSettings:
    """What the verify stage runs and with which bounds. Every field has a working default."""

    enabled: tuple[str, ...] = CHECK_NAMES  # checks to run, cheap to dear; crc32c needs manifest, and with keys both must be on
    require_manifest: bool = False  # reject index/marker-committed checkpoints (no manifest)
    hmac_keys: dict[str, Path] = field(default_factory=dict)  # key_id -> shared key file
    ed25519_keys: dict[str, Path] = field(default_factory=dict)  # key_id -> public key file (PEM or raw)
    # accept a format-1 manifest (CRC32C only: its signature does not cover the weights) with keys set
    allow_format1_manifest: bool = False
    hash_alg: str = DEFAULT_HASH_ALG  # strong hash for checkpoints without a format-2 manifest
    header_cap_bytes: int = HEADER_CAP_BYTES  # safetensors JSON header limit (100 MiB, as safetensors itself)
    crc_threads: int | None = None  # hashing (CRC32C + strong hash) threads; None: one per CPU core
    crc_chunk_bytes: int = 8 * 1024 * 1024  # read size of the hashing pass
    reference_dir: Path | None = None  # compat/forward reference when the caller passes none
    finite_chunk_bytes: int = 16 * 1024 * 1024  # read size of the finite-values check
    headroom_factor: float = 1.5  # host RAM available must be >= this x the staging bytes
    deferred_retry_s: float = 30.0  # how often the daemon re-tests `deferred` checkpoints' headroom
    ipc_enabled: bool = False  # also require GPU memory for staging
    staging_gpu: str = "cuda:0"  # GPU whose memory the headroom check counts when staging (ipc)
    forward_device: str = "cpu"  # device for the forward-pass check
    # headers, compat and forward (cost set by the checkpoint) run in a child process, killed past this
    # limit (daemon.checks.isolation)
    check_time_limit_s: float = 600.0
    isolate_checks: bool = True  # false: run them here, unbounded; the canary then reuses the crc32c pass's copy
    # stage while verifying (daemon.bytepipe.staged): the crc32c pass also copies every file to this
    # device and finite/forward run on that copy. "auto": forward_device; "off": read files per check
    stage_device: str = "auto"
    forward_prompts: tuple[tuple[int, ...], ...] = DEFAULT_PROMPTS  # token ids, when there is no tokenizer
    forward_top1_min: float | None = None  # e.g. 0.9: share of positions whose argmax matches the reference
    forward_kl_max: float | None = None  # mean KL(reference || new) per position, nats
    # LoRA adapters: the forward canary of base + adapter must stay this close to the base alone
    adapter_kl_max: float | None = 5.0  # mean KL(base || base with the adapter) per position, nats (a large value: no bound)
    adapter_top1_min: float | None = None  # e.g. 0.5: share of positions whose argmax the adapter leaves unchanged
    # when the serving base changes, each served adapter not verified on the new base is either
    # checked again on it ("reverify": compat + forward, kept only if they pass) or "unload"ed at once
    adapter_on_base_change: str = "reverify"
    # largest LoRA scale (lora_alpha / r, or / sqrt(r) with rslora) compat accepts: 1e30 passed every check
    adapter_scale_max: float = 64.0
    # largest merged delta the adapter forward check accepts, per module: |scale * B @ A| over |W|
    # (Frobenius); fine-tunes stay well under 1, a large value to bound only the absurd by default
    adapter_delta_max: float = 10.0
    # the dtype the engines compute in, which the forward canary runs in: "auto" = the checkpoint's
    # config.json dtype (the reference worker's); float16 / bfloat16 catch what overflows only there
    engine_dtype: str = "auto"
    # a checkpoint whose tensor shapes differ from the serving version (e.g. a resized vocabulary)
    # passes compat as "needs a restart rollout"; false rejects it. Set from [rollout] restart_rollouts.
    restart_rollouts: bool = True
    # a checkpoint without the tokenizer files the serving version has (a worker launched on its
    # folder refuses text prompts: 400 no_tokenizer): false passes compat with a warning, true rejects it
    keep_tokenizer: bool = False

    def __post_init__(self) -> None:
        unknown = [n for n in self.enabled if n not in CHECK_NAMES]
        if unknown:
            raise ValueError(f"checks.enabled: unknown check names {unknown}; known: {list(CHECK_NAMES)}")
        if self.deferred_retry_s <= 0:
            raise ValueError(f"checks.deferred_retry_s must be > 0, got {self.deferred_retry_s}")
        if not 0 < self.check_time_limit_s < float("inf"):
            raise ValueError(f"checks.check_time_limit_s must be a positive number of seconds, got {self.check_time_limit_s}")
        if self.headroom_factor <= 0:
            raise ValueError(f"checks.headroom_factor must be > 0, got {self.headroom_factor}")
        if self.crc_chunk_bytes < 4096 or self.finite_chunk_bytes < 4096:
            raise ValueError("checks.crc_chunk_bytes and checks.finite_chunk_bytes must be >= 4096")
        if self.forward_top1_min is not None and not 0.0 <= self.forward_top1_min <= 1.0:
            raise ValueError(f"checks.forward_top1_min must be in [0, 1], got {self.forward_top1_min}")
        if self.forward_kl_max is not None and self.forward_kl_max < 0:
            raise ValueError(f"checks.forward_kl_max must be >= 0, got {self.forward_kl_max}")
        if self.adapter_kl_max is not None and self.adapter_kl_max < 0:
            raise ValueError(f"checks.adapter_kl_max must be >= 0, got {self.adapter_kl_max}")
        if not 0.0 < self.adapter_scale_max < float("inf"):
            raise ValueError(f"checks.adapter_scale_max must be a positive number, got {self.adapter_scale_max}")
        if not 0.0 < self.adapter_delta_max < float("inf"):
            raise ValueError(f"checks.adapter_delta_max must be a positive number, got {self.adapter_delta_max}")
        if self.engine_dtype not in ENGINE_DTYPES:
            raise ValueError(f"checks.engine_dtype must be one of {', '.join(ENGINE_DTYPES)}, got {self.engine_dtype!r}")
        if self.adapter_top1_min is not None and not 0.0 <= self.adapter_top1_min <= 1.0:
            raise ValueError(f"checks.adapter_top1_min must be in [0, 1], got {self.adapter_top1_min}")
        if self.adapter_on_base_change not in ("reverify", "unload"):
            raise ValueError(f"checks.adapter_on_base_change must be reverify or unload, got {self.adapter_on_base_change!r}")
        if not self.forward_prompts or any(not p for p in self.forward_prompts):
            raise ValueError("checks.forward_prompts must be a non-empty list of non-empty token id lists")
        if not re.fullmatch(r"auto|off|cpu|cuda(:\d+)?", self.stage_device):
            raise ValueError(f"checks.stage_device must be auto, off, cpu, cuda or cuda:N, got {self.stage_device!r}")
        if self.hash_alg not in HASH_ALGORITHMS:
            raise ValueError(f"checks.hash_alg: {self.hash_alg!r} is not one of {list(HASH_ALGORITHMS)}")
        problem = dependency_problem(self.enabled, self.keys_configured, self.require_manifest)
        if problem:
            raise ValueError(problem)

    @property
    def staging_device(self) -> str | None:
        """Where the crc32c pass stages the bytes for finite/forward, None when nothing would use it."""
        if self.stage_device == "off" or not ({"finite", "forward"} & set(self.enabled)):
            return None
        return self.forward_device if self.stage_device == "auto" else self.stage_device

    @property
    def canary_dtype(self) -> str | None:
        """The forward canary's dtype when it is not the checkpoint's own (engine_dtype "auto")."""
        return None if self.engine_dtype == "auto" else self.engine_dtype

    @property
    def keys_configured(self) -> bool:
        return bool(self.hmac_keys or self.ed25519_keys)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "checks") -> CheckSettings:
        """Build from a config table (e.g. TOML `[checks]`); errors name the key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
        kw: dict[str, Any] = {}
        for key, value in raw.items():
            if key in ("hmac_keys", "ed25519_keys"):
                if not isinstance(value, Mapping):
                    raise ValueError(f"{where}.{key}: must map key_id to a key file path")
                kw[key] = {str(k): Path(v) for k, v in value.items()}
            elif key == "enabled":
                kw[key] = tuple(str(v) for v in value)
            elif key == "reference_dir":
                kw[key] = None if value in (None, "") else Path(value)
            elif key == "forward_prompts":
                kw[key] = tuple(tuple(int(t) for t in p) for p in value)
            else:
                kw[key] = value
        try:
            return cls(**kw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None


def dependency_problem(enabled: tuple[str, ...], keys_configured: bool, require_manifest: bool) -> str | None:
    """One line naming `checks.enabled` when the enabled set leaves a needed check out, else None."""
    for name in enabled:
        for needed in REQUIRES.get(name, ()):
            if needed not in enabled:
                return (
                    f"checks.enabled: {name!r} needs {needed!r} (the file list and hashes it compares "
                    f"against); enable {needed!r} or drop {name!r}"
                )
    if (keys_configured or require_manifest) and "manifest" not in enabled:
        why = "signature keys are configured" if keys_configured else "checks.require_manifest is on"
        return f"checks.enabled: {why} but 'manifest' is not enabled, so nothing would read or verify it"
    if keys_configured and "crc32c" not in enabled:
        return (
            "checks.enabled: signature keys are configured but 'crc32c' is not enabled: the signed "
            "hashes would never be compared with the bytes"
        )
    return None


CHECK_STATUSES = ("pass", "fail", "deferred", "skipped")


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    ok: bool  # did not reject (a skipped check is ok but did not pass: see `status`)
    detail: dict[str, Any]  # detail["reason"]: one human line when not ok; detail["skipped"] when skipped
    started_at: datetime
    duration_ms: float
    deferred: bool = False  # not ok, but retry later (headroom) instead of rejecting
    skipped: bool = False  # the check did not run (e.g. compat with no serving version)

    @property
    def status(self) -> str:
        """pass | fail | deferred | skipped: what a person reads; never "pass" for what did not run."""
        if self.skipped:
            return "skipped"
        if self.ok:
            return "pass"
        return "deferred" if self.deferred else "fail"


class CheckSkipped(Exception):
    """Raised inside a check that cannot run here (nothing to compare with); `reason` says why."""

    def __init__(self, reason: str, detail: dict[str, Any] | None = None):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or {}


@dataclass(frozen=True, slots=True)
class VerifyReport:
    ok: bool
    deferred: bool
    results: list[CheckResult]
    reason: str | None  # "<check>: <reason>" of the first failure
    digest: str | None  # content digest `<alg>:<hex>` computed from the bytes; None when not hashed
    total_bytes: int
    tensor_count: int
    # every file with size, and crc32c / hash / hash_alg as computed from its bytes by the crc32c
    # check ("" / None when that check did not run): the reference later transports compare with
    files: list[ManifestFile] = field(default_factory=list)
    manifest: Manifest | None = None


class CheckFailed(Exception):
    """Raised inside a check: `reason` is the one line a person reads; `detail` adds facts."""

    def __init__(self, reason: str, detail: dict[str, Any] | None = None, *, deferred: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or {}
        self.deferred = deferred


def memory_short(exc: BaseException) -> bool:
    """The host or a device ran out of memory (torch's OutOfMemoryError, CUDA's "out of memory",
    Python's MemoryError): the host's state, not the version's fault."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc)


def deferred_for_memory(name: str, exc: BaseException) -> CheckFailed:
    """A check that ran out of memory defers the version (retried once headroom passes) instead of
    rejecting it: a good version must not be refused for what else holds the GPU at the moment."""
    return CheckFailed(f"{name} check ran out of memory ({type(exc).__name__}: {str(exc)[:200]}); "
                       "deferred until memory frees", {"out_of_memory": True}, deferred=True)  # fmt: skip


@dataclass(slots=True)
class CheckContext:
    """State one check leaves for the next (file list, tensor table, ...)."""

    directory: Path
    settings: CheckSettings
    reference: Path | None
    manifest: Manifest | None = None  # what the manifest claims (None: index/marker-committed)
    recorded: list[ManifestFile] | None = None  # digests an earlier verify recorded (the registry's)
    files: list[ManifestFile] = field(default_factory=list)  # sizes; crc32c/hash "" until computed
    file_list_from: str | None = None  # "manifest" | "directory" once the manifest check listed files
    hashed: bool = False  # files carry crc32c and hash computed from the bytes
    digest: str | None = None  # set only from hashes computed from the bytes
    headers: list[SafetensorsHeader] | None = None
    table: dict[str, TensorLocation] | None = None
    staged: Staged | None = None  # the hashed bytes on the staging device; released by run_checks
    stager: VerifyStager | None = None  # stage in the loader (ipc) rather than in this process
    # given the stager's buffer to open in the check process while the loader reads (runner)
    premap: Callable[[Any], None] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def weight_bytes(self) -> int:
        return sum(h.file_size for h in self.headers or [])
