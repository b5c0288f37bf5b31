"""Daemon-side clients for workers: the reference worker, SGLang and vLLM.

`make_client(spec, url=..., token_file=..., settings=...)` builds the client for
one `[[workers]]` entry; the rollout engine only ever sees the `WorkerClient`
protocol of `daemon.adapters.base`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from daemon.adapters.base import WorkerClient, WorkerError

if TYPE_CHECKING:
    from daemon.rollout.settings import RolloutSettings, WorkerSpec


def read_token(token_file: str, worker: str) -> str | None:
    """The bearer token from `token_file` (first line, stripped); None when no file is configured."""
    if not token_file:
        return None
    path = Path(token_file).expanduser()
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise WorkerError(f"worker {worker}: cannot read token_file {path}: {exc.strerror}") from None
    if not token:
        raise WorkerError(f"worker {worker}: token_file {path} is empty")
    return token


def make_client(spec: WorkerSpec, *, url: str, token_file: str, settings: RolloutSettings) -> WorkerClient:
    """The client for one configured worker, with the rollout's step timeouts."""
    if spec.kind == "builtin":
        from daemon.adapters.builtin import BuiltinWorkerClient

        return BuiltinWorkerClient(
            spec.name,
            url,
            token_file=token_file or None,
            timeout_s=settings.request_timeout_s,
            update_timeout_s=settings.update_timeout_s,
            drain_timeout_s=settings.drain_timeout_s,
        )
    raise WorkerError(f"worker {spec.name}: kind {spec.kind!r} has no adapter yet (use kind = \"builtin\")")
