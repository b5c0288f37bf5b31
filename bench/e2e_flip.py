"""Flip-back on the device (issue 41): a version whose probe fails after resume, through a real worker.

bench/gpu_e2e.py runs it at the end of the ipc fleet's run, with the daemon stopped (so it does not
converge the worker meanwhile): a copy of the serving version with its final norm all NaN (every
table check passes; the logits are not finite) is staged in the loader and sent to worker w0 with
`POST /admin/update?then=resume`, in copy and in swap mode, `repeats` times each. The worker writes,
resumes, probes, flips back and answers 409 with `flip_back_ms` (swap: the pointer flip back to its
own storage; copy: one copy back from the retained previous version, re-opened over ipc) and
`pause_window_ms`. After each, w0 must serve its version again (weight_info and a greedy probe).
"""

from __future__ import annotations

import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import httpx

from daemon.formats.checkpoint import MANIFEST_NAME
from daemon.formats.safetensors import read_header
from daemon.handoff.loader_client import LoaderClient

NORM = "model.norm.weight"


def probe_nan_version(src: Path, dest: Path) -> str:
    """`dest`: `src` with NORM all NaN (the shard holding it copied and patched, the others hard
    links; no manifest: the loader stages it unverified). Returns the patched shard's name."""
    dest.mkdir(parents=True)
    patched = ""
    for f in sorted(src.iterdir()):
        if f.name == MANIFEST_NAME or not f.is_file():
            continue
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
            continue
        entry = next((e for e in read_header(f).tensors if e.name == NORM), None)
        if entry is None:
            os.link(f, dest / f.name)
            continue
        shutil.copy(f, dest / f.name)
        nan = {"BF16": b"\xc0\x7f", "F16": b"\x00\x7e", "F32": b"\x00\x00\xc0\x7f"}[entry.dtype]
        with open(dest / f.name, "r+b") as fh:
            fh.seek(entry.start)
            fh.write(nan * ((entry.end - entry.start) // len(nan)))
        patched = f.name
    if not patched:
        raise ValueError(f"{src}: no tensor {NORM!r} to poison")
    return patched


def flip_back(http: httpx.Client, worker_url: str, loader_socket: Path, serving: Path, work: Path,
              repeats: int = 3) -> dict[str, Any]:  # fmt: skip
    """Per mode: the flip-back and pause-window times of `repeats` refused updates (see the docstring)."""
    loader = LoaderClient(loader_socket, timeout=120)
    info = http.get(f"{worker_url}/weight_info").raise_for_status().json()
    keep = info["version"]
    bad = work / "probe-nan"
    probe_nan_version(serving, bad)
    loader.stage("probe-nan", str(bad))
    out: dict[str, Any] = {"serving": keep, "repeats": repeats}
    try:
        for mode in ("copy", "swap"):
            flips: list[float] = []
            windows: list[float] = []
            errors: list[str] = []
            for _ in range(repeats):
                body = {"version": "probe-nan", "transport": "ipc", "mode": mode,
                        "descriptor": loader.descriptor("probe-nan")}  # fmt: skip
                http.post(f"{worker_url}/admin/prepare", json=body, timeout=120).raise_for_status()
                http.post(f"{worker_url}/admin/pause", json={"mode": "keep"}, timeout=60).raise_for_status()
                r = http.post(f"{worker_url}/admin/update?then=resume", json=body, timeout=120)
                doc = r.json()
                now = http.get(f"{worker_url}/weight_info").json()
                if r.status_code != 409 or now.get("version") != keep or now.get("state") != "RUNNING":
                    errors.append(f"HTTP {r.status_code}, worker on {now.get('version')} {now.get('state')}: "
                                  f"{str(doc)[:300]}")  # fmt: skip
                    if now.get("state") in ("PAUSED", "UPDATED"):
                        http.post(f"{worker_url}/admin/resume", timeout=60)
                    continue
                flips.append(float(doc["flip_back_ms"]))
                windows.append(float(doc["pause_window_ms"]))
            out[mode] = {"flip_back_ms": flips, "pause_window_ms": windows, "errors": errors,
                         "flip_back_median_ms": statistics.median(flips) if flips else None}  # fmt: skip
        probe = http.post(f"{worker_url}/admin/probe", json={"max_tokens": 2}, timeout=60).json()
        out["after"] = {"version": probe.get("weight_version"), "finite": probe.get("finite")}
    finally:
        try:
            loader.drop("probe-nan")
        except Exception as exc:  # noqa: BLE001 - still held by the worker's retained record: reported only
            out["drop"] = f"{type(exc).__name__}: {exc}"
        shutil.rmtree(bad, ignore_errors=True)
    return out
