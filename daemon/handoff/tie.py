"""Tying a staged version to the registry: the loader's own per-file digests against the verified ones.

Shared by every receiver of a loader descriptor (the reference worker's ipc transport,
daemon.transport.ipc, and the vLLM worker extension, daemon.engines.vllm_extension), so both refuse
the same things with the same words. Light on purpose: it runs inside vLLM's venv too.
"""

from __future__ import annotations

from typing import Any

from daemon.bytepipe import Expect, reference_for
from daemon.handoff.descriptor import Descriptor, IpcRefused


def tie_to_loader(loader_desc: Descriptor, sent: Descriptor, expect: Expect) -> dict[str, Any]:
    """The loader's own per-file digests (computed while it staged) against the registry's.

    `loader_desc` is what the loader itself answers, `sent` what the update request carried: they
    must describe the same version and tensors. Raises IpcRefused naming the first file that does
    not match; returns the facts for the update's answer."""
    if loader_desc.version != sent.version or loader_desc.tensors != sent.tensors:
        raise IpcRefused(f"version {sent.version!r}: the request's descriptor is not the loader's")
    own_paths = {b.device_uuid: b.path for b in loader_desc.buffers}
    for b in sent.buffers:
        if b.path is not None and own_paths.get(b.device_uuid) != b.path:
            raise IpcRefused(f"version {sent.version!r}: segment {b.path} in the request is not the loader's")
    if not loader_desc.files:
        raise IpcRefused(f"version {sent.version!r}: the loader computed no digests for it")
    refs = {f.path: r for f in expect.files if (r := reference_for(f)) is not None}
    staged = {path for path, *_ in loader_desc.files}
    for path, nbytes, alg, value in loader_desc.files:
        ref = refs.get(path)
        if ref is None:
            raise IpcRefused(f"{path}: staged by the loader, but the registry has no verified digest for it")
        if ref.alg != alg or ref.value != value or ref.bytes != nbytes:
            raise IpcRefused(
                f"{path}: the loader staged {alg} {value[:16]}... ({nbytes} bytes), the registry verified "
                f"{ref.alg} {ref.value[:16]}... ({ref.bytes} bytes): changed since it was verified"
            )
    missing = sorted(p for p in refs if p.endswith(".safetensors") and p not in staged)
    if missing:
        raise IpcRefused(f"{missing[0]}: verified weight file was not staged by the loader")
    algs = sorted({alg for _p, _n, alg, _v in loader_desc.files})
    return {"checked_files": len(loader_desc.files), "check_alg": ",".join(algs), "check_by": "loader",
            "check_weak": any(a == "crc32c" for a in algs)}  # fmt: skip
