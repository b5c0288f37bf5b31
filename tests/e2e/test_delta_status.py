"""`hotswap status`, `history` and `show` say how each version arrived (issue 38): full or a delta of
its base, the bytes fetched, the delta/full ratio, the tensors and elements it changed, and the
compacted delta it ships. A real daemon on a watched folder, the real CLI in a subprocess; the
changed counts are checked against the trainer's own tensors, bit by bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from conftest import hotswap_cli, publish_tiny
from safetensors.torch import load_file
from support_delta import step

from daemon.client import publish_delta
from daemon.delta.anchors import AnchorRule


def changed(old: Path, new: Path) -> tuple[int, int]:
    """(tensors, elements) whose bytes differ between two safetensors files of the same layout."""
    a, b = load_file(old), load_file(new)
    tensors = elements = 0
    for name, t in b.items():
        x, y = a[name].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)
        n = int((x.reshape(t.numel(), -1) != y.reshape(t.numel(), -1)).any(dim=1).sum())
        tensors, elements = tensors + (n > 0), elements + n
    return tensors, elements


def test_status_history_and_show_say_how_each_version_arrived(daemon_factory: Any, db_url: str,
                                                              tmp_path: Path) -> None:  # fmt: skip
    d = daemon_factory(db_url)
    trainer = tmp_path / "trainer"
    publish_tiny(trainer / "v1", seed=1)
    shutil.copytree(trainer / "v1", d.watch_dir / "v1")
    d.wait_status("v1", "verified")
    specs = {}
    for version, base in (("v2", "v1"), ("v3", "v2")):
        step(trainer / base, trainer / version, 1e-3, 7)
        p = publish_delta(
            trainer / version, trainer / base, d.watch_dir / version, rule=AnchorRule(share=100.0)
        )
        specs[version] = p.spec
        d.wait_status(version, "verified")
    v3 = specs["v3"]
    assert v3 is not None and v3.compacted is not None
    tensors, elements = changed(trainer / "v2" / "model.safetensors", trainer / "v3" / "model.safetensors")
    assert tensors > 0 and (v3.tensors_changed, v3.elements_changed) == (tensors, elements)
    counts = f"{tensors:,} tensors, {elements:,} elements changed"

    args = ("-c", str(d.config_path))
    out = hotswap_cli("status", *args, env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    arrived = {ln.split()[1]: ln for ln in out.stdout.splitlines() if ln.startswith("arrived:")}
    assert {"v1", "v2", "v3"} <= set(arrived), out.stdout
    assert f"{100 * v3.ratio:.2f} % of full" in arrived["v3"] and "delta of v2" in arrived["v3"], arrived[
        "v3"
    ]
    assert counts in arrived["v3"] and "compacted delta from v1" in arrived["v3"], arrived["v3"]
    assert (
        arrived["v1"].endswith("full, " + arrived["v1"].split("full, ")[1])
        and "delta of" not in arrived["v1"]
    )
    doc = json.loads(hotswap_cli("status", "--json", *args).stdout)
    row = next(a for a in doc["arrivals"] if a["version"] == "v3")
    assert (row["encoding"], row["delta_base"], row["fetched_bytes"]) == ("delta", "v2", v3.delta_bytes)
    assert (row["tensors_changed"], row["elements_changed"]) == (tensors, elements)
    assert (row["compacted_from"], row["compacted_bytes"]) == ("v1", v3.compacted.delta_bytes)

    history = hotswap_cli("history", "--wide", *args)
    assert history.returncode == 0, history.stderr
    line = next(ln for ln in history.stdout.splitlines() if ln.startswith("│ v3 "))
    assert f"v2 ({100 * v3.ratio:.1f} %; {counts})" in line, history.stdout
    shown = hotswap_cli("show", "v3", *args)
    assert shown.returncode == 0, shown.stderr
    for label, value in (
        ("tensors changed", tensors),
        ("elements changed", elements),
        ("compacted from", "v1"),
    ):
        assert any(
            ln.strip().startswith(f"{label}:") and str(value) in ln for ln in shown.stdout.splitlines()
        ), shown.stdout
