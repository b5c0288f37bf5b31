"""The forward check's canary: one model skeleton per architecture, run on staged tensors.

The skeleton is built once per (config.json, device): modules and non-persistent buffers (e.g.
rotary frequencies) on the device, every parameter on the meta device (no memory, no random
init). A version is run by `torch.func.functional_call` with the staged tensors as its
parameters: views of the staged bytes, no copy, and the skeleton itself is never modified, so
the same one serves the next version and the serving version (the reference logits).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.func import functional_call

from daemon.checks.base import CheckFailed

KEEP = 2  # skeletons kept (architectures seen lately); an old one is rebuilt if it comes back


@dataclass
class Canary:
    key: str
    model: torch.nn.Module
    device: str
    params: dict[str, torch.nn.Parameter]  # named_parameters (tied ones once, by their first name)
    persistent_buffers: set[str]
    state_names: set[str]  # every name load_state_dict would accept (tied aliases included)
    lock: threading.Lock = field(default_factory=threading.Lock)  # functional_call swaps attributes
    runs: int = 0


class CanaryCache:
    """Skeletons by architecture; `builds` counts constructions (once per architecture and device)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.builds = 0
        self._by_key: OrderedDict[str, Canary] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, doc: dict[str, Any], device: str, where: str, dtype: str | None = None) -> Canary:
        """The skeleton of `doc` on `device`, in `dtype` (a torch dtype name) when given, else in the
        config's own (checks.engine_dtype: an fp16 engine overflows where an fp32 canary does not)."""
        key = json.dumps({"config": doc, "device": device, "dtype": dtype}, sort_keys=True, default=str)
        with self._lock:
            found = self._by_key.get(key)
            if found is not None:
                self._by_key.move_to_end(key)
                return found
            canary = _build(doc, device, key, where, dtype)
            self.builds += 1
            self._by_key[key] = canary
            while len(self._by_key) > self.keep:
                self._by_key.popitem(last=False)
            return canary

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()


CANARIES = CanaryCache()  # the process's skeletons (the daemon verifies many versions)


def _no_init_weights() -> Any:
    """transformers' context that skips random weight initialisation (moved in 5.x)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile goes to the meta device; buffers stay where made."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


_BUILD_LOCK = threading.Lock()  # _parameters_on_meta patches a class attribute: one build at a time


def model_config(doc: dict[str, Any], where: str) -> tuple[Any, torch.dtype]:
    """transformers' config for a config.json document already read (bounded) and its dtype;
    CheckFailed naming `where` when transformers cannot use it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        model_type = doc.get("model_type")
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ValueError(f"unknown model_type {model_type!r}")
        config = CONFIG_MAPPING[model_type].from_dict(doc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"{where}/config.json: transformers cannot use it ({exc})") from None
    dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return config, dtype


def _build(doc: dict[str, Any], device: str, key: str, where: str, dtype_name: str | None = None) -> Canary:
    from transformers import AutoModelForCausalLM

    config, dtype = model_config(doc, where)
    if dtype_name is not None:
        dtype = getattr(torch, dtype_name)
    try:
        with _BUILD_LOCK, torch.device(device), _no_init_weights(), _parameters_on_meta():
            try:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"{where}/config.json: no causal LM for this config ({exc})") from None
    model.eval()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the parameters made on the GPU before moving to meta: give it back
    params = dict(model.named_parameters())
    state_names = set(model.state_dict(keep_vars=True))
    buffers = {n for n in state_names if n not in params and n not in dict(model.named_parameters(remove_duplicate=False))}
    return Canary(key, model, device, params, buffers, state_names)


def bind(canary: Canary, state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The staged tensors as the skeleton's parameters and persistent buffers; refuse what
    load_state_dict would refuse (missing, unexpected, wrong shape). A tensor whose dtype is not
    the model's is converted (a copy of that one tensor), as load_state_dict would."""
    unexpected = sorted(k for k in state if k not in canary.state_names)
    aliases = dict(canary.model.named_parameters(remove_duplicate=False))
    bound: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name, p in canary.params.items():
        t = state.get(name)
        if t is None:  # a tied parameter may be stored under another of its names
            t = next((state[a] for a, q in aliases.items() if q is p and a in state), None)
        if t is None:
            missing.append(name)
            continue
        bound[name] = _fit(name, t, p)
    for name in sorted(canary.persistent_buffers):
        if name not in state:
            missing.append(name)
        else:
            bound[name] = state[name]
    if missing:
        raise CheckFailed(
            f"{where}: model needs tensor {missing[0]!r}, not in the checkpoint"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            {"missing": missing[:20]},
        )
    if unexpected:
        raise CheckFailed(
            f"{where}: tensor {unexpected[0]!r} is not a parameter of {type(canary.model).__name__}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""),
            {"unexpected": unexpected[:20]},
        )
    return bound


def _fit(name: str, t: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    if tuple(t.shape) != tuple(p.shape):
        raise CheckFailed(
            f"tensor {name!r} has shape {list(t.shape)}, the model from config.json expects {list(p.shape)}",
            {"tensor": name, "shape": list(t.shape), "expected": list(p.shape)},
        )
    return t if t.dtype == p.dtype else t.to(p.dtype)


def run(canary: Canary, bound: dict[str, torch.Tensor], prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits (float32, on the CPU) of each prompt, the skeleton running on the bound tensors."""
    return run_scanned(canary, bound, prompts)[0]


def run_scanned(
    canary: Canary, bound: dict[str, torch.Tensor], prompts: list[list[int]]
) -> tuple[list[torch.Tensor], list[tuple[float, float]]]:
    """Each prompt's logits (float32, on the CPU) and its (lowest, highest) logit, NaN when any is.

    All prompts in one forward (issue 41: one pass over the weights instead of one per prompt),
    right-padded with token 0: a causal model's logits at a prompt's own positions never see the
    padding after them, so each prompt's logits are its own; one copy to the host at the end. The
    extremes are taken where the logits are: on the H100 host the same scan of the host copy took
    ~2 ms a prompt unloaded, and the check's part after the run, mostly that scan, ~28 ms under
    serving load (CPU threads shared with the workers; bench/RESULTS.md 2026-12-07)."""
    if not prompts:
        return [], []
    lens = [len(p) for p in prompts]
    width = max(lens)
    with canary.lock, torch.inference_mode():
        canary.runs += 1
        x = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.long, device=canary.device)
        result = functional_call(canary.model, bound, args=(), kwargs={"input_ids": x, "use_cache": False},
                                 tie_weights=True, strict=False)  # fmt: skip
        on_device = result.logits.float()
        extremes = torch.stack([torch.stack(torch.aminmax(on_device[i, :n])) for i, n in enumerate(lens)]).cpu()
        logits = on_device.cpu()
    return [logits[i, :n] for i, n in enumerate(lens)], [(float(lo), float(hi)) for lo, hi in extremes.tolist()]


@dataclass
class ReferenceLogits:
    """The serving version's logits, by directory and the weights' identity, so the reference is
    staged and run once, not on every verify."""

    keep: int = 4
    _by_key: OrderedDict[tuple[Any, ...], list[torch.Tensor]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, key: tuple[Any, ...]) -> list[torch.Tensor] | None:
        with self._lock:
            return self._by_key.get(key)

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()

    def put(self, key: tuple[Any, ...], logits: list[torch.Tensor]) -> None:
        with self._lock:
            self._by_key[key] = logits
            while len(self._by_key) > self.keep:
                self._by_key.popitem(last=False)


def weights_identity(files: list[Path]) -> tuple[Any, ...]:
    """(path, size, mtime_ns, inode) of each weight file: what changes when a file does."""
    out = []
    for f in files:
        st = f.stat()
        out.append((str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


REFERENCES = ReferenceLogits()
