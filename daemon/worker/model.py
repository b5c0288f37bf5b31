"""Build the served model from a local checkpoint directory, with no download.

The model comes from the checkpoint's `config.json` (`AutoConfig` + `AutoModelForCausalLM.from_config`)
on the target device, and its weights are then written in by the disk transport, the same
path an update takes. `params` maps safetensors names to the live tensors: a name is included
exactly when the checkpoint holds it, so tied weights (`lm_head.weight` sharing
`model.embed_tokens.weight`) appear once, under the name the checkpoint uses.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from daemon.formats import LayoutError, tensor_table

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    config: Any  # transformers PretrainedConfig
    tokenizer: Any | None
    device: torch.device
    dtype: torch.dtype
    params: dict[str, torch.Tensor]
    eos_token_ids: frozenset[int]
    vocab_size: int
    max_positions: int
    cache_kwarg: str  # "cache" (transformers >= 5.2x) or "past_key_values"
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.params.values())


def pick_device(spec: str) -> torch.device:
    """`auto` -> cuda:0 when CUDA is present, else cpu; `cuda:N` must exist."""
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: CUDA is not available on this machine")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"--device {spec}: use auto, cpu or cuda:N")
    return dev


def config_dtype(config: Any) -> torch.dtype:
    raw = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    if isinstance(raw, torch.dtype):
        return raw
    dt = getattr(torch, str(raw).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"config.json: unknown dtype {raw!r}")
    return dt


def param_dict(model: torch.nn.Module, checkpoint_names: set[str]) -> dict[str, torch.Tensor]:
    """Live tensors under their safetensors names.

    Every storage of the model's state dict must be covered by at least one checkpoint name,
    else the model would serve uninitialised weights; tied aliases the checkpoint omits are fine.
    """
    state = model.state_dict(keep_vars=True)
    params = {n: t for n, t in state.items() if n in checkpoint_names}
    owners: dict[int, str] = {}
    for n, t in params.items():
        if t.data_ptr() in owners:
            # both names of a tied weight: which copy would win is arbitrary, so refuse
            raise LayoutError(
                f"checkpoint holds both {owners[t.data_ptr()]!r} and {n!r}, which this model ties "
                "(tie_word_embeddings): keep only one of them"
            )
        owners[t.data_ptr()] = n
    covered = set(owners)
    uncovered = sorted(n for n, t in state.items() if t.data_ptr() not in covered)
    if uncovered:
        more = f" (+{len(uncovered) - 3} more)" if len(uncovered) > 3 else ""
        raise LayoutError(f"checkpoint has no tensor for model weight(s) {uncovered[:3]}{more}")
    return params


def load_tokenizer(directory: Path) -> Any | None:
    if not any((directory / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def stop_token_ids(directory: Path, config: Any, tokenizer: Any | None) -> frozenset[int]:
    """End-of-sequence ids: config.json's, generation_config.json's (chat models list their
    end-of-turn token there) and the tokenizer's."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int) and not isinstance(v, bool):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(t for t in v if isinstance(t, int) and not isinstance(t, bool))

    add(getattr(config, "eos_token_id", None))
    gen = directory / "generation_config.json"
    if gen.is_file() and gen.stat().st_size < 1 << 20:
        with contextlib.suppress(ValueError, AttributeError):  # a broken one only loses its stop ids
            add(json.loads(gen.read_text("utf-8")).get("eos_token_id"))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


def served_name_default(directory: Path, config: Any) -> str:
    """A name that stays the same across weight versions (a client keeps sending it): the
    model's own name from config.json when it has one, else its model type (e.g. "llama").
    Never the checkpoint directory, which is usually a version label."""
    try:
        raw = json.loads((directory / "config.json").read_text("utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        raw = None
    if isinstance(raw, str) and raw.strip() and not raw.startswith(("/", ".", "~")) and len(raw) <= 200:
        return raw.strip()
    return str(getattr(config, "model_type", None) or "model")


def longest_token_chars(tokenizer: Any | None) -> int:
    """Longest vocabulary entry, in characters: a text longer than context x this cannot fit."""
    if tokenizer is None:
        return 0
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - then only the byte bound applies
        return 0
    return max((len(t) for t in vocab), default=0)


def build_model(directory: str | Path, device: torch.device) -> LoadedModel:
    """The model from config.json on `device`, with uninitialised weights; see `load_weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = Path(directory)
    if not (d / "config.json").exists():
        raise LayoutError(f"{d}: no config.json")
    try:
        json.loads((d / "config.json").read_text("utf-8"))
    except ValueError as exc:
        raise LayoutError(f"{d / 'config.json'}: not valid JSON ({exc})") from None
    config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    dtype = config_dtype(config)
    table, _ = tensor_table(d)
    with torch.device(device), _no_init():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # skipped along with initialisation in some releases
    model.eval()
    model.requires_grad_(False)
    params = param_dict(model, set(table))
    tokenizer = load_tokenizer(d)
    eos_ids = stop_token_ids(d, config, tokenizer)
    forward_args = inspect.signature(model.forward).parameters
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        params=params,
        eos_token_ids=eos_ids,
        vocab_size=int(config.vocab_size),
        max_positions=int(getattr(config, "max_position_embeddings", 2048) or 2048),
        cache_kwarg="cache" if "cache" in forward_args else "past_key_values",
        bos_token_id=getattr(config, "bos_token_id", None),
    )


class _no_init:  # noqa: N801 - used like a function-style context manager
    """Skip random initialisation when transformers offers it: the weights are loaded next."""

    def __enter__(self) -> None:
        try:
            from transformers.initialization import no_init_weights
        except ImportError:
            try:
                from transformers.modeling_utils import no_init_weights  # older releases
            except ImportError:
                self._cm = None
                return
        self._cm = no_init_weights()
        self._cm.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)
