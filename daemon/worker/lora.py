"""LoRA adapters served by request `model` name, unmerged, on top of the resident base.

An adapter is loaded beside the base (its own small tensors) and applied per sequence: the
engine steps one sequence at a time under the weight store's lock, and for a sequence that named
an adapter, forward hooks on the adapted linear modules add `x @ A.T @ B.T * scale` to their
output (`Adapters.applied`). The base's parameters are never touched, so base traffic runs on as
before, and a base update in place leaves the adapters loaded.

A load is checked before anything serves it: the file's bytes are read once and hashed against
the verified digest the daemon sends (`expect.files`, as for weight updates), the tensors are
parsed from those same bytes, every pair must fit its module (`lora_A` `[r, in]`, `lora_B`
`[out, r]`, the module a linear layer of this model) and be finite. Only then does the name point
at the new version, in one assignment: a request takes the version its name points at when it
is admitted and keeps it to its last token, so in-flight requests finish on the version they
started with and the next one starts on the new one. Nothing of the base pauses for it.

    adapters = Adapters(loaded.model)
    adapters.load(name, version, directory, expect, digest)   # AdapterRefused names the problem
    seq.adapter = adapters.get(name)                           # at admission
    with adapters.applied(seq.adapter): model(...)             # in the engine's step
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from daemon.formats import ADAPTER_WEIGHTS, AdapterLayoutError, lora_pairs, name_problem, read_adapter_config
from daemon.hashing import HASH_ALGORITHMS, new_strong_hash
from daemon.transport import Expect, reference_for

MAX_ADAPTER_BYTES = 4 * 1024**3  # read whole into memory to hash and parse the same bytes


class AdapterRefused(ValueError):
    """The adapter was not loaded (the name keeps what it served); the message says why."""


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    name: str
    version: str
    digest: str | None
    path: str
    rank: int
    scale: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])
    loaded_at: float = field(default_factory=time.time)

    def info(self) -> dict[str, Any]:
        return {"version": self.version, "digest": self.digest, "path": self.path, "rank": self.rank,
                "scale": self.scale, "modules": len(self.modules), "loaded_at": self.loaded_at}  # fmt: skip


class Adapters:
    """The adapters one worker serves, by name, and the hooks that apply them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._by_name: dict[str, LoadedAdapter] = {}
        self._mu = threading.Lock()  # loads and unloads, one at a time; lookups read one dict entry
        self._active: LoadedAdapter | None = None  # set only under the store lock, by the engine
        self._hooked: set[str] = set()
        self._counts: dict[str, list[int]] = {}  # name -> [requests, failed]
        self.loads = 0

    # -- serving -----------------------------------------------------------------------------
    def get(self, name: str) -> LoadedAdapter | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    @contextlib.contextmanager
    def applied(self, adapter: LoadedAdapter | None) -> Iterator[None]:
        """Forward passes inside apply `adapter` (None: the base alone). Caller holds the store lock."""
        if adapter is None:
            yield
            return
        self._active = adapter
        try:
            yield
        finally:
            self._active = None

    def count(self, name: str, *, failed: bool = False) -> None:
        with self._mu:
            c = self._counts.setdefault(name, [0, 0])
            c[1 if failed else 0] += 1

    def counters(self) -> dict[str, dict[str, int]]:
        with self._mu:
            return {n: {"requests_total": c[0], "requests_failed": c[1]} for n, c in self._counts.items()}

    def info(self) -> dict[str, dict[str, Any]]:
        return {n: a.info() for n, a in sorted(self._by_name.items())}

    # -- admin -------------------------------------------------------------------------------
    def load(self, name: str, version: str, directory: str, expect: Expect, *, served_name: str) -> LoadedAdapter:
        """Read, check and install `version` under `name` (replacing what `name` served, atomically)."""
        problem = name_problem(name)
        if problem is not None:
            raise AdapterRefused(problem)
        if name == served_name:
            raise AdapterRefused(f"adapter name {name!r} is the base model's served name")
        adapter = self._read(name, version, Path(directory), expect)
        with self._mu:
            for module in adapter.modules:
                if module not in self._hooked:
                    self._linear[module].register_forward_hook(self._hook(module))
                    self._hooked.add(module)
            self._by_name[name] = adapter  # the switch: requests admitted from now on take it
            self.loads += 1
        return adapter

    def unload(self, name: str) -> LoadedAdapter | None:
        with self._mu:
            return self._by_name.pop(name, None)

    def _hook(self, module: str) -> Any:
        def hook(_m: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
            active = self._active
            pair = active.modules.get(module) if active is not None else None
            if pair is None:
                return None
            a, b = pair
            return out + (args[0] @ a.t()) @ b.t() * active.scale  # type: ignore[union-attr]

        return hook

    def _read(self, name: str, version: str, root: Path, expect: Expect) -> LoadedAdapter:
        from safetensors.torch import load as load_bytes

        try:
            cfg = read_adapter_config(root)
        except AdapterLayoutError as exc:
            raise AdapterRefused(f"{root}: {exc}") from None
        data = _verified_bytes(root / ADAPTER_WEIGHTS, expect)
        try:
            state = load_bytes(data)
            pairs = lora_pairs(list(state))
        except AdapterLayoutError as exc:
            raise AdapterRefused(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type; any parse failure refuses
            raise AdapterRefused(f"{ADAPTER_WEIGHTS}: unreadable ({exc})") from None
        modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, pair in pairs.items():
            linear = self._linear.get(module)
            if linear is None:
                raise AdapterRefused(f"module {module}: not a linear layer of the served model")
            a, b = state[pair.a], state[pair.b]
            want_a, want_b = [cfg.r, linear.in_features], [linear.out_features, cfg.r]
            for which, t, want in (("lora_A", a, want_a), ("lora_B", b, want_b)):
                if list(t.shape) != want:
                    raise AdapterRefused(f"module {module}: {which} shape {list(t.shape)} != {want} "
                                         f"(rank r={cfg.r}, weight {list(linear.weight.shape)})")  # fmt: skip
                if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                    raise AdapterRefused(f"module {module}: {which} is not finite floating point ({t.dtype})")
            w = linear.weight
            modules[module] = (a.to(device=w.device, dtype=w.dtype).contiguous(),
                               b.to(device=w.device, dtype=w.dtype).contiguous())  # fmt: skip
        return LoadedAdapter(name, version, expect.digest, str(root), cfg.r, cfg.scale, modules)


def _verified_bytes(path: Path, expect: Expect) -> bytes:
    """The whole file, hashed against the verified digest of `expect` (refused without one)."""
    ref = next((r for f in expect.files if f.path == ADAPTER_WEIGHTS and (r := reference_for(f))), None)
    if ref is None or ref.alg not in HASH_ALGORITHMS:
        raise AdapterRefused(f"{ADAPTER_WEIGHTS}: no verified strong hash in the request (expect.files): "
                             "only verified adapters are loaded")  # fmt: skip
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size != ref.bytes or size > MAX_ADAPTER_BYTES:
                raise AdapterRefused(f"{ADAPTER_WEIGHTS}: {size} bytes, {ref.bytes} verified (changed since verify)")
            f.seek(0)
            data = f.read()
    except OSError as exc:
        raise AdapterRefused(f"{path}: {exc.strerror or exc}") from None
    h = new_strong_hash(ref.alg)
    h.update(data)
    if h.hexdigest() != ref.value:
        raise AdapterRefused(f"{ADAPTER_WEIGHTS}: {ref.alg} does not match the verified digest (changed since verify)")
    return data
