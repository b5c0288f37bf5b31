"""Broadcast update vs disk update of the same weights, into a separate worker process.

1. write two versions of the layout (v1, v2) as safetensors shards;
2. start a worker-like process (this file, `--role worker`) holding the layout's parameters on
   `--device`; it updates them exactly as the reference worker's update path does, minus HTTP:
   disk = `DiskTransport(dir)`: table + `check_table` + `write_into` (page cache warm after the
   first round); broadcast = `broadcast_worker.join` + `open_update` + the ready vote + bucketed
   receive into the parameters + finite check + digest + done vote + abort;
3. this process is the trainer (rank 0, `bucket_broadcast`/`vote` from the same module as
   `daemon.client.broadcast.BroadcastPush`), sending the other version each round;
4. both sides are timed; the worker's parameters are compared with the disk version afterwards.

    OMP_NUM_THREADS=1 python -m bench.broadcast --layout small --out .bench-out/broadcast   # CPU, gloo
    python -m bench.broadcast --layout llama3-8b --device cuda:1 --trainer-device cuda:0 \\
        --out $OUT/broadcast                                                        # 2 GPUs, NCCL

Prints a table and writes `<out>/broadcast.json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from bench.common import LAYOUTS, alloc_params, machine_description, print_table, write_checkpoint, write_json
from daemon.transport.base import TORCH_TO_ST, UpdateRequest, check_table
from daemon.transport.broadcast import buckets, parse_table
from daemon.transport.broadcast_worker import bucket_broadcast, join, open_update, vote
from daemon.transport.disk import DiskTransport
from daemon.transport.group_spec import GroupSpec

REPO = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table_of(tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": TORCH_TO_ST[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape)}
            for n, t in tensors.items()]  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    layout = LAYOUTS[args.layout]
    params = alloc_params(layout, device)
    store = SimpleNamespace(params=params)
    dirs = [Path(args.dir) / "v1", Path(args.dir) / "v2"]
    disk_s: list[float] = []
    for i in range(args.repeats + 1):  # round 0 warms the page cache
        t0 = time.perf_counter()
        disk = DiskTransport(dirs[i % 2])
        check_table(disk.table(), params)
        disk.write_into(params)
        _sync(device)
        disk.close()
        if i:
            disk_s.append(time.perf_counter() - t0)
    table = json.loads(Path(args.dir, "table.json").read_text())
    recv_s: list[float] = []
    join_s: list[float] = []
    wire_s: list[float] = []
    stats: list[dict[str, Any]] = []
    for i in range(args.repeats + 1):
        spec = GroupSpec("127.0.0.1", args.port, 1, 2, args.backend, f"s{i}", args.timeout_s)
        t0 = time.perf_counter()
        joined = join(spec, str(dirs[0]), device)
        request = UpdateRequest(f"b{i}", "broadcast", {"group_name": f"s{i}", "table": table,
                                                       "bucket_bytes": args.bucket_mb << 20})  # fmt: skip
        tr = open_update(request, store)
        try:
            tr.open()  # type: ignore[attr-defined]
            check_table(tr.table(), params)
            tr.write_into(params)
            _sync(device)
        finally:
            tr.close()
        if i:
            recv_s.append(time.perf_counter() - t0)
            join_s.append(joined["join_ms"] / 1e3)
            wire_s.append(tr.stats()["receive_ms"] / 1e3)
            stats.append(tr.stats())
    # the last broadcast sent v{(repeats % 2) + 1}: compare with that version on disk
    want = load_file(str(next(dirs[args.repeats % 2].glob("*.safetensors"))))
    equal = all(torch.equal(params[n].cpu(), t) for n, t in want.items())
    print(json.dumps({"disk_s": disk_s, "broadcast_s": recv_s, "join_s": join_s, "receive_s": wire_s,
                      "worker_stats": stats, "equal_to_disk": equal}), flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="tiny", choices=sorted(LAYOUTS))
    ap.add_argument("--device", default="cpu", help="the worker's device: cpu or cuda:N")
    ap.add_argument("--trainer-device", default=None, help="the trainer's device (default: --device)")
    ap.add_argument("--backend", default=None, help="gloo (default on CPU) or nccl (default on CUDA)")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder, removed)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--role", default="trainer", choices=["trainer", "worker"])
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device.startswith("cuda") else "gloo")
    if args.role == "worker":
        worker(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = None if args.dir else tempfile.mkdtemp(prefix="hotswap-bench-broadcast-")
    args.dir = args.dir or scratch
    try:
        return _trainer(args, out)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _trainer(args: argparse.Namespace, out: Path) -> int:
    layout = LAYOUTS[args.layout]
    tdev = torch.device(args.trainer_device or args.device)
    comm = tdev if args.backend == "nccl" else torch.device("cpu")
    for i, v in enumerate(("v1", "v2")):
        if not (Path(args.dir) / v / "config.json").exists():
            write_checkpoint(Path(args.dir) / v, layout, shards=1, seed=i + 1, device="cpu")
    versions = []
    for v in ("v1", "v2"):
        (f,) = sorted((Path(args.dir) / v).glob("*.safetensors"))
        versions.append({n: t.to(tdev) for n, t in load_file(str(f)).items()})
    table = table_of(versions[0])
    Path(args.dir, "table.json").write_text(json.dumps(table))
    timeout = timedelta(seconds=args.timeout_s)
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    cmd = [sys.executable, "-m", "bench.broadcast", "--role", "worker", "--layout", args.layout, "--device",
           args.device, "--backend", args.backend, "--bucket-mb", str(args.bucket_mb), "--repeats",
           str(args.repeats), "--timeout-s", str(args.timeout_s), "--dir", args.dir, "--port", str(master.port),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, text=True)
    spec = parse_table(table)
    send_s: list[float] = []
    for i in range(args.repeats + 1):
        named = versions[i % 2]
        flat = {n: t.contiguous().view(-1).view(torch.uint8) for n, t in named.items()}
        store = dist.PrefixStore(f"hotswap/s{i}/", master)
        if args.backend == "gloo":
            pg: Any = dist.ProcessGroupGloo(store, 0, 2, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, 0, 2, opts)
        t0 = time.perf_counter()
        assert vote(pg, 1, comm, timeout)
        buf = torch.empty(min(args.bucket_mb << 20, layout.total_bytes), dtype=torch.uint8, device=comm)
        for used, pieces in buckets(spec, args.bucket_mb << 20):
            view = buf[:used]
            for p in pieces:
                view[p.offset : p.offset + p.size].copy_(flat[p.name][p.start : p.start + p.size])
            bucket_broadcast(pg, view, timeout)
        assert vote(pg, 1, comm, timeout)
        if i:
            send_s.append(time.perf_counter() - t0)
        pg.abort()
    stdout, _ = proc.communicate(timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"worker process failed ({proc.returncode})")
    res = json.loads(stdout.strip().splitlines()[-1])
    gb = layout.total_bytes / 1e9
    med = {k: statistics.median(res[k]) for k in ("disk_s", "broadcast_s", "join_s", "receive_s")}
    med["send_s"] = statistics.median(send_s)
    rows = [
        ["disk update (page cache warm): table + check + write_into", f"{med['disk_s']:.3f}", f"{gb / med['disk_s']:.2f}"],
        ["broadcast update, worker: join + votes + receive + finite + digest", f"{med['broadcast_s']:.3f}",
         f"{gb / med['broadcast_s']:.2f}"],
        ["  of which: join (store + group)", f"{med['join_s']:.3f}", ""],
        ["  of which: bucketed receive into the parameters + hashing", f"{med['receive_s']:.3f}",
         f"{gb / med['receive_s']:.2f}"],
        ["broadcast, trainer: votes + pack + send", f"{med['send_s']:.3f}", f"{gb / med['send_s']:.2f}"],
    ]  # fmt: skip
    print_table(f"{layout.name}: {len(spec)} tensors, {gb:.3f} GB, worker on {args.device}, {args.backend}, "
                f"buckets {args.bucket_mb} MiB, median of {args.repeats}", ["what", "seconds", "GB/s"], rows)  # fmt: skip
    write_json(out / "broadcast.json", {"args": vars(args), "machine": machine_description(), "bytes": layout.total_bytes,
                                        "tensors": len(spec), "median_s": med, "runs": {**res, "send_s": send_s}})  # fmt: skip
    if not res["equal_to_disk"]:
        raise SystemExit("the broadcast parameters differ from the disk version")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
