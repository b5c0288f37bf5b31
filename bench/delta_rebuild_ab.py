"""The host-side delta rebuild alone, repeated: base + one 1 %-density delta made once, then
`rebuild_delta()` N times, each followed by the checks' read of the result (`hash_files`).

    python -m bench.delta_rebuild_ab LAYOUT RUNS          # e.g. llama3-8b 3; prints one JSON line

Made for an A/B of two trees on one machine (run it from each tree in turn, alternating, on the
same data: `RBW_ROOT` keeps the base and the delta between runs). Environment: RBW_ROOT (data,
default /tmp/rbw), RBW_DEST (where the result is rebuilt, default beside the data), RBW_DEVICE
(where the base's random weights are made: cpu or cuda). Figures: bench/RESULTS.md, "Delta rebuild".
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench.common import LAYOUTS, Layout, write_checkpoint
from bench.e2e_delta import make_delta
from daemon.bytepipe.files import hash_files
from daemon.delta.rebuild import rebuild_delta
from daemon.delta.section import parse
from daemon.manifest import load_manifest, publish

LAYOUTS = {**LAYOUTS, "mid": Layout("mid", vocab=32000, hidden=2048, intermediate=5632, layers=12, heads=16, kv_heads=4)}


def main() -> None:
    layout = sys.argv[1] if len(sys.argv) > 1 else "small"
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    root = Path(os.environ.get("RBW_ROOT", "/tmp/rbw")) / f"data-{layout}"
    base, out = root / "base", root / "out"
    if not (root / "ready").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        write_checkpoint(base, LAYOUTS[layout], shards=4, seed=3, device=os.environ.get("RBW_DEVICE", "cpu"))
        publish(base, version="base")
        new, _made = make_delta(base, root / "trainer", out, version="d0", seed=11, density=0.01)
        shutil.rmtree(new)
        (root / "ready").write_text("1")
    m = load_manifest(out)
    spec = parse(m, "bench")
    bf = {f.path: f for f in load_manifest(base).files}
    rs, rvs, cpu = [], [], []
    for _ in range(runs):
        dest = Path(os.environ.get("RBW_DEST", str(root))) / "rebuilt"
        c0, t0 = time.process_time(), time.perf_counter()
        r = rebuild_delta(out, m, spec, base, bf, dest)
        t1 = time.perf_counter()
        cpu.append(time.process_time() - c0)
        files = [r.directory / f.path for f in m.files]
        for f, d in zip(m.files, hash_files(files, alg=m.hash_alg or "blake3"), strict=True):
            d.check(f, f.path)
        rs.append(t1 - t0)
        rvs.append(time.perf_counter() - t0)
        shutil.rmtree(dest)
    print(json.dumps({"layout": layout, "bytes": sum(f.bytes for f in m.files), "rebuild_s": [round(x, 3) for x in rs],
                      "rebuild_verify_s": [round(x, 3) for x in rvs], "rebuild_cpu_s": [round(x, 2) for x in cpu],
                      "median_rebuild_s": round(statistics.median(rs), 3),
                      "median_rebuild_verify_s": round(statistics.median(rvs), 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
