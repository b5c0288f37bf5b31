"""The ipc copy's floor on one GPU (issue 41): one version's bytes from one device buffer into another,
by method, and the checksum that follows it inside the pause.

    python -m bench.copy_probe --gb 16.06 --device cuda:0 --rounds 10 --out DIR

Methods (each a median of `--rounds` after one warm-up; CUDA events around the work):
- `copy_`: one `dst.copy_(src)` on uint8 views (what `copyplan.run_copies` issues for one run:
  a device-to-device cudaMemcpyAsync);
- `copy_ x K on S streams`: the same bytes as K slices spread over S streams;
- `triton BLOCK/warps`: a Triton kernel moving int64 words, when Triton is importable;
- `checksum (torch)`: `copyplan.checksum` over the destination, one segment (the pause's check);
- `checksum (triton)`: per-block int64 wrapping sums, then one sum, when Triton is importable.
GB/s counts the bytes read plus the bytes written. Without CUDA it runs a small CPU dry run.
Prints a table and writes copy_probe.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from daemon.transport.copyplan import checksum


def _timed(fn: Callable[[], Any], rounds: int, cuda: bool) -> list[float]:
    fn()  # warm-up (and Triton's compile)
    out = []
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _triton_methods(src: torch.Tensor, dst: torch.Tensor) -> dict[str, Callable[[], Any]]:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return {}

    @triton.jit
    def copy_words(s_ptr, d_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: N803
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(d_ptr + offs, tl.load(s_ptr + offs, mask=mask, eviction_policy="evict_first"), mask=mask,
                 cache_modifier=".cs")  # fmt: skip

    @triton.jit
    def sum_words(s_ptr, out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # noqa: N803
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(s_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
        tl.store(out_ptr + pid, tl.sum(x, axis=0))

    s64, d64 = src.view(torch.int64), dst.view(torch.int64)
    n = s64.numel()
    methods: dict[str, Callable[[], Any]] = {}
    for block, warps in ((2048, 4), (8192, 8), (16384, 16)):
        grid = (triton.cdiv(n, block),)

        def run(block: int = block, warps: int = warps, grid: tuple[int] = grid) -> None:
            copy_words[grid](s64, d64, n, BLOCK=block, num_warps=warps)

        methods[f"triton copy {block}/{warps}"] = run
    sblock = 16384
    partial = torch.empty(triton.cdiv(n, sblock), dtype=torch.int64, device=src.device)

    def tsum() -> Any:
        sum_words[(partial.numel(),)](d64, partial, n, BLOCK=sblock, num_warps=16)
        return partial.sum()

    methods["checksum (triton)"] = tsum
    return methods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=16.06, help="bytes to move, in GB (the 8B layout: 16.06)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=".bench-out/copy_probe")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    device = torch.device(args.device if cuda else "cpu")
    nbytes = int(args.gb * 1e9) // 4096 * 4096 if cuda else 64 << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    methods: dict[str, Callable[[], Any]] = {"copy_": lambda: dst.copy_(src)}
    if cuda:
        for k, s in ((8, 2), (16, 4)):
            streams = [torch.cuda.Stream(device) for _ in range(s)]
            bounds = [nbytes * i // k // 4096 * 4096 for i in range(k)] + [nbytes]

            def run(streams: list[torch.cuda.Stream] = streams, bounds: list[int] = bounds) -> None:
                main_stream = torch.cuda.current_stream(device)
                for st in streams:
                    st.wait_stream(main_stream)
                for i in range(len(bounds) - 1):
                    with torch.cuda.stream(streams[i % len(streams)]):
                        dst[bounds[i] : bounds[i + 1]].copy_(src[bounds[i] : bounds[i + 1]])
                for st in streams:
                    main_stream.wait_stream(st)

            methods[f"copy_ x {k} on {s} streams"] = run
    triton = _triton_methods(src, dst) if cuda else {}  # built (and compiled) once
    methods.update({k: v for k, v in triton.items() if k.startswith("triton copy")})
    methods["checksum (torch)"] = lambda: checksum([dst], [True], 8)
    methods.update({k: v for k, v in triton.items() if k.startswith("checksum")})
    rows: list[dict[str, Any]] = []
    for name, fn in methods.items():
        try:
            times = _timed(fn, args.rounds, cuda)
        except Exception as exc:  # noqa: BLE001 - a method that cannot run here is reported, not fatal
            rows.append({"method": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        if name.startswith("checksum"):
            dst.copy_(src)
            good = checksum([dst], [True], 8)
            ok = bool(int(fn()) == int(good)) if not name.endswith("(torch)") else True
        else:
            dst.zero_()
            fn()
            ok = bool(torch.equal(dst, src))
        med = statistics.median(times)
        moved = nbytes * (1 if name.startswith("checksum") else 2)
        rows.append({"method": name, "median_ms": round(med, 3), "min_ms": round(min(times), 3),
                     "gb_s": round(moved / med / 1e6, 1), "equal": ok, "times_ms": [round(t, 3) for t in times]})  # fmt: skip
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "bytes": nbytes, "rows": rows}  # fmt: skip
    print(f"{doc['gpu']}: {nbytes / 1e9:.2f} GB, medians of {args.rounds}")
    for r in rows:
        if "error" in r:
            print(f"  {r['method']:<28} error: {r['error']}")
        else:
            print(f"  {r['method']:<28} {r['median_ms']:>9.3f} ms  {r['gb_s']:>8.1f} GB/s  equal={r['equal']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "copy_probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
