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


# ---------------------------------------------------------------- a CRC-preserving forgery


def _crc_fixing_patch(data: bytearray, pos: int, target: int) -> int:
    """The 32-bit value to XOR into data[pos:pos+4] (little-endian) so the CRC32C changes by `target`.

    CRC is affine in the message: for messages of one length, crc(m ^ d) ^ crc(m) is linear in d.
    So the effect of each of the 32 bits at `pos` is one column; solve the 32x32 system over GF(2).
    """
    import crc32c

    base = crc32c.crc32c(data)
    columns = []
    for bit in range(32):
        probe = bytearray(data[pos : pos + 4])
        probe[bit // 8] ^= 1 << (bit % 8)
        patched = data[:pos] + probe + data[pos + 4 :]
        columns.append(crc32c.crc32c(patched) ^ base)
    # Gaussian elimination: rows are (column effect, which input bits make it)
    rows = [(columns[b], 1 << b) for b in range(32)]
    solution_for: dict[int, tuple[int, int]] = {}
    for effect, inputs in rows:
        for pivot, (pe, pi) in solution_for.items():
            if effect >> pivot & 1:
                effect, inputs = effect ^ pe, inputs ^ pi
        if effect == 0:
            continue
        pivot = effect.bit_length() - 1
        for other, (oe, oi) in list(solution_for.items()):
            if oe >> pivot & 1:
                solution_for[other] = (oe ^ effect, oi ^ inputs)
        solution_for[pivot] = (effect, inputs)
    if len(solution_for) != 32:
        raise AssertionError("the 4 bytes at this position cannot steer the CRC (never for CRC-32C)")
    delta = 0
    for pivot, (_, inputs) in solution_for.items():
        if target >> pivot & 1:
            delta ^= inputs
    return delta


def forge_keeping_crc(path: Path, tensor: str = "lm_head.weight") -> dict[str, Any]:
    """Negate `tensor` in a safetensors file, then change 4 bytes of it so the file's CRC32C is unchanged.

    The file stays a valid safetensors file (header untouched, same size); the 4 patched
    bytes are an element (or two) of the negated tensor, chosen so they stay finite and
    small, so every other check passes too. Returns what was done, for assertions.
    """
    import crc32c
    import numpy as np

    from daemon.formats.safetensors import DTYPE_SIZES

    data = bytearray(path.read_bytes())
    original_crc = crc32c.crc32c(data)
    entry = next(e for e in read_header(path).tensors if e.name == tensor)
    size = DTYPE_SIZES[entry.dtype]
    floats = {"F32": np.float32, "F16": np.float16}
    # negate: flip the sign bit, the top bit of each little-endian element's last byte
    view = np.frombuffer(data, dtype=np.uint8, count=entry.nbytes, offset=entry.start)
    flipped = view.copy()
    flipped[size - 1 :: size] ^= 0x80
    data[entry.start : entry.end] = flipped.tobytes()
    target = crc32c.crc32c(data) ^ original_crc
    for pos in range(entry.end - 4, entry.start - 1, -4):  # aligned 4-byte windows, from the end
        delta = _crc_fixing_patch(data, pos, target)
        window = bytes(b ^ (delta >> (8 * i) & 0xFF) for i, b in enumerate(data[pos : pos + 4]))
        if entry.dtype in floats:
            values = np.frombuffer(window, dtype=floats[entry.dtype])
        elif entry.dtype == "BF16":
            values = (np.frombuffer(window, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = np.zeros(1)
        if np.all(np.isfinite(values)) and np.all(np.abs(values) < 1.0):
            data[pos : pos + 4] = window
            break
    else:
        raise AssertionError(f"no 4-byte window in {tensor} gives finite small values")
    assert crc32c.crc32c(data) == original_crc and len(data) == path.stat().st_size
    path.write_bytes(bytes(data))
    return {"tensor": tensor, "patched_offset": pos, "crc32c": f"{original_crc:08x}"}


def write_format1_manifest(directory: Path, signer: Any = None, version: str | None = None) -> dict[str, Any]:
    """A manifest as the previous release wrote it (CRC32C only), optionally signed the same way."""
    from daemon.manifest import FORMAT_1, canonical_bytes, crc32c_file, list_checkpoint_files

    files = [
        {"path": rel, "bytes": (directory / rel).stat().st_size, "crc32c": crc32c_file(directory / rel)}
        for rel in list_checkpoint_files(directory)
    ]
    doc: dict[str, Any] = {
        "format": FORMAT_1,
        "version": version or directory.name,
        "step": None,
        "parent": None,
        "created_at": "2026-11-01T00:00:00Z",
        "files": files,
    }
    if signer is not None:
        doc["signature"] = {"alg": signer.alg, "key_id": signer.key_id, "value": signer.sign(canonical_bytes(doc))}
    (directory / MANIFEST_NAME).write_text(json.dumps(doc))
    return doc
