"""Helpers for the checks tests: real tiny checkpoints and precise ways to damage them."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from daemon.formats.checkpoint import INDEX_NAME, MANIFEST_NAME
from daemon.formats.safetensors import read_header
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint


def published(directory: Path, seed: int = 0, *, shards: int = 1, dtype: str = "float32") -> Path:
    make_tiny_checkpoint(directory, seed, shards=shards, dtype=dtype)
    publish(directory)
    return directory


def shard_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def flip_bit_in_data(path: Path, byte_from_end: int = 7, bit: int = 3) -> None:
    """Flip one bit in the tensor data (past the header), keeping the file size."""
    h = read_header(path)
    offset = h.file_size - byte_from_end
    assert offset >= h.data_start
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def raw_safetensors(header: dict[str, Any], data: bytes, pad_to: int = 8) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % pad_to)
    return struct.pack("<Q", len(body)) + body + data


def rewrite_header(path: Path, edit: Any) -> None:
    """Re-write a shard's header through `edit(header_dict) -> header_dict`, keeping its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    path.write_bytes(raw_safetensors(edit(header), raw[8 + n :]))


def rewrite_tensors(directory: Path, edit: Any, *, file: str = "model.safetensors") -> None:
    """Load a shard's tensors, let `edit(state)` change them in place, save, and re-publish."""
    from safetensors.torch import load_file, save_file

    path = directory / file
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})
    if (directory / INDEX_NAME).exists():
        index = json.loads((directory / INDEX_NAME).read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file}
        index["weight_map"].update({k: file for k in state})
        (directory / INDEX_NAME).write_text(json.dumps(index))
    (directory / MANIFEST_NAME).unlink(missing_ok=True)
    publish(directory)


def edit_manifest(directory: Path, edit: Any) -> None:
    path = directory / MANIFEST_NAME
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(edit(doc)))


def add_word_tokenizer(directory: Path) -> None:
    """A small word-level tokenizer (ids < 64) saved the Hugging Face way, built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [
        "the",
        "capital",
        "of",
        "france",
        "is",
        "def",
        "fibonacci",
        "(",
        "n",
        ")",
        ":",
        "once",
        "upon",
        "a",
        "time",
        ",",
        "in",
        "small",
        "village",
    ]
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "bos_token": "<s>"})
    )
