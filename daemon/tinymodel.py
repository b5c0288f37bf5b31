"""Tiny random Llama-style checkpoints: for tests, the quickstart and CPU benchmarks.

Nothing is downloaded: the config is written here and the weights are drawn from a
seeded generator, so two calls with the same seed give identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def make_tiny_checkpoint(
    directory: str | Path,
    seed: int = 0,
    *,
    shards: int = 1,
    dtype: str = "float32",
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write config.json and random weights (one file, or `shards` files plus an index).

    Returns the directory. No manifest is written: call `daemon.sources.manifest`'s
    publisher (or `hotswap publish`) to commit the checkpoint.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_LLAMA_CONFIG, torch_dtype=dtype, **(config_overrides or {}))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        # Re-draw every tensor from our own seeded generator so weights differ per seed
        # even where transformers initialises deterministically (norms start at ones).
        t = torch.randn(p.shape, generator=gen) * 0.05
        if name.endswith("norm.weight"):
            t = t + 1.0
        state[name] = t.to(torch_dtype).contiguous()
    names = sorted(state)
    if shards <= 1:
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        groups = [names[i::shards] for i in range(shards)]
        for i, group in enumerate(groups, start=1):
            fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
            save_file({n: state[n] for n in group}, str(d / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in group})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d
