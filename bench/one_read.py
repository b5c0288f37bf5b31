"""The verify pass's one read, alone: CRC32C + BLAKE3 of every byte and a staged copy on the device,
over a sweep of reader threads x chunk size (issue 41: its goal is <= 850 ms for the 8B layout).

Three reads of the same files, from the page cache, the layout written first:

    staged     `daemon.bytepipe.stage_files`, as the crc32c check calls it on a disk host
    loader     the loader's staging read for ipc hosts (`read_into_devices` with its check: BLAKE3
               in file order, and CRC32C teed, as when the daemon verifies in the loader)
    hash only  `hash_files`: no device copy, so the copy's share of the time shows

    python -m bench.one_read                                     # 8B layout on cuda:0
    python -m bench.one_read --layout tiny --device cpu --sweep 2x8   # dry run anywhere
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import LAYOUTS, machine_description, print_table, write_checkpoint, write_json
from daemon.bytepipe import stage_files
from daemon.bytepipe.files import hash_files
from daemon.formats.checkpoint import weight_files

MIB = 1 << 20


def loader_read(root: Path, device: str, threads: int, chunk_mb: int) -> float:
    """The loader's GPU staging read (daemon.loader.backends.CudaBackend.fill) with the verify tee."""
    from daemon.bytepipe.check import LoadCheck
    from daemon.bytepipe.expect import Expect
    from daemon.bytepipe.sinks import Crcs
    from daemon.formats import tensor_table
    from daemon.handoff.descriptor import layout_tensors
    from daemon.loader.backends import _Tee
    from daemon.loader.staging import PinnedPool, check_ranges, plan_reads, read_into_devices

    table = tensor_table(root)[0]
    slots, size = layout_tensors((n, loc.entry.dtype, tuple(loc.entry.shape)) for n, loc in table.items())
    dest = torch.empty(size, dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    jobs = plan_reads(table, slots, chunk=chunk_mb * MIB)
    check = LoadCheck(root, Expect(files=()), check_ranges(jobs), threads=threads, compute_alg="blake3")
    try:
        read_into_devices(jobs, [dest], PinnedPool(threads, chunk_mb * MIB), _Tee(check, Crcs()))
        check.finish()
    finally:
        check.close()
    if dest.is_cuda:
        torch.cuda.synchronize(dest.device)
    return time.perf_counter() - t0


def one(root: Path, rels: list[str], device: str, threads: int, chunk_mb: int, kind: str) -> float:
    if kind == "loader":
        return loader_read(root, device, threads, chunk_mb)
    t0 = time.perf_counter()
    if kind == "staged":
        _digests, copy = stage_files(root, rels, device, alg="blake3", crc=True, threads=threads, chunk=chunk_mb * MIB)
        took = time.perf_counter() - t0
        copy.release()
    else:
        hash_files([root / r for r in rels], alg="blake3", threads=threads, chunk=chunk_mb * MIB)
        took = time.perf_counter() - t0
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="llama3-8b", choices=sorted(LAYOUTS))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hotswap-one-read"))
    ap.add_argument("--sweep", default="16x8,8x32,16x32,16x2,16x4,16x16,12x8,8x8",
                    help="threads x chunk-MiB to try, in order (the first is the disk path's default, one per core x 8 MiB; 8x32 the loader's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the written layout in --dir")
    ap.add_argument("--out", type=Path, default=Path(".bench-out/one_read.json"))
    args = ap.parse_args()
    layout = LAYOUTS[args.layout]
    on_gpu = torch.device(args.device).type == "cuda"
    w = write_checkpoint(args.dir, layout, shards=4, device=args.device if on_gpu else None)
    rels = [f.relative_to(args.dir).as_posix() for f in weight_files(args.dir)]
    one(args.dir, rels, args.device, os.cpu_count() or 1, 8, "hash only")  # every byte in the page cache
    rows: list[list[Any]] = []
    sweep: list[dict[str, Any]] = []
    for cfg in filter(None, args.sweep.split(",")):
        threads, chunk_mb = (int(x) for x in cfg.split("x"))
        runs = {kind: sorted(one(args.dir, rels, args.device, threads, chunk_mb, kind) for _ in range(args.repeats))
                for kind in ("staged", "loader", "hash only") if kind != "loader" or on_gpu}  # fmt: skip
        med = {k: v[len(v) // 2] for k, v in runs.items()}
        sweep.append({"threads": threads, "chunk_mb": chunk_mb, "runs_s": runs, "median_s": med})
        rows.append([f"{threads} threads x {chunk_mb} MiB", med["staged"] * 1e3, med.get("loader", float("nan")) * 1e3,
                     med["hash only"] * 1e3, w.total_bytes / med["staged"] / 1e9])  # fmt: skip
    print_table(f"the one read, {layout.name} ({w.total_bytes / 1e9:.2f} GB, page cache), CRC32C + BLAKE3, "
                f"medians of {args.repeats}", ["config", f"staged on {args.device} ms", "loader ms", "hash only ms", "GB/s staged"],
                rows)  # fmt: skip
    write_json(args.out, {"layout": layout.name, "bytes": w.total_bytes, "device": args.device,
                          "machine": machine_description(), "sweep": sweep})  # fmt: skip
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
