"""Disk reload benchmark: our in-place disk transport against safetensors `safe_open` + `param.copy_`.

In one process and one run: write the layout's shards (data drawn on the GPU), allocate the
parameters on the device, then time

* warm (files in the page cache): ours (a readers x chunk sweep, then repeats of the default)
  and the anchor (safe_open + copy_ into the same kind of parameters);
* cold (page cache dropped before each run: drop_caches, else posix_fadvise DONTNEED):
  ours, the anchor, and the raw disk read rate (dd O_DIRECT one stream and one per shard,
  plus plain buffered reads, one thread per shard), so "cold >= 90 % of raw" is judged on
  numbers from the same machine and run.

Both loads land in separate parameter sets that are compared tensor by tensor at the end.

    python -m bench.disk_reload                         # 8B layout on cuda
    python -m bench.disk_reload --layout tiny --device cpu --repeats 2   # dry run anywhere
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    LAYOUTS,
    Layout,
    alloc_params,
    cached_fraction,
    drop_page_cache,
    machine_description,
    print_table,
    sync_device,
    write_checkpoint,
    write_json,
)
from daemon.bytepipe.engine import pinned_bytes
from daemon.bytepipe.files import hash_files
from daemon.formats.checkpoint import weight_files
from daemon.hashing import HASH_ALGORITHMS
from daemon.transport.base import Expect, ExpectedFile, check_table
from daemon.transport.disk import DiskTransport
from daemon.worker.flat import checkpoint_order, pack_flat


def reference_expect(directory: Path, files: list[Path], alg: str) -> Expect:
    """The per-file digests the verify stage would record (computed once, before any timing)."""
    digests = hash_files(files, alg=alg)
    return Expect(files=tuple(ExpectedFile(f.relative_to(directory).as_posix(), d.bytes,
                                           {"crc32c": d.crc32c, alg: d.hash}) for f, d in zip(files, digests, strict=True)))  # fmt: skip


def load_ours(
    directory: Path, params: dict[str, torch.Tensor], readers: int, chunk_mb: int, expect: Expect | None = None,
    buffers: int | None = None, hash_threads: int | None = None,
) -> dict[str, Any]:
    """One reload; with `expect`, check while loading (every byte hashed and compared)."""
    device = next(iter(params.values())).device
    t0 = time.perf_counter()
    tr = DiskTransport(directory, readers=readers, chunk_bytes=chunk_mb << 20, staged=True, expect=expect,
                       check=expect is not None)  # fmt: skip
    if buffers:
        tr.check_buffers = buffers
    if hash_threads:
        tr.hash_threads = hash_threads
    check_table(tr.table(), params)
    tr.write_into(params)
    sync_device(device)
    dt = time.perf_counter() - t0
    st = tr.last_stats
    assert st is not None
    return {"seconds": dt, "bytes": st.bytes, "chunks": st.chunks, "readers": st.readers,
            "read_thread_s_max": st.extra.get("read_thread_s_max", 0.0),
            "buffer_wait_s_max": st.extra.get("buffer_wait_s_max", 0.0), "checked": tr.stats().get("checked_files", 0)}


def worker_update(
    directory: Path, params: dict[str, torch.Tensor], expect: Expect | None, *, prepared: bool,
    flat: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The worker's own update call (`daemon.worker.updates.apply_update`, minus HTTP and the probe):
    what a disk update costs inside the pause. `prepared`: as the worker's `prepare` does before
    the pause, the source opened and validated and the version read ahead (and checked) into a
    buffer of its own, so the pause is a device copy; else everything happens inside."""
    from daemon.transport.base import StagesAhead, UpdateRequest
    from daemon.worker.store import VersionRecord, WeightStore
    from daemon.worker.updates import apply_update, open_and_validate

    device = next(iter(params.values())).device
    store = WeightStore(params, device, VersionRecord("before", None, "disk"))
    store.flat = flat
    request = UpdateRequest("bench", "disk", {"path": str(directory)}, "copy", expect or Expect())
    t0 = time.perf_counter()
    opened = open_and_validate(request, store) if prepared else None
    if opened is not None and isinstance(opened.transport, StagesAhead):
        opened.transport.stage(store.params)
    sync_device(device)
    t1 = time.perf_counter()
    result = apply_update(store, request, prepared=opened)
    sync_device(device)
    return {"seconds": time.perf_counter() - t1, "prepare_s": t1 - t0, "write_ms": result["write_ms"],
            "validate_ms": result["validate_ms"], "checked": result.get("checked_files", 0),
            "read_path": result.get("read_path"), "read_ahead_skipped": result.get("read_ahead_skipped")}


def load_safetensors(files: list[Path], params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The anchor: what most engines do to reload in place."""
    from safetensors import safe_open

    device = next(iter(params.values())).device
    t0 = time.perf_counter()
    n = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = fh.get_tensor(k)
                params[k].copy_(t)
                n += t.numel() * t.element_size()
    sync_device(device)
    return {"seconds": time.perf_counter() - t0, "bytes": n}


def raw_read(files: list[Path], how: str) -> dict[str, Any]:
    """Raw disk read rate of the (cold) files: dd O_DIRECT one stream / one per file, or buffered."""
    total = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    if how == "dd_direct_serial":
        for f in files:
            subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct"],
                           check=True, capture_output=True)
    elif how == "dd_direct_parallel":
        procs = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for f in files]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"dd failed on {p.args!r}")
    elif how == "buffered_parallel":
        def read_all(f: Path) -> None:
            buf = bytearray(16 << 20)
            mv = memoryview(buf)
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(mv):
                    pass

        threads = [threading.Thread(target=read_all, args=(f,)) for f in files]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        raise ValueError(how)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "bytes": total, "gb_s": total / dt / 1e9}


def pinned_h2d_rate(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Host pinned -> device copy rate (GB/s): the floor for the warm case."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def checkpoint_ok(directory: Path, layout: Layout) -> bool:
    try:
        files = weight_files(directory)
        from daemon.formats.checkpoint import tensor_table

        table, _ = tensor_table(directory)
        return len(table) == len(layout.tensors()) and all(f.exists() for f in files)
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="llama3-8b", choices=sorted(LAYOUTS))
    ap.add_argument("--dir", type=Path, default=Path(".bench-out/disk_reload_ckpt"))
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--readers", type=int, default=16)
    ap.add_argument("--chunk-mb", type=int, default=32)
    ap.add_argument("--sweep", default="4x64,8x16,8x32,8x64,12x64,16x32,16x64",
                    help="warm readers x chunk-MiB configurations to try ('' to skip)")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--check", choices=["off", "on", "both"], default="both",
                    help="check while loading (hash every byte against the verified digests): off, on, or both")
    ap.add_argument("--hash", choices=list(HASH_ALGORITHMS), default="blake3", help="digest algorithm for --check")
    ap.add_argument("--check-sweep", default="",
                    help="check on: readers x chunk-MiB x buffers-per-reader [x hash-threads] to try, e.g. "
                         "'8x32x3,12x32x3,16x32x4,16x16x4x8' (best of 2 each)")
    ap.add_argument("--no-flat", action="store_true", help="parameters in separate allocations, not one flat buffer")
    ap.add_argument("--worker-path", action="store_true",
                    help="also time the worker's update call (apply_update), source prepared before the pause or not")
    ap.add_argument("--out", type=Path, default=Path(".bench-out/disk_reload.json"))
    ap.add_argument("--keep", action="store_true", help="keep the shards afterwards")
    args = ap.parse_args(argv)

    layout = LAYOUTS[args.layout]
    device = torch.device(args.device)
    results: dict[str, Any] = {"layout": layout.name, "tensors": len(layout.tensors()),
                               "total_bytes": layout.total_bytes, "machine": machine_description(),
                               "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    probe = next((p for p in (args.dir, *args.dir.parents) if p.exists()), Path.cwd())
    df = subprocess.run(["df", "-hT", str(probe)], capture_output=True, text=True).stdout
    results["filesystem"] = df
    print(df, flush=True)

    if not checkpoint_ok(args.dir, layout):
        shutil.rmtree(args.dir, ignore_errors=True)
        w = write_checkpoint(args.dir, layout, shards=args.shards, device=device if device.type == "cuda" else None)
        results["write_s"] = w.seconds
        print(f"wrote {w.tensors} tensors, {w.total_bytes / 1e9:.2f} GB in {w.seconds:.1f} s", flush=True)
    files = weight_files(args.dir)

    ours_p = alloc_params(layout, device)
    # as the reference worker holds its weights: one flat buffer in checkpoint order
    flat = None if args.no_flat else pack_flat(ours_p, checkpoint_order(str(args.dir)))
    ref_p = alloc_params(layout, device)
    ptrs = {n: t.data_ptr() for n, t in ours_p.items()}
    results["pinned_h2d_gb_s"] = pinned_h2d_rate(device)

    # warm: make sure the page cache holds every file, then run
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    results["warm_cached_fraction"] = cached_fraction(files)
    load_ours(args.dir, ours_p, args.readers, args.chunk_mb)  # allocates the pinned pool once
    rows: list[list[Any]] = []
    sweep: list[dict[str, Any]] = []
    for cfg in filter(None, args.sweep.split(",")):
        r, c = (int(x) for x in cfg.split("x"))
        best = min(load_ours(args.dir, ours_p, r, c)["seconds"] for _ in range(2))
        sweep.append({"readers": r, "chunk_mb": c, "seconds": best})
        rows.append([f"ours warm sweep {r} readers x {c} MiB", best, layout.total_bytes / best / 1e9])
    results["warm_sweep"] = sweep
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.check]
    expect = None
    if True in modes:
        t = time.perf_counter()
        expect = reference_expect(args.dir, files, args.hash)
        results["reference_hash_s"] = time.perf_counter() - t
        load_ours(args.dir, ours_p, args.readers, args.chunk_mb, expect)  # warm-up (BLAKE3 thread pool)
    ours_warm = [load_ours(args.dir, ours_p, args.readers, args.chunk_mb) for _ in range(args.repeats)] if False in modes else []
    checked_warm = [load_ours(args.dir, ours_p, args.readers, args.chunk_mb, expect)
                    for _ in range(args.repeats)] if expect is not None else []  # fmt: skip
    results["ours_warm_checked"] = checked_warm
    check_sweep: list[dict[str, Any]] = []
    for cfg in filter(None, args.check_sweep.split(",")) if expect is not None else []:
        r, c, b, *h = (int(x) for x in cfg.split("x"))
        runs = [load_ours(args.dir, ours_p, r, c, expect, buffers=b, hash_threads=h[0] if h else None) for _ in range(2)]
        best = min(x["seconds"] for x in runs)
        check_sweep.append({"readers": r, "chunk_mb": c, "buffers": b, "hash_threads": h[0] if h else None,
                            "seconds": best, "runs": runs})  # fmt: skip
        rows.append([f"ours warm, check on, {r} readers x {c} MiB x {b} buffers{f', {h[0]} hash threads' if h else ''}",
                     best, layout.total_bytes / best / 1e9])  # fmt: skip
    results["check_sweep"] = check_sweep
    if args.worker_path:
        wp = {}
        for label, exp in (("off", None), ("on", expect)):
            if exp is None and label == "on":
                continue
            for prep in (True, False):
                runs = [worker_update(args.dir, ours_p, exp, prepared=prep, flat=flat) for _ in range(3)]
                wp[f"check_{label}_{'prepared' if prep else 'opened_inside'}"] = runs
                best = min(x["seconds"] for x in runs)
                how = f"read ahead before it ({runs[0]['read_path']})" if prep else "read inside"
                rows.append([f"worker update call = pause, check {label}, {how} (best of 3)", best,
                             layout.total_bytes / best / 1e9])  # fmt: skip
                if prep:
                    pbest = min(x["prepare_s"] for x in runs)
                    rows.append([f"  of which before the pause (prepare: open + read ahead + check {label})", pbest,
                                 layout.total_bytes / pbest / 1e9])  # fmt: skip
        results["worker_path"] = wp
    results["check_alg"] = args.hash if expect is not None else None
    ref_warm = [load_safetensors(files, ref_p) for _ in range(max(1, min(2, args.repeats)))]
    results["ours_warm"] = ours_warm
    results["safetensors_warm"] = ref_warm

    # correctness: both parameter sets hold the same bytes; ours never reallocated
    same = all(torch.equal(ours_p[n], ref_p[n]) for n in ours_p)
    kept = all(ptrs[n] == t.data_ptr() for n, t in ours_p.items())
    results["outputs_equal"] = same
    results["data_ptrs_kept"] = kept

    cold: dict[str, Any] = {}
    if not args.skip_cold:
        method = drop_page_cache(files)
        cold["drop_method"] = method
        cold["cached_after_drop"] = cached_fraction(files)
        if ours_warm:
            cold["ours"] = load_ours(args.dir, ours_p, args.readers, args.chunk_mb)
            drop_page_cache(files)
        if expect is not None:
            cold["ours_checked"] = load_ours(args.dir, ours_p, args.readers, args.chunk_mb, expect)
            drop_page_cache(files)
        cold["safetensors"] = load_safetensors(files, ref_p)
        for how in ("dd_direct_serial", "dd_direct_parallel", "buffered_parallel"):
            drop_page_cache(files)
            try:
                cold[how] = raw_read(files, how)
            except Exception as exc:  # dd without O_DIRECT support (tmpfs), etc.
                cold[how] = {"error": str(exc)}
        raws = [v["gb_s"] for k, v in cold.items() if isinstance(v, dict) and "gb_s" in v]
        cold["raw_best_gb_s"] = max(raws) if raws else float("nan")
        first = cold.get("ours") or cold["ours_checked"]
        cold["ours_vs_raw"] = layout.total_bytes / first["seconds"] / 1e9 / cold["raw_best_gb_s"]
    results["cold"] = cold

    gb = layout.total_bytes / 1e9
    best_ref = min(r["seconds"] for r in ref_warm)
    if ours_warm:
        best_ours = min(r["seconds"] for r in ours_warm)
        rows.append([f"ours warm, check off (best of {len(ours_warm)}, {args.readers} readers x {args.chunk_mb} MiB)",
                     best_ours, gb / best_ours])  # fmt: skip
    if checked_warm:
        best_chk = min(r["seconds"] for r in checked_warm)
        rows.append([f"ours warm, check on ({args.hash}, best of {len(checked_warm)})", best_chk, gb / best_chk])
        if ours_warm:
            results["check_overhead"] = best_chk / best_ours - 1
    rows.append(["safetensors safe_open + copy_ warm (best)", best_ref, gb / best_ref])
    if cold:
        for key, label in (("ours", "ours cold"), ("ours_checked", "ours cold, check on"), ("safetensors", "safetensors safe_open + copy_ cold"),
                           ("dd_direct_serial", "raw: dd O_DIRECT, one stream"),
                           ("dd_direct_parallel", "raw: dd O_DIRECT, one per shard"),
                           ("buffered_parallel", "raw: buffered read, one thread per shard")):
            v = cold.get(key, {})
            if "seconds" in v:
                rows.append([label, v["seconds"], gb / v["seconds"]])
    print_table(f"disk reload, {layout.name}: {len(layout.tensors())} tensors, {gb:.2f} GB, device {device}",
                ["what", "seconds", "GB/s"], rows)
    if "check_overhead" in results:
        print(f"\ncheck while loading costs {results['check_overhead'] * 100:+.1f} % on the warm reload "
              f"(goal: within 10 %)")
    print(f"\npinned host->device: {results['pinned_h2d_gb_s']:.1f} GB/s; pinned pool "
          f"{pinned_bytes() >> 20} MiB; outputs equal: {same}; data_ptrs kept: {kept}")
    if cold:
        print(f"cold: page cache dropped with {cold['drop_method']} (resident after drop: "
              f"{cold['cached_after_drop']}); ours = {cold['ours_vs_raw'] * 100:.0f} % of best raw read "
              f"({cold['raw_best_gb_s']:.2f} GB/s)")
    write_json(args.out, results)
    print(f"wrote {args.out}")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if same and kept else 1


if __name__ == "__main__":
    raise SystemExit(main())
