"""Smoke test of stage-while-verifying on one device, without pytest (the H200 box has none).

Tiny real checkpoints; for `--device cuda:0` the GPU paths the CPU tests cannot reach:
  1. one read into a staged copy on the device: digests equal `hash_files`, bytes equal the files;
  2. all checks with the staged finite scan and the canary on the device: a good version passes,
     a NaN is caught by finite, and by the canary when finite is off;
  3. the same through a loader on the device (`hotswap loader --device D`): verify stages in the
     loader's buffer, the version is exported after the checks, a NaN version is dropped.

    python -m bench.stage_smoke --device cuda:0      # ~20 s
    python -m bench.stage_smoke --device cpu         # the same on shared host memory
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from daemon.bytepipe.files import hash_files
from daemon.bytepipe.staged import stage_files
from daemon.checks import CHECK_NAMES, CheckSettings, run_checks
from daemon.handoff.loader_client import LoaderClient
from daemon.manifest import publish
from daemon.tinymodel import make_tiny_checkpoint
from daemon.transport.ipc_verify import LoaderStager

FAILED: list[str] = []


def check(name: str, ok: bool, detail: Any = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""), flush=True)
    if not ok:
        FAILED.append(name)


def good(d: Path, seed: int) -> Path:
    make_tiny_checkpoint(d, seed, shards=2, dtype="bfloat16")
    publish(d)
    return d


def with_nan(d: Path, seed: int) -> Path:
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(d, seed, dtype="bfloat16")
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"].view(-1)[77] = float("nan")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    publish(d)
    return d


def details(report: Any) -> dict[str, dict[str, Any]]:
    return {r.name: r.detail for r in report.results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    dev = args.device
    root = Path(tempfile.mkdtemp(prefix="stage-smoke-"))
    v1, bad = good(root / "v1", 1), with_nan(root / "nan", 2)
    rels = sorted(p.name for p in v1.iterdir())
    t = time.perf_counter()
    digests, copy = stage_files(v1, rels, dev, alg="blake3", threads=4, chunk=4096)
    check("one read: digests equal hash_files", digests == hash_files([v1 / r for r in rels], alg="blake3"))
    check("one read: staged bytes equal the files",
          all(copy.file_bytes(r).cpu().numpy().tobytes() == (v1 / r).read_bytes() for r in rels))  # fmt: skip
    copy.release()
    settings = CheckSettings(forward_device=dev, ipc_enabled=dev.startswith("cuda"))
    report = run_checks(v1, settings)
    d = details(report)
    check("good version passes every check", report.ok, report.reason)
    check(f"finite scanned the copy on {dev}", d.get("finite", {}).get("scanned") == f"staged copy on {dev}", d.get("finite"))
    # the canary runs in the check process: a GPU copy crosses there as a CUDA IPC handle; a host copy
    # does not (it would be copied whole), so on the CPU the canary reads the files itself
    expect = "crc32c pass" if dev.startswith("cuda") else "read for the forward check"
    check(f"canary ran on {'the crc32c pass' if dev.startswith('cuda') else 'its own read'}",
          d.get("forward", {}).get("weights") == expect, d.get("forward"))  # fmt: skip
    report = run_checks(bad, settings)
    check("NaN caught by finite", (report.reason or "").startswith("finite: ") and "element 77" in (report.reason or ""),
          report.reason)  # fmt: skip
    no_finite = CheckSettings(forward_device=dev, enabled=tuple(n for n in CHECK_NAMES if n != "finite"))
    report = run_checks(bad, no_finite)
    check("NaN caught by the canary", (report.reason or "").startswith("forward: logits contain NaN/Inf"), report.reason)
    print(f"(in-process checks: {time.perf_counter() - t:.1f}s)", flush=True)

    sock = root / "loader.sock"
    shm = root / "shm"
    shm.mkdir()
    loader = subprocess.Popen([sys.executable, "-m", "daemon.loader.server", "--socket", str(sock), "--device", dev,
                               "--shm-dir", str(shm), "--threads", "4"])  # fmt: skip
    try:
        client = LoaderClient(sock, timeout=30)
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        exported: list[str] = []
        report = run_checks(v1, settings, stager=LoaderStager(client, "v1", dev, exported.append))
        d = details(report)
        check("loader: good version passes", report.ok, report.reason)
        check("loader: crc32c read into the loader", str(d.get("crc32c", {}).get("staged", "")).startswith("in the loader"),
              d.get("crc32c"))  # fmt: skip
        check("loader: finite on the loader's copy", str(d.get("finite", {}).get("scanned", "")).startswith("staged copy"),
              d.get("finite"))  # fmt: skip
        check("loader: canary ran on the loader's copy (opened in the check process)",
              d.get("forward", {}).get("weights") == "crc32c pass", d.get("forward"))  # fmt: skip
        check("loader: exported after the checks", exported == ["v1"] and bool(client.descriptor("v1")["checked"]))
        report = run_checks(bad, settings, stager=LoaderStager(client, "nan", dev, exported.append))
        held = {v["version"] for v in client.status()["versions"]}
        check("loader: NaN rejected and dropped", (report.reason or "").startswith("finite: ") and "nan" not in held,
              (report.reason, held))  # fmt: skip
    finally:
        loader.terminate()
        loader.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    print("ALL PASS" if not FAILED else f"FAILED: {FAILED}", flush=True)
    return 0 if not FAILED else 1


if __name__ == "__main__":
    raise SystemExit(main())
