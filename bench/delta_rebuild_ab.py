"""The host-side delta rebuild alone, repeated: base + one 1 %-density delta made once, then
`rebuild_delta()` N times, each followed by the checks' read of the result (`hash_files`).

    python -m bench.delta_rebuild_ab LAYOUT RUNS          # e.g. llama3-8b 3; prints one JSON line
    python -m bench.delta_rebuild_ab LAYOUT RUNS --recycle [--json PATH]

`--recycle`: RUNS pairs, alternating which goes first, of a rebuild into fresh files and one over a
stale rebuilt directory of the same layout (`rebuild_delta(recycle=...)`: the previous result,
moved aside, as a rebuilt version retention would delete); prints a table of the medians and writes
the runs as JSON (default: recycle-ab.json beside the data). The stale directory was written by the
run before, so its pages are likely still cached (as on a host with the memory to keep them).

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
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    layout = args[0] if args else "small"
    runs = int(args[1]) if len(args) > 1 else 5
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
    assert spec is not None, f"{out}: not a delta"
    bf = {f.path: f for f in load_manifest(base).files}
    if "--recycle" in sys.argv:
        at = sys.argv.index("--json") + 1 if "--json" in sys.argv else 0
        recycle_ab(layout, root, out, base, runs, Path(sys.argv[at]) if at else root / "recycle-ab.json")
        return
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


def recycle_ab(layout: str, root: Path, out: Path, base: Path, runs: int, json_path: Path) -> None:
    m = load_manifest(out)
    spec = parse(m, "bench")
    assert spec is not None
    bf = {f.path: f for f in load_manifest(base).files}
    dest_root = Path(os.environ.get("RBW_DEST", str(root)))
    dest, stale = dest_root / "rebuilt", dest_root / "stale"
    shutil.rmtree(dest, ignore_errors=True)
    if not stale.is_dir():  # untimed: the first stale directory
        rebuild_delta(out, m, spec, base, bf, stale)
    times: dict[str, list[float]] = {"fresh": [], "recycled": []}
    verify: dict[str, list[float]] = {"fresh": [], "recycled": []}
    recycled_bytes: list[int] = []
    for k in range(runs):
        for mode in ("fresh", "recycled") if k % 2 == 0 else ("recycled", "fresh"):
            t0 = time.perf_counter()
            r = rebuild_delta(out, m, spec, base, bf, dest, recycle=stale if mode == "recycled" else None)
            t1 = time.perf_counter()
            for f, d in zip(m.files, hash_files([r.directory / f.path for f in m.files], alg=m.hash_alg or "blake3"),
                            strict=True):  # fmt: skip
                d.check(f, f.path)
            times[mode].append(t1 - t0)
            verify[mode].append(time.perf_counter() - t0)
            if mode == "recycled":
                assert r.recycled_bytes and not stale.exists()
                recycled_bytes.append(r.recycled_bytes)
                os.replace(dest, stale)  # the next recycled run's stale directory
            else:
                shutil.rmtree(dest)
    total = sum(f.bytes for f in m.files)
    doc = {"layout": layout, "bytes": total, "runs": runs, "recycled_bytes": recycled_bytes,
           "rebuild_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
           "rebuild_verify_s": {k: [round(x, 3) for x in v] for k, v in verify.items()},
           "median_rebuild_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
           "median_rebuild_verify_s": {k: round(statistics.median(v), 3) for k, v in verify.items()}}  # fmt: skip
    print(f"{layout}: {total / 1e9:.2f} GB, {runs} alternating pairs (medians)")
    print(f"{'':10} {'rebuild s':>10} {'GB/s':>6} {'+verify s':>10}")
    for mode_name in times:
        med = statistics.median(times[mode_name])
        print(f"{mode_name:10} {med:10.3f} {total / 1e9 / med:6.2f} {statistics.median(verify[mode_name]):10.3f}")
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
