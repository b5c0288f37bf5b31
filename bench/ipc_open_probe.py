"""Where the forward check's and the worker prepare's time goes on a GPU (issue 41): the cost of
mapping a loader's staged buffer in another process, and of the canary's forward on bound tensors.

    python -m bench.ipc_open_probe --layout llama3-8b --device cuda:0 --out DIR

Measures, for one buffer the size of the layout:
- the loader's side: cuMemAlloc and cuMemFree of the buffer;
- another process (as a worker or the check process is): cuIpcOpenMemHandle, a first read through
  the mapping, and the close (with the synchronize before it), repeated;
- the canary in this process: the skeleton's build, bind and one forward of the three default
  prompts on views of the buffer (zeros: finite logits), repeated.
On a machine without CUDA it runs the canary part on the CPU with the tiny layout (a dry run).
Prints a table and writes ipc_open_probe-<layout>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import LAYOUTS

CHILD = r"""
import json, sys, time, torch
from daemon.handoff.cuda import ImportedBuffer
uuid, handle, nbytes, rounds = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.cuda.init(); torch.zeros(1, device="cuda")  # the context, outside the timing (a worker has one)
out = []
for _ in range(rounds):
    t0 = time.perf_counter(); buf = ImportedBuffer(uuid, handle, nbytes); t1 = time.perf_counter()
    x = buf.tensor(); s = int(x[:4096].sum()) + int(x[-4096:].sum()); torch.cuda.synchronize(); t2 = time.perf_counter()
    del x; closed = buf.close(); t3 = time.perf_counter()
    out.append({"open_ms": (t1 - t0) * 1e3, "first_read_ms": (t2 - t1) * 1e3, "close_ms": (t3 - t2) * 1e3, "closed": closed})
print(json.dumps(out))
"""


def _ms(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, r


def ipc_part(nbytes: int, rounds: int) -> dict[str, Any]:
    from daemon.handoff.cuda import DeviceBuffer

    alloc_ms, buf = _ms(lambda: DeviceBuffer(0, nbytes))
    handle_ms, handle = _ms(buf.ipc_handle)
    proc = subprocess.run([sys.executable, "-c", CHILD, buf.device_uuid, handle.hex(), str(nbytes), str(rounds)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"child failed: {proc.stderr[-2000:]}")
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    free_ms, _ = _ms(buf.free)
    return {"alloc_ms": alloc_ms, "handle_ms": handle_ms, "free_ms": free_ms, "child": child}


def canary_part(layout_name: str, device: str, rounds: int) -> dict[str, Any]:
    from daemon.checks.base import DEFAULT_TEXTS
    from daemon.checks.canary import CANARIES, bind, run

    layout = LAYOUTS[layout_name]
    doc = layout.hf_config()
    build_ms, canary = _ms(lambda: CANARIES.get(doc, device, "probe"))
    dtype = getattr(torch, doc["torch_dtype"])
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    state, off = {}, 0
    for name, shape in layout.tensors():
        n = 1
        for s in shape:
            n *= s
        nb = n * torch.tensor([], dtype=dtype).element_size()
        state[name] = flat[off : off + nb].view(dtype).view(shape)
        off += nb
    prompts = [[(7 * i + j) % layout.vocab for j in range(len(t.split()) + 3)] for i, t in enumerate(DEFAULT_TEXTS)]
    runs = []
    for _ in range(rounds):
        bind_ms, bound = _ms(lambda: bind(canary, state, "probe"))
        run_ms, _logits = _ms(lambda b=bound: run(canary, b, prompts))
        runs.append({"bind_ms": bind_ms, "run_ms": run_ms})
    return {"build_ms": build_ms, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="llama3-8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path(".bench-out"))
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and a.device.startswith("cuda")
    layout = a.layout if cuda else "tiny"
    device = a.device if cuda else "cpu"
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layout": layout,
                              "device": torch.cuda.get_device_name(0) if cuda else "cpu"}  # fmt: skip
    if cuda:
        result["ipc"] = ipc_part(LAYOUTS[layout].total_bytes, a.rounds)
    result["canary"] = canary_part(layout, device, a.rounds)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"ipc_open_probe-{layout}.json").write_text(json.dumps(result, indent=1))
    med = statistics.median
    print(f"| {layout} on {result['device']} | ms |\n|---|---:|")
    if cuda:
        ipc, child = result["ipc"], result["ipc"]["child"]
        print(f"| cuMemAlloc | {ipc['alloc_ms']:.1f} |\n| cuMemFree | {ipc['free_ms']:.1f} |")
        for k in ("open_ms", "first_read_ms", "close_ms"):
            print(f"| other process: {k[:-3]} (median of {len(child)}; first {child[0][k]:.1f}) | {med(c[k] for c in child):.1f} |")
    c = result["canary"]
    print(f"| canary build | {c['build_ms']:.1f} |")
    for k in ("bind_ms", "run_ms"):
        print(f"| canary {k[:-3]} (median of {len(c['runs'])}; first {c['runs'][0][k]:.1f}) | {med(r[k] for r in c['runs']):.1f} |")


if __name__ == "__main__":
    main()
