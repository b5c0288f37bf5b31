"""The daemon's side of vLLM's ipc path: what the worker extension is asked, and how its answer is judged.

The extension (daemon.engines.vllm_extension, inside vLLM) is reached through `POST
/collective_rpc` with string kwargs only. Per rank it answers {"refused": reason} when it touched
nothing, else the per-tensor SHA-256 of the bytes it fed to vLLM's loader. Those must equal the
digests of the same tensors in the verified files (`tensor_digests`, computed in prepare, while
the engine still serves, from files `checked_files` has just hashed against the registry).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from daemon.engines.base import UpdateRefused, UpdateRequest, WorkerError
from daemon.formats import read_header

INFO_METHOD = "hotswap_info"
LOAD_METHOD = "hotswap_load_ipc"
PROTOCOL = 1  # daemon.engines.vllm_extension.PROTOCOL (that module imports torch; this one must not)
EXTENSION_CLS = "daemon.engines.vllm_extension.HotswapWorkerExtension"
CHUNK = 16 << 20


def has_extension(results: list[Any]) -> bool:
    """True when every rank answered hotswap_info with our extension and protocol."""
    return bool(results) and all(
        isinstance(r, dict) and r.get("extension") == "hotswap" and r.get("protocol") == PROTOCOL for r in results
    )


def load_kwargs(request: UpdateRequest) -> dict[str, str]:
    """The extension's kwargs: the loader's descriptor and the registry's expect, as JSON strings."""
    descriptor = request.source.get("descriptor")
    if not isinstance(descriptor, dict):
        raise UpdateRefused(f"update {request.version}: an ipc request without a descriptor")
    return {"descriptor": json.dumps(descriptor), "expect": json.dumps(request.expect.to_json())}


def tensor_digests(path: str) -> dict[str, str]:
    """SHA-256 of every tensor's bytes in the safetensors files of `path`."""
    sums: dict[str, str] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        header = read_header(f)
        fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for e in header.tensors:
                h = hashlib.sha256()
                pos = e.start
                while pos < e.end:
                    chunk = os.pread(fd, min(CHUNK, e.end - pos), pos)
                    if not chunk:
                        raise OSError(f"{f}: ends before tensor {e.name!r} does")
                    h.update(chunk)
                    pos += len(chunk)
                sums[e.name] = h.hexdigest()
        finally:
            os.close(fd)
    return sums


def judge(worker: str, version: str, results: list[Any], want: dict[str, str]) -> dict[str, Any]:
    """UpdateRefused when every rank refused (nothing was loaded); WorkerError when only some did or
    what was fed differs from the verified tensors; else the facts for the update's answer."""
    if not results or not all(isinstance(r, dict) for r in results):
        raise WorkerError(f"worker {worker}: update: {LOAD_METHOD} answered {str(results)[:300]}")
    refused = [str(r["refused"]) for r in results if "refused" in r]
    if refused and len(refused) == len(results):
        raise UpdateRefused(f"worker {worker}: update: vLLM's hotswap extension refused {version}: {refused[0]}")
    if refused:
        raise WorkerError(f"worker {worker}: update: {len(refused)} of {len(results)} ranks refused {version} "
                          f"({refused[0]}); the others loaded it")  # fmt: skip
    for rank, r in enumerate(results):
        sums = r.get("checksums")
        if r.get("version") != version or not isinstance(sums, dict):
            raise WorkerError(f"worker {worker}: update: rank {rank} answered {str(r)[:300]}")
        bad = sorted(k for k in set(sums) | set(want) if sums.get(k) != want.get(k))
        if bad:
            raise WorkerError(f"worker {worker}: update: rank {rank} fed {version}'s {bad[0]!r} with bytes that differ "
                              f"from the verified file ({len(bad)} of {len(want)} tensors)")  # fmt: skip
    first = results[0]
    return {"tensors_fed": first.get("tensors"), "bytes_fed": first.get("bytes"), "ranks": len(results),
            "extension_ms": max(float(r.get("ms") or 0.0) for r in results),
            "fed_checksums": "match", **(first.get("checked") or {})}  # fmt: skip
