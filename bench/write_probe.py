"""How fast can a host put a rebuilt version's bytes into fresh files (issue 38: the delta rebuild's
short phase is writing 16 GB into new page-cache pages)? Each way writes the same bytes, in 16 MB
chunks from a pool of threads, into `--files` new files of `--gb` GB in all:

- pwrite:        os.pwrite of each chunk (today's rebuild: decoders write their chunk themselves);
- mmap:          ftruncate, map the file shared, copy each chunk into the mapping (no inode lock);
- mmap+falloc:   the same after fallocate (blocks reserved up front, no per-page allocation later);
- mmap+populate: the same, with MADV_POPULATE_WRITE on each chunk's range before the copy;
- overwrite:     pwrite into the files of the previous way, still in the page cache (pages reused).

Between ways the files are synced and removed, so dirty pages of one never slow the next (the sync
is outside the timing). Prints a table and writes write_probe.json.

    python -m bench.write_probe --dir /tmp/wp --gb 16 --files 4 --threads 16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

CHUNK = 16 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _chunks(sizes: list[int]) -> list[tuple[int, int, int]]:
    return [(i, off, min(CHUNK, size - off)) for i, size in enumerate(sizes) for off in range(0, size, CHUNK)]


def write_files(way: str, paths: list[Path], sizes: list[int], src: np.ndarray, threads: int) -> float:
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | (0 if way == "overwrite" else os.O_TRUNC), 0o644) for p in paths]
    maps: list[Any] = []
    try:
        for fd, size in zip(fds, sizes, strict=True):
            if way == "mmap+falloc":
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        if way.startswith("mmap"):
            maps = [mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) for fd, size in zip(fds, sizes, strict=True)]
        arrays = [np.frombuffer(m, np.uint8) for m in maps]

        def one(job: tuple[int, int, int]) -> None:
            i, off, n = job
            data = src[(off // CHUNK) % 4 * CHUNK :][:n]
            if arrays:
                if way == "mmap+populate":
                    maps[i].madvise(MADV_POPULATE_WRITE, off, n)
                np.copyto(arrays[i][off : off + n], data)
            else:
                done = 0
                while done < n:
                    done += os.pwrite(fds[i], data.data[done:], off + done)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, _chunks(sizes)))
        arrays.clear()  # no view of a mapping may outlive it
    finally:
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/write-probe"))
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(".bench-out"))
    a = ap.parse_args()
    total = int(a.gb * (1 << 30)) // CHUNK * CHUNK
    sizes = [total // a.files] * a.files
    src = np.random.default_rng(0).integers(0, 256, 4 * CHUNK, dtype=np.uint8)
    shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True)
    paths = [a.dir / f"f{i}.bin" for i in range(a.files)]
    ways = ["pwrite", "mmap", "mmap+falloc", "mmap+populate"]
    runs: dict[str, list[float]] = {w: [] for w in [*ways, "overwrite"]}
    for _ in range(a.rounds):
        for way in ways:
            runs[way].append(write_files(way, paths, sizes, src, a.threads))
            if way == "mmap":  # the files still cached: overwrite them in place
                runs["overwrite"].append(write_files("overwrite", paths, sizes, src, a.threads))
            os.sync()
            for p in paths:
                p.unlink()
    shutil.rmtree(a.dir, ignore_errors=True)
    gb = total / 1e9
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "bytes": total, "files": a.files,
              "threads": a.threads, "cpus": os.cpu_count(), "seconds": runs}  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "write_probe.json").write_text(json.dumps(result, indent=1))
    print(f"| way ({gb:.1f} GB, {a.files} files, {a.threads} threads) | s (median of {a.rounds}) | GB/s |\n|---|---:|---:|")
    for way, s in runs.items():
        m = statistics.median(s)
        print(f"| {way} | {m:.2f} | {gb / m:.1f} |")


if __name__ == "__main__":
    main()
