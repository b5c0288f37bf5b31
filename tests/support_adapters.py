"""LoRA adapters for tests, made here (PEFT layout, nothing downloaded), and the tokens a base
with the adapter merged into its weights gives, computed independently with torch.

    base = make_base(tmp / "base", seed=0)                       # a tiny Llama named BASE_NAME
    make_adapter(tmp / "a1", base, seed=1)                        # rank 8 on q_proj and v_proj
    publish_adapter(watch, "sql@1", "sql", lambda d: make_adapter(d, base, seed=1))
    merged_greedy(base, tmp / "a1", prompt, 8)                    # W + B @ A * alpha / r, float64

The merged reference never touches hotswap's LoRA code: it loads the base with transformers,
adds the deltas to the weights in float64 and decodes greedily, so it can disagree with a
server that applies the adapter wrongly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

BASE_NAME = "hotswap-test/tiny-llama"
TARGETS = ("q_proj", "v_proj")


def verified_row(reg: Any, tmp_path: Path, version: str, adapter: str | None = None) -> int:
    """A checkpoint row moved to `verified` (an adapter version of `adapter` when given, trained
    for base "base"), with an empty local folder: for in-process tests of the jobs."""
    from daemon.registry import status
    from daemon.registry.status import CheckpointStatus

    local = tmp_path / version
    local.mkdir()
    with reg.session() as s:
        c = status.create(s, version=version, source="t", uri=f"file://{local}", local_path=str(local),
                          commit_signal="manifest")  # fmt: skip
        assert c is not None
        if adapter is not None:
            c.kind, c.adapter_name, c.base_model = "adapter", adapter, "base"
        status.move(s, c, CheckpointStatus.VERIFYING)
        status.move(s, c, CheckpointStatus.VERIFIED)
        return int(c.id)


def make_base(directory: Path, seed: int = 0, *, dtype: str = "float32", overrides: dict[str, Any] | None = None,
              lm_head_scale: float = 1.0) -> Path:  # fmt: skip
    """A tiny random Llama whose config names it BASE_NAME. `lm_head_scale` widens the logits, so
    greedy choices have margins far above bfloat16 rounding (engines serve bf16)."""
    from safetensors.torch import load_file, save_file

    from daemon.tinymodel import make_tiny_checkpoint

    d = make_tiny_checkpoint(directory, seed=seed, dtype=dtype,
                             config_overrides={"_name_or_path": BASE_NAME, **(overrides or {})})  # fmt: skip
    if lm_head_scale != 1.0:
        path = d / "model.safetensors"
        state = load_file(str(path))
        state["lm_head.weight"] = (state["lm_head.weight"].double() * lm_head_scale).to(state["lm_head.weight"].dtype)
        save_file(state, str(path), metadata={"format": "pt"})
    return d


def base_shapes(base: Path) -> dict[str, tuple[int, ...]]:
    from daemon.formats.checkpoint import tensor_table

    table, _ = tensor_table(base)
    return {n: tuple(loc.entry.shape) for n, loc in table.items()}


def make_adapter(
    directory: Path, base: Path, *, seed: int, rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] = TARGETS,
    dtype: str = "float32", base_model: str | None = BASE_NAME, std: float = 0.2, config_rank: int | None = None,
    nan: bool = False, wrong_shape: bool = False,
) -> Path:  # fmt: skip
    """A PEFT adapter for `base`: lora_A [r, in], lora_B [out, r] for every `targets` module of
    every layer. `config_rank` declares another rank than the tensors have; `wrong_shape` makes
    one lora_A one column short; `nan` puts a NaN into one lora_B."""
    import torch
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in sorted(base_shapes(base).items()):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
            continue
        out_f, in_f = shape
        a = torch.randn((rank, in_f - (1 if wrong_shape and not state else 0)), generator=gen) * std
        b = torch.randn((out_f, rank), generator=gen) * std
        state[f"base_model.model.{module}.lora_A.weight"] = a.to(getattr(torch, dtype)).contiguous()
        state[f"base_model.model.{module}.lora_B.weight"] = b.to(getattr(torch, dtype)).contiguous()
    if nan:
        key = sorted(k for k in state if "lora_B" in k)[0]
        state[key][0, 0] = float("nan")
    save_file(state, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": config_rank or rank, "lora_alpha": alpha, "target_modules": list(targets),
              "base_model_name_or_path": base_model, "bias": "none", "fan_in_fan_out": False,
              "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "inference_mode": True}  # fmt: skip
    (d / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return d


def publish_adapter(watch: Path, version: str, name: str, make: Callable[[Path], Path], **extra: Any) -> Path:
    """`make(dir)` writes the adapter; a manifest naming it `name` is added and the folder renamed
    into the watched folder in one step."""
    from daemon.manifest import publish

    watch.mkdir(parents=True, exist_ok=True)
    tmp = watch / f".build-{version}"
    make(tmp)
    publish(tmp, version=version, extra={"adapter": name, **extra})
    final = watch / version
    os.replace(tmp, final)
    return final


def merged_state(base: Path, adapter: Path) -> dict[str, Any]:
    """The base's weights with the adapter merged in (float64): W + B @ A * alpha / r."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    state = {k: v.double() for k, v in load_file(str(base / "model.safetensors")).items()}
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        state[f"{module}.weight"] = state[f"{module}.weight"] + (b.double() @ a.double()) * scale
    return state


def greedy_with(base: Path, state: dict[str, Any], prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens of the base architecture with `state` as weights (float64), and the smallest
    gap between the top two logits over the steps (how robust the choice is to rounding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model.load_state_dict(state, strict=False)
    model.eval()
    ids = list(prompt)
    margin = float("inf")
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2).values
            margin = min(margin, float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], margin


def merged_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens (and the smallest top-two margin) of the base with `adapter` merged (None: the base)."""
    import torch
    from safetensors.torch import load_file

    state = merged_state(base, adapter) if adapter is not None else \
        {k: v.to(torch.float64) for k, v in load_file(str(base / "model.safetensors")).items()}
    return greedy_with(base, state, prompt, n)
