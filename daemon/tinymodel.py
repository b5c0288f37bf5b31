"""Tiny random Llama-style checkpoints and LoRA adapters for them: for tests, the quickstart and
CPU benchmarks (`make_tiny_checkpoint`, `make_tiny_adapter`).

Nothing is downloaded: the config is written here and the weights are drawn from a
seeded generator, so two calls with the same seed give identical files. With
`tokenizer=True` the checkpoint also gets a small byte-level tokenizer made here (see
`write_tiny_tokenizer`), so text prompts and chat work on it.
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


# Special tokens first (ids 0..12, so bos 1 and eos 2 match the config), then one token per
# byte value that can occur in UTF-8 text: 256 - 13 (0xC0, 0xC1, 0xF5..0xFF never do) = 243.
# 13 + 243 = 256 = the tiny model's vocabulary, so any text encodes and a character of two to
# four bytes spans as many tokens (what incremental detokenization must get right).
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
                  *(f"<|reserved_{i}|>" for i in range(8)))  # fmt: skip
UTF8_BYTES = tuple(b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5)
END_OF_TURN = "<|im_end|>"
# ChatML-style; the worker renders it with transformers' sandboxed Jinja
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what a ByteLevel vocabulary holds)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_tiny_tokenizer(directory: str | Path) -> Path:
    """A byte-level tokenizer of exactly 256 tokens with a chat template, made with `tokenizers`.

    No merges: one token per byte, the special tokens above, `<s>` prepended to every encoding.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    symbols = byte_symbols()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbols[b]: len(SPECIAL_TOKENS) + i for i, b in enumerate(UTF8_BYTES)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]), chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_LLAMA_CONFIG["max_position_embeddings"],
    )  # fmt: skip
    d = Path(directory)
    fast.save_pretrained(str(d))
    # Readable by older transformers too: the generic class name, the template in the config
    cfg_path = d / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    # stop at the end of an assistant turn as well as at </s>
    gen = {"bos_token_id": 1, "eos_token_id": [2, vocab[END_OF_TURN]]}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return d


def make_tiny_checkpoint(
    directory: str | Path,
    seed: int = 0,
    *,
    shards: int = 1,
    dtype: str = "float32",
    config_overrides: dict[str, Any] | None = None,
    tokenizer: bool = False,
) -> Path:
    """Write config.json and random weights (one file, or `shards` files plus an index),
    and with `tokenizer=True` the tokenizer of `write_tiny_tokenizer`.

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
    if tokenizer:
        write_tiny_tokenizer(d)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def make_tiny_adapter(
    directory: str | Path,
    base: str | Path,
    seed: int = 0,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    std: float = 0.02,
) -> Path:
    """A LoRA adapter for the checkpoint in `base` (PEFT layout: adapter_config.json and
    adapter_model.safetensors), its lora_A [rank, in] and lora_B [out, rank] drawn from a seeded
    generator for every `targets` projection of every layer. Publish it with
    `hotswap publish DIR --version NAME@1 --adapter NAME` (docs/how-to/adapters.md)."""
    import torch
    from safetensors.torch import save_file

    from daemon.formats import tensor_table

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    table, _ = tensor_table(Path(base))
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, loc in sorted(table.items()):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            out_f, in_f = loc.entry.shape
            state[f"base_model.model.{module}.lora_A.weight"] = (torch.randn((rank, in_f), generator=gen) * std).contiguous()
            state[f"base_model.model.{module}.lora_B.weight"] = (torch.randn((out_f, rank), generator=gen) * std).contiguous()
    if not state:
        raise ValueError(f"{base}: no {' or '.join(targets)} weights to adapt")
    save_file(state, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    name_or_path = json.loads((Path(base) / "config.json").read_text()).get("_name_or_path") or str(base)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "base_model_name_or_path": name_or_path, "bias": "none", "fan_in_fan_out": False,
              "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "inference_mode": True}  # fmt: skip
    (d / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return d
