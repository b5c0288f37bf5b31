"""Where the forward check's time goes on a GPU (issue 41): the check run in this process and in the
check process (daemon.checks.isolation, as the daemon runs it), on the 8B layout staged on the
device, with cProfile over the in-process runs.

    python -m bench.forward_probe                        # 8B layout on cuda:0
    python -m bench.forward_probe --layout small --device cpu
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import time
from pathlib import Path

import torch

from bench.common import LAYOUTS, write_checkpoint
from daemon.bytepipe import stage_files
from daemon.checks.base import CheckContext, CheckSettings
from daemon.checks.forward import check_forward
from daemon.checks.headers import load_table
from daemon.checks.isolation import FORWARD_IMPORTS, CheckProcess
from daemon.formats.checkpoint import weight_files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="llama3-8b", choices=sorted(LAYOUTS))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hotswap-forward-probe"))
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    on_gpu = torch.device(args.device).type == "cuda"
    write_checkpoint(args.dir, LAYOUTS[args.layout], shards=4, device=args.device if on_gpu else None)
    rels = [f.relative_to(args.dir).as_posix() for f in weight_files(args.dir)]
    ctx = CheckContext(args.dir, CheckSettings(forward_device=args.device), None)
    load_table(ctx)
    ctx.staged = stage_files(args.dir, rels, args.device, alg=None, crc=False)[1]
    for _ in range(2):
        check_forward(ctx)  # the skeleton built, kernels warm
    prof = cProfile.Profile()
    for i in range(args.runs):
        t0 = time.perf_counter()
        prof.enable()
        detail = check_forward(ctx)
        prof.disable()
        print(f"in process, run {i}: {1e3 * (time.perf_counter() - t0):.1f} ms, parts {detail['ms']}", flush=True)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue()[:6000])
    child = CheckProcess()
    child.start(FORWARD_IMPORTS)
    try:
        for i in range(args.runs + 2):
            t0 = time.perf_counter()
            detail = child.run("forward", False, ctx, 120.0)
            print(f"check process, run {i}: {1e3 * (time.perf_counter() - t0):.1f} ms, parts {detail.get('ms')} "
                  f"child {detail.get('child_ms')}", flush=True)  # fmt: skip
    finally:
        child.stop()
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
