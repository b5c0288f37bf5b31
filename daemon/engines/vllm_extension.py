"""hotswap's vLLM worker extension: a version from the staging loader into vLLM's model, no pickle.

Runs INSIDE vLLM's worker processes (one per tensor-parallel rank), mixed into vLLM's worker
class by

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
        --worker-extension-cls daemon.engines.vllm_extension.HotswapWorkerExtension ...

so it imports only the standard library, torch and hotswap's light modules (daemon.handoff,
daemon.bytepipe.expect, daemon.formats.safetensors, daemon.transport.ipc_open): installing
hotswap's wheel into vLLM's venv with `pip install --no-deps` is enough (docs/how-to/vllm.md).
Both methods take and return JSON-able values only: vLLM's `POST /collective_rpc` passes string
kwargs, and the loader's descriptor is JSON (daemon.handoff.descriptor). Nothing is unpickled.

`hotswap_info()` says the extension is there (the daemon's client asks before choosing the path).

`hotswap_load_ipc(descriptor, expect)`, on every rank:
  1. parse the descriptor strictly, then ask the loader it names (which must run as this user or
     root: SO_PEERCRED) for its own descriptor of the version, and tie the loader's per-file
     digests, computed from the bytes it staged, to the registry's (`expect`): the sender's
     table is never taken on trust (daemon.handoff.tie, the reference worker's check too);
  2. compare the table with the model's: the tensor names, dtypes and shapes of the checkpoint
     this model was built from (its safetensors headers). Any difference, or a descriptor the
     loader does not vouch for, answers {"refused": reason}: no parameter was touched;
  3. acquire the version at the loader, open its buffer (sealed shared memory owned by a trusted
     user, or a CUDA IPC handle: daemon.transport.ipc_open, the reference worker's opener) and
     hash each tensor's bytes (SHA-256) as they are fed;
  4. feed the (name, view) pairs to vLLM's own in-place reload (`Worker.reload_weights
     (weights_iterator=...)` -> `model.load_weights`), which maps checkpoint names onto fused
     and tensor-parallel parameters; close the buffer and release the version at the loader;
  5. answer {"version", "tensors", "bytes", "checksums": {name: sha256 hex}, "ms", "rank"}: the
     daemon compares the checksums with digests of the verified files.
An exception after step 2 leaves vLLM with a 500 and possibly a half-loaded model: the daemon
treats it as a failed update (re-install last good, else restart).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from daemon.bytepipe import BadUpdateRequest, Expect
from daemon.formats import HeaderError, read_header
from daemon.handoff import (
    HOST_DEVICE,
    Descriptor,
    IpcRefused,
    LoaderClient,
    LoaderError,
    TensorSpec,
    parse_descriptor,
    tie_to_loader,
)

PROTOCOL = 1  # what hotswap_info answers; the daemon's client refuses an extension it does not know
EXTENSION = "hotswap"


class HotswapWorkerExtension:
    """Mixed into vLLM's Worker (`self` is the worker: model_runner, vllm_config, reload_weights)."""

    def hotswap_info(self) -> dict[str, Any]:
        return {"extension": EXTENSION, "protocol": PROTOCOL, "pid": os.getpid(), "device": str(_device(self))}

    def hotswap_load_ipc(self, descriptor: str, expect: str = "{}") -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            opened = _checked(self, descriptor, expect)
        except (IpcRefused, LoaderError, BadUpdateRequest, ValueError) as exc:
            return {"refused": str(exc), "pid": os.getpid()}
        desc, checked = opened
        return _load(self, desc, checked, t0)


def _device(worker: Any) -> Any:
    model = worker.model_runner.get_model()
    return next(model.parameters()).device


def _device_uuid(device: Any) -> str:
    if device.type == "cpu":
        return HOST_DEVICE
    from daemon.handoff import device_uuid

    return device_uuid(device.index if device.index is not None else 0)


def _checked(worker: Any, raw_descriptor: str, raw_expect: str) -> tuple[Descriptor, dict[str, Any]]:
    """Steps 1 and 2: the loader's own descriptor, tied to the registry and to the model's table."""
    try:
        sent = parse_descriptor(json.loads(raw_descriptor))
        expect = Expect.from_json(json.loads(raw_expect or "{}"))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise IpcRefused(f"descriptor or expect is not JSON ({exc})") from None
    device = _device(worker)
    want = "shm" if device.type == "cpu" else "cuda"
    if sent.kind != want:
        raise IpcRefused(f"descriptor of kind {sent.kind!r} cannot feed a vLLM worker on {device} (needs {want!r})")
    if not sent.loader:
        raise IpcRefused(f"version {sent.version!r}: the descriptor names no loader to vouch for the staged bytes")
    from daemon.transport import TRUSTED_UIDS  # torch: only once a request came

    client = LoaderClient(sent.loader, timeout=30.0, peer_uids=TRUSTED_UIDS)
    own = parse_descriptor(client.descriptor(sent.version, device=_device_uuid(device)))
    checked = tie_to_loader(own, sent, expect)
    if expect.tensors is not None and expect.tensors != len(own.tensors):
        raise IpcRefused(f"version {own.version!r}: {len(own.tensors)} tensors staged, {expect.tensors} verified")
    problem = table_problem(own.table(), model_table(worker))
    if problem:
        raise IpcRefused(f"version {own.version!r}: {problem} (nothing was loaded)")
    return own, checked


def model_table(worker: Any) -> dict[str, TensorSpec]:
    """Name -> dtype and shape of every tensor of the checkpoint this model was built from (its
    safetensors headers; after a disk reload, the directory reloaded, which has the same table)."""
    root = Path(str(worker.vllm_config.model_config.model))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise IpcRefused(f"the model's directory {root} has no safetensors files to compare the table with")
    table: dict[str, TensorSpec] = {}
    try:
        for f in files:
            for e in read_header(f).tensors:
                table[e.name] = TensorSpec(e.name, e.dtype, tuple(e.shape), e.nbytes)
    except (HeaderError, OSError) as exc:
        raise IpcRefused(f"the model's checkpoint {root} cannot be read for its table ({exc})") from None
    return table


def table_problem(incoming: dict[str, TensorSpec], model: dict[str, TensorSpec]) -> str | None:
    """The first difference between the staged table and the model's, named; None when equal."""
    unknown = sorted(set(incoming) - set(model))
    if unknown:
        return f"tensor {unknown[0]!r} is not a tensor of the served model ({len(unknown)} such)"
    missing = sorted(set(model) - set(incoming))
    if missing:
        return f"tensor {missing[0]!r} of the served model is missing ({len(missing)} missing)"
    for name in sorted(incoming):
        got, have = incoming[name], model[name]
        if got.dtype != have.dtype:
            return f"tensor {name!r}: dtype {got.dtype}, the served model's is {have.dtype}"
        if got.shape != have.shape:
            return f"tensor {name!r}: shape {list(got.shape)}, the served model's is {list(have.shape)}"
        if got.nbytes != have.nbytes:
            return f"tensor {name!r}: {got.nbytes} bytes, the served model's has {have.nbytes}"
    return None


def _load(worker: Any, desc: Descriptor, checked: dict[str, Any], t0: float) -> dict[str, Any]:
    """Steps 3 to 5 (see the module docstring)."""
    from daemon.transport import OPENER

    device = _device(worker)
    holder = f"vllm-{os.getpid()}"
    assert desc.loader is not None  # _checked refused a descriptor without one
    loader = LoaderClient(desc.loader, timeout=30.0)
    try:
        loader.acquire(desc.version, holder, pid=os.getpid())
    except LoaderError as exc:
        return {"refused": f"version {desc.version!r}: {exc} (nothing was loaded)", "pid": os.getpid()}
    try:
        opened = OPENER.open(desc, desc.buffer_for(_device_uuid(device)))
    except (IpcRefused, OSError) as exc:
        _release(loader, desc.version, holder)
        return {"refused": f"version {desc.version!r}: {exc} (nothing was loaded)", "pid": os.getpid()}
    sums: dict[str, str] = {}
    try:
        views = opened.views()

        def pairs() -> Any:
            for t in desc.tensors:
                raw = opened.payload[t.offset : t.offset + t.nbytes]
                sums[t.name] = hashlib.sha256(memoryview(raw.cpu().numpy())).hexdigest()
                yield t.name, views[t.name]

        worker.reload_weights(weights_iterator=pairs(), is_checkpoint_format=True)
    finally:
        views = {}
        OPENER.release(opened)
        _release(loader, desc.version, holder)
    if len(sums) != len(desc.tensors):
        raise RuntimeError(f"version {desc.version!r}: vLLM's load_weights took {len(sums)} of {len(desc.tensors)} tensors")
    ms = (time.perf_counter() - t0) * 1000.0
    return {"version": desc.version, "tensors": len(sums), "bytes": desc.total_bytes, "checksums": sums,
            "ms": round(ms, 1), "pid": os.getpid(), "checked": checked}  # fmt: skip


def _release(loader: LoaderClient, version: str, holder: str) -> None:
    with contextlib.suppress(LoaderError):  # the loader forgets holders whose pid is gone; a dead one holds nothing
        loader.release(version, holder)
