"""A tiny Llama whose greedy output is known: it spells a fixed text, multi-byte characters included.

`make_successor_checkpoint(dir, CHAIN)` takes the seed tokenizer (daemon.tinymodel, one token per
byte) and sets the weights so the model maps each token of CHAIN to the next one (cyclically):
attention and MLP outputs are zeroed (o_proj, down_proj), so the last hidden state is the
current token's embedding; the chain tokens get orthonormal embeddings and lm_head row
`next(t)` is t's embedding. The greedy continuation of any prompt ending in a chain token is
then CHAIN itself, byte by byte: "é" is two tokens, "€" three, "😀" four, so a streaming API
that cut deltas per token would show broken characters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from daemon.tinymodel import make_tiny_checkpoint

CHAIN = "\nHé€😀!"  # every UTF-8 byte distinct; "\n" ends the chat template's assistant header


def chain_tokens(tokenizer, text: str = CHAIN) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(set(ids)) == len(ids), "chain tokens must be distinct"
    return ids


def expected_text(text: str, start: str, n_tokens: int) -> bytes:
    """The bytes of the greedy continuation of a prompt ending in `start` (a chain character)."""
    raw = text.encode()
    i = raw.index(start.encode()) + len(start.encode())
    out = bytearray()
    while len(out) < n_tokens:
        out.append(raw[i % len(raw)])
        i += 1
    return bytes(out)


def make_successor_checkpoint(directory: Path, text: str = CHAIN) -> Path:
    from transformers import AutoTokenizer

    d = make_tiny_checkpoint(directory, seed=5, tokenizer=True)
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    ids = chain_tokens(tok, text)
    path = d / "model.safetensors"
    state = load_file(str(path))
    hidden = state["model.embed_tokens.weight"].shape[1]
    basis, _ = torch.linalg.qr(torch.randn(hidden, len(ids), generator=torch.Generator().manual_seed(3)))
    for name, t in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(t)
        elif name.endswith("norm.weight"):
            state[name] = torch.ones_like(t)
    embed = state["model.embed_tokens.weight"].clone()
    head = torch.zeros_like(state["lm_head.weight"])
    for k, t in enumerate(ids):
        embed[t] = basis[:, k]
        head[ids[(k + 1) % len(ids)]] = basis[:, k]
    state["model.embed_tokens.weight"] = embed.contiguous()
    state["lm_head.weight"] = head.contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
    return d
