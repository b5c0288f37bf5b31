"""What a relaunched reference worker's start-up is made of (issue 36: "measure what the 7 s of a
kill -9 is made of"): the supervisor relaunches at once (bench/one_worker.py: kill -> new process
<= 0.14 s), so the seconds with no answer are the new process's start-up. Here that start-up alone,
N times: `python -X importtime -m daemon.cli worker --model TINY --device cpu`, polled with a
completion until it answers 200.

Per run: `first_answer_s` (exec -> first 200), `import_s` (every import: the sum of
`-X importtime`'s self times), `imports` (the six packages whose modules took longest: torch,
transformers, ...), `load_s` (the worker's own "loaded ... in X s": model build, which imports
transformers' model code, and the weights' load) and `other_s` = first_answer_s - import_s (interpreter start,
model build and load without their imports, binding, the first forward).

    .venv/bin/python -m bench.worker_start [--n 3] [--out bench/results/worker_start-2core.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _imports(stderr: str) -> tuple[float, dict[str, float]]:
    """(seconds of all imports, top-level package -> seconds of its own modules) from `-X importtime`
    lines: each module's self time goes to its package, so torch imported by daemon.worker is torch's."""
    total, by_pkg = 0.0, defaultdict[str, float](float)
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, _, name = line[len("import time:"):].split("|")
        total += int(self_us) / 1e6
        by_pkg[name.strip().split(".")[0]] += int(self_us) / 1e6
    top = dict(sorted(by_pkg.items(), key=lambda kv: -kv[1])[:6])
    return total, {k: round(v, 3) for k, v in top.items()}


def one_start(model: Path, work: Path) -> dict[str, Any]:
    port = free_port()
    err_path = work / f"worker-{port}.err"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    t0 = time.perf_counter()
    with open(err_path, "w") as err:
        p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "daemon.cli", "worker", "--model", str(model),
                              "--port", str(port), "--device", "cpu"], stdout=err, stderr=err, env=env)  # fmt: skip
    try:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"the worker exited: {err_path.read_text()[-2000:]}")
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                               json={"model": "llama", "prompt": [1, 2, 3], "max_tokens": 1})  # fmt: skip
                if r.status_code == 200:
                    break
                raise RuntimeError(f"the worker answered {r.status_code}: {r.text[:300]}")
            except httpx.TransportError:
                time.sleep(0.01)
        first = time.perf_counter() - t0
    finally:
        p.terminate()
        p.wait(30)
    text = err_path.read_text()
    import_s, top = _imports(text)
    loaded = re.search(r"loaded .* in ([0-9.]+) s", text)
    return {"first_answer_s": round(first, 3), "import_s": round(import_s, 3), "imports": top,
            "load_s": float(loaded.group(1)) if loaded else None, "other_s": round(first - import_s, 3)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--out", default="bench/results/worker_start-2core.json")
    args = ap.parse_args()
    from daemon.manifest import publish
    from daemon.tinymodel import make_tiny_checkpoint

    out: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
                           "cpus": os.cpu_count(), "load_before": round(os.getloadavg()[0], 2), "runs": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hotswap-worker-start-") as tmp:
        model = Path(tmp) / "tiny"
        make_tiny_checkpoint(model, seed=1)
        publish(model, version="tiny-1")
        for _ in range(args.n):
            run = one_start(model, Path(tmp))
            run["load_1min"] = round(os.getloadavg()[0], 2)
            out["runs"].append(run)
            print(json.dumps(run), flush=True)
    for key in ("first_answer_s", "import_s", "other_s"):
        out[f"median_{key}"] = round(statistics.median(r[key] for r in out["runs"]), 3)
    out["load_after"] = round(os.getloadavg()[0], 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
