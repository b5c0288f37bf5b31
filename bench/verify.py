"""Verification throughput from the page cache: CRC32C, the strong hash, both (goal >= 5 GB/s on the CPU).

Writes real safetensors shards of random bytes (default 4 x 1 GiB) into a temporary
folder, publishes a format-2 manifest, reads every shard once so it sits in the page
cache (checked with mincore), then measures, best of --repeats:

- ceilings: one call over an in-memory 256 MiB buffer: crc32c, blake3 (1 and N threads),
  sha256 (hashlib, 1 thread);
- our engine (`daemon.hashing.hash_files`, one read of each chunk) with 1 and --threads
  threads: CRC32C only, BLAKE3 only, SHA-256 only, CRC32C + BLAKE3, CRC32C + SHA-256;
- the byte pipeline against today's engine (`bench/hash_files_reference.py`, the `hash_files`
  of d23160d), CRC32C + BLAKE3 with --threads threads, run alternately in the same run (median
  of --repeats each; the pipeline must be within 5 %);
- the verify stage as the daemon runs it: run_checks with manifest + headers + crc32c on
  a BLAKE3 and on a SHA-256 manifest (whole path: listing, manifest parse, headers, hashing).

    .venv/bin/python -m bench.verify [--size-gb 4] [--shards 4] [--threads N] [--out F] [--compare-only]

Every computed hash is asserted equal to the manifest's. The machine's load average is
recorded too: helpers sharing a small machine skew it.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import blake3
import crc32c
import numpy as np

from bench.common import cached_fraction, machine_description, print_table, write_json
from bench.hash_files_reference import hash_files as reference_hash_files
from daemon.bytepipe.files import hash_files
from daemon.checks import CheckSettings, run_checks
from daemon.hashing import CHUNK_BYTES
from daemon.manifest import MANIFEST_NAME, publish

BLOCK = 64 * 1024 * 1024  # one U8 tensor per 64 MiB of shard


def write_shards(directory: Path, total_bytes: int, shards: int, seed: int = 0) -> list[Path]:
    """Safetensors shards of random U8 blocks; a correct index; config-free (checks here need none)."""
    rng = np.random.default_rng(seed)
    per_shard = total_bytes // shards
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        sizes = [BLOCK] * (per_shard // BLOCK) + ([per_shard % BLOCK] if per_shard % BLOCK else [])
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for j, size in enumerate(sizes):
            tensor = f"shard{i}.block{j}"
            header[tensor] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
            weight_map[tensor] = name
            offset += size
        body = json.dumps(header).encode()
        body += b" " * (-len(body) % 8)
        path = directory / name
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(body)) + body)
            for size in sizes:
                f.write(rng.bytes(size))
        paths.append(path)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": per_shard * shards}, "weight_map": weight_map})
    )
    return paths


def warm(paths: list[Path]) -> None:
    buf = bytearray(CHUNK_BYTES)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process, user + system
    return r.ru_utime + r.ru_stime


def best_of(repeats: int, fn: Callable[[], Any]) -> tuple[float, float, float, Any]:
    """(best wall s, median wall s, least CPU s, result). CPU seconds say what the work costs
    when other processes share the cores (wall time then mostly measures the wait)."""
    times, cpus, result = [], [], None
    for _ in range(repeats):
        c0, t0 = _cpu_s(), time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        cpus.append(_cpu_s() - c0)
    return min(times), statistics.median(times), min(cpus), result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.verify", description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=4.0, help="total checkpoint size, GiB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--no-sha256", dest="sha256", action="store_false", help="leave the (slow) SHA-256 rows out"
    )
    ap.add_argument(
        "--dir", type=Path, help="where to write the shards (default: a new temp dir, removed after)"
    )
    ap.add_argument("--out", type=Path, default=Path(".bench-out/verify.json"))
    ap.add_argument("--compare-only", action="store_true",
                    help="only the pipeline against the reference engine (CRC32C + BLAKE3)")
    args = ap.parse_args(argv)

    total = int(args.size_gb * 2**30)
    workdir = Path(tempfile.mkdtemp(prefix="hotswap-verify-bench-", dir=args.dir))
    load_before = os.getloadavg()
    try:
        t0 = time.perf_counter()
        paths = write_shards(workdir, total, args.shards)
        manifest = publish(workdir, version="bench")
        write_s = time.perf_counter() - t0
        nbytes = sum(p.stat().st_size for p in paths)
        warm(paths)
        resident = cached_fraction(paths)

        rows: list[dict[str, Any]] = []
        expected = {f.path: f for f in manifest.files}
        compare = compare_engines(paths, expected, args.threads, args.repeats, nbytes)
        rows += compare["rows"]
        if args.compare_only:
            return _report(args, argv, rows, compare, nbytes, resident, load_before, write_s)
        ceiling_buf = np.random.default_rng(1).bytes(256 * 2**20)
        ceilings: list[tuple[str, Callable[[], Any]]] = [
            ("crc32c.crc32c, 1 thread", lambda: crc32c.crc32c(ceiling_buf)),
            ("blake3, 1 thread", lambda: blake3.blake3(ceiling_buf).digest()),
            (
                f"blake3, max_threads={args.threads}",
                lambda: blake3.blake3(ceiling_buf, max_threads=args.threads).digest(),
            ),
            ("hashlib.sha256, 1 thread", lambda: hashlib.sha256(ceiling_buf).digest()),
        ]
        for what, fn in ceilings:
            best, med, cpu, _ = best_of(args.repeats, fn)
            rows.append(
                {
                    "what": f"ceiling: {what}, in-memory 256 MiB",
                    "bytes": 256 * 2**20,
                    "best_s": best,
                    "cpu_s": cpu,
                    "median_s": med,
                }
            )
        ceiling_buf = b""  # release 256 MiB before the file runs

        modes = [
            ("CRC32C only", None, True),
            ("BLAKE3 only", "blake3", False),
            ("SHA-256 only", "sha256", False),
            ("CRC32C + BLAKE3 (one read)", "blake3", True),
            ("CRC32C + SHA-256 (one read)", "sha256", True),
        ]
        sha_expected = (
            {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths} if args.sha256 else {}
        )
        for label, alg, crc in modes:
            if alg == "sha256" and not args.sha256:
                continue
            for threads in sorted({1, args.threads}):
                best, med, cpu, got = best_of(
                    args.repeats, functools.partial(hash_files, paths, alg=alg, crc=crc, threads=threads)
                )
                for p, d in zip(paths, got, strict=True):
                    assert not crc or d.crc32c == expected[p.name].crc32c, "engine disagrees on crc32c"
                    if alg == "blake3":
                        assert d.hash == expected[p.name].hash, "engine disagrees on blake3"
                    if alg == "sha256":
                        assert d.hash == sha_expected[p.name], "engine disagrees on sha256"
                rows.append(
                    {
                        "what": f"hash_files {label}, page cache, {threads} thread(s)",
                        "bytes": nbytes,
                        "best_s": best,
                        "cpu_s": cpu,
                        "median_s": med,
                    }
                )
        settings = CheckSettings(enabled=("manifest", "headers", "crc32c"), crc_threads=args.threads)
        for alg in ("blake3", "sha256") if args.sha256 else ("blake3",):
            if alg != "blake3":
                (workdir / MANIFEST_NAME).unlink()
                publish(workdir, version="bench", hash_alg=alg)
            best, med, cpu, report = best_of(args.repeats, lambda: run_checks(workdir, settings))
            assert report.ok, report.reason
            assert report.results[-1].detail["hash_alg"] == alg
            rows.append(
                {
                    "what": f"run_checks(manifest+headers+crc32c), {alg} manifest, {args.threads} thread(s)",
                    "bytes": report.total_bytes,
                    "best_s": best,
                    "cpu_s": cpu,
                    "median_s": med,
                }
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    return _report(args, argv, rows, compare, nbytes, resident, load_before, write_s)


def compare_engines(paths: list[Path], expected: dict[str, Any], threads: int, repeats: int,
                    nbytes: int) -> dict[str, Any]:  # fmt: skip
    """CRC32C + BLAKE3 through the byte pipeline and through the reference engine, alternating
    (A B A B ...) so drift on a shared machine hits both alike; medians compared."""
    engines = {"pipeline": hash_files, "reference": reference_hash_files}
    times: dict[str, list[float]] = {k: [] for k in engines}
    cpus: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(repeats):
        for name in (list(engines) if i % 2 == 0 else list(reversed(engines))):
            c0, t0 = _cpu_s(), time.perf_counter()
            got = engines[name](paths, alg="blake3", crc=True, threads=threads)
            times[name].append(time.perf_counter() - t0)
            cpus[name].append(_cpu_s() - c0)
            for p, d in zip(paths, got, strict=True):
                assert d.crc32c == expected[p.name].crc32c and d.hash == expected[p.name].hash, name
    rows = [{"what": f"{'byte pipeline (hash_files)' if k == 'pipeline' else 'reference hash_files (d23160d)'}"
                     f" CRC32C + BLAKE3, {threads} thread(s)",
             "bytes": nbytes, "best_s": min(times[k]), "median_s": statistics.median(times[k]),
             "cpu_s": min(cpus[k]), "times_s": times[k]} for k in engines]  # fmt: skip
    ratio = statistics.median(times["reference"]) / statistics.median(times["pipeline"])
    return {"rows": rows, "pipeline_over_reference": ratio, "within_5_percent": ratio >= 0.95}


def _report(args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]], compare: dict[str, Any],
            nbytes: int, resident: float | None, load_before: tuple[float, float, float], write_s: float) -> int:  # fmt: skip
    for r in rows:
        r["gb_per_s"] = r["bytes"] / r["best_s"] / 1e9
        r["gb_per_s_median"] = r["bytes"] / r["median_s"] / 1e9
        r["gb_per_cpu_s"] = r["bytes"] / r["cpu_s"] / 1e9 if r["cpu_s"] > 0 else None
    print_table(
        f"Verification, {nbytes / 1e9:.2f} GB in {args.shards} shards, page cache ({resident:.0%} resident)"
        if resident is not None
        else "Verification",
        ["what", "GB", "best s", "GB/s (best)", "GB/s (median)", "GB per CPU-s"],
        [
            [r["what"], r["bytes"] / 1e9, r["best_s"], r["gb_per_s"], r["gb_per_s_median"], r["gb_per_cpu_s"]]
            for r in rows
        ],
    )
    goal = 5.0
    verify_rate = next((r["gb_per_s"] for r in rows if r["what"].startswith("run_checks")), 0.0)
    print(
        f"\nbyte pipeline / reference hash_files, CRC32C + BLAKE3, medians: {compare['pipeline_over_reference']:.3f}"
        f" ({'within' if compare['within_5_percent'] else 'NOT within'} 5 %)"
    )
    if verify_rate:
        print(f"goal >= {goal} GB/s from page cache: {'met' if verify_rate >= goal else 'NOT met'} "
              f"({verify_rate:.2f} GB/s through run_checks, CRC32C + BLAKE3)")
    print(f"load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}")
    write_json(
        args.out,
        {
            "bench": "verify",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine_description()
            | {"loadavg_before": load_before, "loadavg_after": os.getloadavg()},
            "command": "python -m bench.verify " + " ".join(argv if argv is not None else sys.argv[1:]),
            "bytes": nbytes,
            "shards": args.shards,
            "threads": args.threads,
            "repeats": args.repeats,
            "write_and_publish_s": write_s,
            "page_cache_resident": resident,
            "goal_gb_per_s": goal,
            "goal_met": verify_rate >= goal,
            "pipeline_over_reference": compare["pipeline_over_reference"],
            "within_5_percent": compare["within_5_percent"],
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
