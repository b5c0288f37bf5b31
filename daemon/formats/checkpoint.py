"""Hugging Face checkpoint layout: which safetensors files hold which tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.formats.safetensors import SafetensorsHeader, TensorEntry, read_header
from daemon.formats.smallfile import (
    CONFIG_CAP_BYTES,
    INDEX_CAP_BYTES,
    SmallFileError,
    SmallFileMissing,
    read_json_object,
)

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "hotswap-manifest.json"


class LayoutError(ValueError):
    """A checkpoint directory that is not a usable Hugging Face safetensors layout."""


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards when sharded, else *.safetensors."""
    d = Path(directory)
    index = d / INDEX_NAME
    if index.exists() or index.is_symlink():
        doc = read_index(d)
        weight_map = doc.get("weight_map")
        if not isinstance(weight_map, dict):
            raise LayoutError(f"{index}: unreadable index ('weight_map' must be an object)")
        try:
            names = sorted(set(weight_map.values()))
        except TypeError as exc:
            raise LayoutError(f"{index}: unreadable index ({exc})") from None
        for name in names:
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise LayoutError(f"{index}: bad shard name {name!r}")
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise LayoutError(f"{d}: no *.safetensors files")
    return files


def read_index(directory: str | Path) -> dict[str, Any]:
    """model.safetensors.index.json as a dict, read bounded (daemon.formats.smallfile)."""
    try:
        return read_json_object(directory, INDEX_NAME, INDEX_CAP_BYTES)
    except SmallFileError as exc:
        raise LayoutError(f"unreadable index: {exc}") from None


def read_config(directory: str | Path) -> dict[str, Any] | None:
    """config.json as a dict, read bounded; None when there is none."""
    try:
        return read_json_object(directory, "config.json", CONFIG_CAP_BYTES)
    except SmallFileMissing:
        return None
    except SmallFileError as exc:
        raise LayoutError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class TensorLocation:
    file: Path
    entry: TensorEntry


def tensor_table(directory: str | Path) -> tuple[dict[str, TensorLocation], list[SafetensorsHeader]]:
    """Every tensor of the checkpoint by name, with strict header validation of each shard."""
    table: dict[str, TensorLocation] = {}
    headers: list[SafetensorsHeader] = []
    for f in weight_files(directory):
        if not f.exists():
            raise LayoutError(f"{f}: shard listed in the index is missing")
        h = read_header(f)
        headers.append(h)
        for e in h.tensors:
            if e.name in table:
                raise LayoutError(f"{f}: tensor {e.name!r} also appears in {table[e.name].file.name}")
            table[e.name] = TensorLocation(f, e)
    return table, headers
