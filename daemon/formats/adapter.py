"""LoRA adapter checkpoints in PEFT layout: what they are called, what they were trained for, and
which tensor pairs they hold.

A directory is an adapter checkpoint when it holds `adapter_config.json` (PEFT writes it with
`adapter_model.safetensors` beside it). The config says the rank `r`, `lora_alpha`, the
`target_modules` and the base (`base_model_name_or_path`); the weights hold one pair per adapted
module, `base_model.model.<module>.lora_A.weight` `[r, in]` and `...lora_B.weight` `[out, r]`,
and the module's output gains `x @ A.T @ B.T * scale` (scale `lora_alpha / r`, or
`lora_alpha / sqrt(r)` with `use_rslora`). What PEFT can also write and the engines here do not
serve (DoRA, `modules_to_save`, per-module rank patterns, bias training, `fan_in_fan_out`
layouts, embedding LoRA) is refused by `parse_config` / `lora_pairs`, naming it.

The name clients put in `model`, stable across the adapter's versions, comes from the manifest
(`hotswap publish --adapter NAME` writes `"adapter": NAME`), else from a label `NAME@VERSION`.
The base it was trained for: the manifest's `"base_model"`, else the config's
`base_model_name_or_path`.

    is_adapter(directory) -> bool
    cfg = read_adapter_config(directory)            # AdapterLayoutError naming the key
    pairs = lora_pairs(tensor_names_and_shapes)     # module -> LoraPair, AdapterLayoutError naming the tensor
    identity(directory, version, manifest_extra)    # (name, base) or AdapterLayoutError
"""

from __future__ import annotations

import math
import re
import re._parser as _sre  # the stdlib's own parse of a pattern: what regex_problem walks
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.formats.names import version_problem
from daemon.formats.smallfile import CONFIG_CAP_BYTES, SmallFileError, SmallFileMissing, read_json_object

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
NAME_MAX_BYTES = 128  # what clients send as `model`; engines log and label metrics with it


class AdapterLayoutError(ValueError):
    """Not a usable PEFT LoRA adapter: the message names the file, key or tensor."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    alpha: float
    target_modules: tuple[str, ...]  # module name suffixes ("q_proj"), or one regex when `target_regex`
    target_regex: bool
    base_model: str | None
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, module: str) -> bool:
        """Whether PEFT would have adapted `module` (a dotted path in the base model)."""
        if self.target_regex:
            return re.fullmatch(self.target_modules[0], module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)

    def to_json(self) -> dict[str, Any]:
        return {"r": self.r, "lora_alpha": self.alpha, "target_modules": list(self.target_modules),
                "base_model": self.base_model, "use_rslora": self.use_rslora, "scale": self.scale}  # fmt: skip


@dataclass(frozen=True, slots=True)
class LoraPair:
    module: str  # dotted path in the base model, e.g. "model.layers.0.self_attn.q_proj"
    a: str  # tensor name of lora_A ([r, in])
    b: str  # tensor name of lora_B ([out, r])


def is_adapter(directory: str | Path) -> bool:
    p = Path(directory) / ADAPTER_CONFIG
    return p.exists() or p.is_symlink()


def read_adapter_config(directory: str | Path) -> AdapterConfig:
    """adapter_config.json, read bounded (daemon.formats.smallfile), as an AdapterConfig."""
    try:
        doc = read_json_object(directory, ADAPTER_CONFIG, CONFIG_CAP_BYTES)
    except SmallFileMissing:
        raise AdapterLayoutError(f"{ADAPTER_CONFIG} missing") from None
    except SmallFileError as exc:
        raise AdapterLayoutError(str(exc).replace(f"{Path(directory)}/", "")) from None
    return parse_config(doc)


def parse_config(doc: Mapping[str, Any]) -> AdapterConfig:
    def bad(key: str, why: str) -> AdapterLayoutError:
        return AdapterLayoutError(f"{ADAPTER_CONFIG}: {key}: {why}")

    peft_type = doc.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise bad("peft_type", f"{peft_type!r}: only LORA adapters are served")
    r = doc.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", f"{r!r} must be a positive integer (the LoRA rank)")
    alpha = doc.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise bad("lora_alpha", f"{alpha!r} must be a positive number")
    for key, why in (("use_dora", "DoRA adapters are not served"), ("fan_in_fan_out", "transposed (Conv1D) layouts are not served")):
        if doc.get(key):
            raise bad(key, why)
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if doc.get(key):
            raise bad(key, f"{doc[key]!r:.80}: not supported (only one rank and alpha for every adapted module)")
    if doc.get("bias", "none") != "none":
        raise bad("bias", f"{doc['bias']!r}: trained biases are not served (\"none\" only)")
    targets = doc.get("target_modules")
    if isinstance(targets, str):
        problem = regex_problem(targets)
        if problem is not None:
            raise bad("target_modules", problem)
        target_modules, regex = (targets,), True
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        target_modules, regex = tuple(targets), False
    else:
        raise bad("target_modules", f"{targets!r:.80} must be a non-empty list of module names or one regex")
    base = doc.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise bad("base_model_name_or_path", f"{base!r:.80} must be a string")
    return AdapterConfig(r, float(alpha), target_modules, regex, base or None, bool(doc.get("use_rslora", False)))


_ATOMS = (_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.CATEGORY)
REGEX_MAX_CHARS = 256
REGEX_MAX_REPEATS = 3  # repetitions (*, +, {n,m}) in one pattern: backtracking is at most n**3 per name


def regex_problem(pattern: str) -> str | None:
    """Why `target_modules` given as one regex could run long in the daemon, or None.

    Python's `re` backtracks while it holds the GIL: `.*q_proj|mod(.+)+X` took 81 s on one module
    name and froze the daemon's API meanwhile. Accepted: at most REGEX_MAX_CHARS characters, no
    repeated group (the nested quantifier behind that), no backreference, at most
    REGEX_MAX_REPEATS repetitions; PEFT's usual forms (`.*\\.(q_proj|v_proj)`,
    `model\\.layers\\.\\d+\\.self_attn\\.(q|v)_proj`) pass."""
    if len(pattern) > REGEX_MAX_CHARS:
        return f"a regex of {len(pattern)} characters, over {REGEX_MAX_CHARS} (give a list of module names instead)"
    try:
        parsed = _sre.parse(pattern)
    except re.error as exc:
        return f"{pattern!r} is not a regular expression ({exc})"
    repeats = 0

    def walk(items: Any, inside_repeat: bool) -> str | None:
        nonlocal repeats
        for op, arg in items:
            if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
                _lo, hi, sub = arg
                many = hi is _sre.MAXREPEAT or hi > 1  # `?` (at most once) nests nothing
                if many and (inside_repeat or any(o not in _ATOMS for o, _ in sub)):
                    return f"{pattern!r:.80} repeats a group (a nested quantifier backtracks exponentially)"
                repeats += many
                why = walk(sub, inside_repeat or many)
            elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
                return f"{pattern!r:.80} uses a backreference"
            elif op == _sre.SUBPATTERN:
                why = walk(arg[-1], inside_repeat)
            elif op == _sre.BRANCH:
                why = next((w for b in arg[1] if (w := walk(b, inside_repeat))), None)
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT, _sre.ATOMIC_GROUP):
                why = walk(arg[-1], inside_repeat)
            else:
                why = None
            if why:
                return why
        return None

    why = walk(parsed, False)
    if why is None and repeats > REGEX_MAX_REPEATS:
        why = f"{pattern!r:.80} has {repeats} repetitions, over {REGEX_MAX_REPEATS}"
    return why


def lora_pairs(names: list[str]) -> dict[str, LoraPair]:
    """The adapted modules, from the tensor names of adapter_model.safetensors; AdapterLayoutError
    for a tensor that is not part of a LoRA pair, or a pair with one half missing."""
    halves: dict[str, dict[str, str]] = {}
    for name in sorted(names):
        m = _KEY.match(name)
        if m is None:
            raise AdapterLayoutError(
                f"tensor {name!r} is not a LoRA weight (expected {PREFIX}<module>.lora_A.weight / .lora_B.weight)"
            )
        halves.setdefault(m.group("module"), {})[m.group("which")] = name
    if not halves:
        raise AdapterLayoutError(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    out: dict[str, LoraPair] = {}
    for module, h in sorted(halves.items()):
        if "A" not in h or "B" not in h:
            missing = "lora_A" if "A" not in h else "lora_B"
            raise AdapterLayoutError(f"module {module}: {missing} missing (a LoRA pair needs both halves)")
        out[module] = LoraPair(module, h["A"], h["B"])
    return out


def name_problem(name: object) -> str | None:
    """Why `name` cannot be an adapter name clients send as `model`, or None."""
    problem = version_problem(name)
    if problem is not None:
        return problem.replace("version", "adapter name", 1)
    assert isinstance(name, str)
    if len(name.encode()) > NAME_MAX_BYTES or any(c.isspace() for c in name):
        return f"adapter name {name!r:.80} must be at most {NAME_MAX_BYTES} bytes without spaces"
    return None


def identity(directory: str | Path, version: str, manifest_extra: Mapping[str, Any] | None) -> tuple[str, str | None]:
    """(adapter name, base it was trained for) of an adapter checkpoint; AdapterLayoutError when
    it has no usable name."""
    extra = manifest_extra or {}
    name = extra.get("adapter")
    if name is None and "@" in version:
        name = version.rsplit("@", 1)[0]
    if name is None:
        raise AdapterLayoutError(
            f"adapter checkpoint {version!r} has no adapter name: publish it with `hotswap publish --adapter NAME` "
            "(the manifest's \"adapter\") or label it NAME@VERSION"
        )
    problem = name_problem(name)
    if problem is not None:
        raise AdapterLayoutError(problem)
    base = extra.get("base_model")
    if base is None:
        base = read_adapter_config(directory).base_model
    if base is not None and not isinstance(base, str):
        raise AdapterLayoutError(f"manifest base_model {base!r:.80} must be a string")
    return str(name), base
