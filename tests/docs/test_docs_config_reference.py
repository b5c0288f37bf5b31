"""config.example.toml, the config dataclasses and the generated config reference agree.

The reference page (docs/reference/config.md) is generated from the dataclasses at docs build
time (tools/docsgen/config_ref.py); config.example.toml is written by hand. This fails when a key
is added to a dataclass but not to the example (or the other way round), when the example shows
a default the code does not have, when a key has no description, or when the page would lack it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from tools.docsgen import config_ref

pytestmark = pytest.mark.quick

HEADER = re.compile(r"^#?\s*(\[\[?)([A-Za-z_.]+)(\]\]?)\s*(#.*)?$")
ASSIGN = re.compile(r"^(#\s*)?([a-z_0-9]+)\s*=\s*(.+)$")

# Keys the example sets on purpose to something else than the default, and why.
EXAMPLE_NOT_DEFAULT = {
    ("sources.local", "path"): "required: the embedded default's folder",
    ("sources.s3", "bucket"): "required: an example bucket",
    ("sources.s3", "prefix"): "an example prefix",
    ("sources.push", "path"): "required: an example folder",
    ("sources.push", "token_file"): "required: an example file",
    ("sources.push", "hmac_keys"): "an example key (a push needs one)",
    ("checks", "forward_prompts"): "token ids as an example; the default is three fixed prompts",
    ("checks", "forward_top1_min"): "unset by default; an example bound",
    ("checks", "forward_kl_max"): "unset by default; an example bound",
    ("checks", "adapter_top1_min"): "unset by default; an example bound",
    ("checks", "crc_threads"): "unset by default (one per core); an example",
    ("checks", "reference_dir"): "unset by default; an example folder",
    ("workers", "name"): "required: the managed worker's name",
    ("workers", "launch"): "the block shows the embedded default's managed worker",
    ("rollout.groups", "mode"): "an example group",
    ("gates.gate", "name"): "required: an example gate",
    ("gates.gate", "kind"): "required: an example kind",
    ("gates.gate", "min_score"): "unset by default; an example bound",
    ("gates.gate", "max_drop"): "unset by default; an example bound",
}


def example_keys(path: Path) -> dict[str, dict[str, list[tuple[Any, bool]]]]:
    """section path -> key -> [(value, commented)], from the first block of each section kind,
    commented-out lines included (the example shows optional sections commented)."""
    out: dict[str, dict[str, list[tuple[Any, bool]]]] = {}
    seen_blocks: set[str] = set()
    current: str | None = None
    array = False
    block_is_first = True
    kind = "sources.local"  # the [[sources]] table being read: its `type` line names it
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if m := HEADER.match(line):
            name, array = m.group(2), m.group(1) == "[["
            current = "rollout.groups" if name.startswith("rollout.groups.") else name
            block_is_first = array is False or current not in seen_blocks
            if array and current != "sources":
                seen_blocks.add(current)
            continue
        m = ASSIGN.match(line)
        if not m or current is None:
            continue
        key, text, commented = m.group(2), m.group(3), bool(m.group(1))
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            continue  # prose that happens to contain " = "
        section = current
        if current == "sources":
            if key == "type":
                kind = f"sources.{value}"
                block_is_first = kind not in seen_blocks
                seen_blocks.add(kind)
            section = kind
        if not block_is_first:
            continue
        out.setdefault(section, {}).setdefault(key, []).append((value, commented))
    return out


def test_every_key_has_a_description_and_a_row_on_the_generated_page() -> None:
    page = config_ref.markdown()
    missing = [f"{s.path}.{k.name}" for s in config_ref.sections() for k in s.keys if not k.description]
    assert missing == [], "keys without a comment in their dataclass"
    for s in config_ref.sections():
        assert f"## `{s.header}`" in page
        for k in s.keys:
            assert f"| `{k.name}` |" in page


def test_the_example_and_the_dataclasses_have_the_same_keys_and_defaults() -> None:
    example = example_keys(REPO / "config.example.toml")
    problems = []
    for s in config_ref.sections():
        shown = example.get(s.path, {})
        fields = {k.name: k for k in s.keys}
        for name in sorted(set(fields) - set(shown)):
            problems.append(f"{s.path}.{name}: in {s.cls.__name__} but not in config.example.toml")
        for name in sorted(set(shown) - set(fields)):
            problems.append(f"{s.path}.{name}: in config.example.toml but not a key of {s.cls.__name__}")
        for name, k in fields.items():
            if name not in shown or (s.path, name) in EXAMPLE_NOT_DEFAULT:
                continue
            value = shown[name][0][0]
            if k.default in (config_ref.REQUIRED, config_ref.UNSET) or value != k.default:
                problems.append(f"{s.path}.{name}: config.example.toml shows {value!r}, the default is {k.default!r}")
    for s in [x for x in example if x not in {sec.path for sec in config_ref.sections()}]:
        problems.append(f"[{s}]: a section in config.example.toml the config does not have")
    assert problems == []


def test_the_exemptions_are_still_needed() -> None:
    example = example_keys(REPO / "config.example.toml")
    defaults = {(s.path, k.name): k.default for s in config_ref.sections() for k in s.keys}
    stale = [key for key in EXAMPLE_NOT_DEFAULT
             if key in defaults and example.get(key[0], {}).get(key[1]) and
             example[key[0]][key[1]][0][0] == defaults[key]]  # fmt: skip
    assert stale == [], "the example now shows the default: drop these from EXAMPLE_NOT_DEFAULT"


def test_a_key_missing_from_the_example_is_caught(tmp_path: Path) -> None:
    text = (REPO / "config.example.toml").read_text()
    cut = tmp_path / "example.toml"
    cut.write_text(text.replace("rejoin_s = 1.0", "").replace('hash_alg = "blake3"', 'hash_alg = "sha256"'))
    example = example_keys(cut)
    assert "rejoin_s" not in example["rollout"] and example["checks"]["hash_alg"][0][0] == "sha256"
