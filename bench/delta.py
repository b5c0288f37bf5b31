"""Delta checkpoints: how small, how fast to encode, how fast to rebuild and verify (daemon.delta).

    python -m bench.delta [--gb 1.0] [--steps 4] [--out bench/results/delta-2core.json]

Two parts, one table:

* A real optimizer pair: the tiny Llama (daemon.tinymodel) trained on random tokens with Adam,
  fp32 master weights saved as bf16 after every step, at an RL-like lr (3e-6) and an SFT-like one
  (2e-5); each saved step is encoded against the one before. Real bytes, not invented noise.
* A synthetic bf16 layout of `--gb` GB (tensors of 32 M elements, N(0, 0.02)) at changed-element
  densities of 0.1, 1, 5, 30 and 100 %: each changed element moves by a small relative step (at
  least one bf16 ulp). Per density: delta/full bytes, publisher encode time (`publish_delta`:
  encode + hash + manifest) and host rebuild + verify time (`rebuild`, which hashes each result
  file in memory as it decodes it and checks it against the manifest, then every result file
  read and hashed again, as the daemon's checks do after a rebuild).

With `--layout`, per density: `rebuild_s` is the rebuild verified in memory (the result checked
against the manifest, the base re-hashed), `rebuild_verify_s` that plus the checks' second read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from daemon.bytepipe.files import hash_files
from daemon.delta.anchors import AnchorRule
from daemon.delta.build import publish_delta
from daemon.delta.rebuild import rebuild_delta
from daemon.delta.section import parse
from daemon.manifest import load_manifest, publish

ALWAYS_DELTA = AnchorRule(share=1e9)
ELEMENTS = 32 * 1024 * 1024  # per synthetic tensor (64 MiB in bf16)


def _trained_pair(work: Path, lr: float, steps: int) -> list[dict[str, Any]]:
    from transformers import LlamaForCausalLM

    from daemon.tinymodel import make_tiny_checkpoint

    src = make_tiny_checkpoint(work / f"init-{lr}", seed=1)
    model = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    prev: Path | None = None
    for i in range(steps + 1):
        if i:
            ids = torch.randint(0, model.config.vocab_size, (8, 32), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        d = work / f"lr{lr}-s{i}"
        d.mkdir()
        save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
                  d / "model.safetensors")  # fmt: skip
        publish(d, version=d.name)
        if prev is not None:
            p = publish_delta(d, prev, work / "out" / d.name, rule=ALWAYS_DELTA)
            assert p.spec is not None
            a = np.frombuffer((prev / "model.safetensors").read_bytes(), np.uint8)
            b = np.frombuffer((d / "model.safetensors").read_bytes(), np.uint8)
            changed = float((a.view(np.uint16)[: len(a) // 2] != b.view(np.uint16)[: len(b) // 2]).mean())
            rows.append({"lr": lr, "step": i, "ratio": p.spec.ratio, "changed_elements_approx": changed,
                         "encodings_bytes": p.encodings})  # fmt: skip
        prev = d
    return rows


def _synthetic(work: Path, density: float, base: Path) -> dict[str, Any]:
    rng = np.random.default_rng(int(density * 1000) + 7)
    new = work / f"new-{density}"
    new.mkdir()
    for shard in sorted(base.glob("*.safetensors")):
        ts = load_file(shard)
        out = {}
        for k, v in ts.items():
            f = v.float()
            hit = torch.from_numpy(rng.random(f.numel(), dtype=np.float32) < density).view(f.shape)
            sign = torch.from_numpy(rng.standard_normal(f.numel(), dtype=np.float32)).view(f.shape).sign()
            out[k] = torch.where(hit, f + f.abs().clamp_min(1e-3) * 0.02 * sign, f).to(torch.bfloat16)  # >= 1 ulp
        save_file(out, new / shard.name)
    t0 = time.perf_counter()
    p = publish_delta(new, base, work / "out" / new.name, rule=ALWAYS_DELTA)
    encode_s = time.perf_counter() - t0
    assert p.spec is not None
    m = load_manifest(work / "out" / new.name)
    spec = parse(m, "bench")
    assert spec is not None
    t0 = time.perf_counter()
    r = rebuild_delta(work / "out" / new.name, m, spec, base, {f.path: f for f in load_manifest(base).files},
                work / "rebuilt" / new.name)  # fmt: skip
    for f, d in zip(m.files, hash_files([r.directory / f.path for f in m.files], alg=m.hash_alg or "blake3"), strict=True):
        d.check(f, f.path)
    rebuild_s = time.perf_counter() - t0
    row = {"density": density, "full_bytes": spec.full_bytes, "delta_bytes": spec.delta_bytes, "ratio": spec.ratio,
           "encode_s": round(encode_s, 3), "rebuild_verify_s": round(rebuild_s, 3), "encodings_bytes": p.encodings}  # fmt: skip
    shutil.rmtree(new)
    shutil.rmtree(work / "out" / new.name)
    shutil.rmtree(r.directory)
    return row


def _base_layout(work: Path, gb: float) -> Path:
    base = work / "base"
    base.mkdir()
    g = torch.Generator().manual_seed(3)
    tensors = max(1, int(gb * 1e9 / (2 * ELEMENTS)))
    per_shard = 4
    for s in range(0, tensors, per_shard):
        save_file({f"layer{t}.weight": (torch.randn(ELEMENTS // 4096, 4096, generator=g) * 0.02).to(torch.bfloat16)
                   for t in range(s, min(tensors, s + per_shard))}, base / f"model-{s // per_shard:05d}.safetensors")  # fmt: skip
    publish(base, version="base")
    return base


def _layout_run(work: Path, layout_name: str, densities: list[float], gpu: str | None,
                on_row: Any = None) -> dict[str, Any]:  # fmt: skip
    """The 8B (or another bench.common) layout, bf16: per density, delta/full bytes, encode, host
    rebuild + verify, and with `gpu` the GPU apply micro (bench.delta_gpu)."""
    from bench.common import LAYOUTS, write_checkpoint
    from bench.delta_gpu import gpu_apply
    from bench.e2e_delta import make_delta

    base = work / "base"
    t0 = time.perf_counter()
    write_checkpoint(base, LAYOUTS[layout_name], shards=4, seed=3, device="cuda" if gpu else "cpu")
    publish(base, version="base")
    rows: list[dict[str, Any]] = [{"base_written_s": round(time.perf_counter() - t0, 1)}]
    for i, density in enumerate(densities):
        out = work / "out" / f"d{i}"
        new, made = make_delta(base, work / "trainer", out, version=f"d{i}", seed=11 + i, density=density)
        shutil.rmtree(new)  # the rebuild is checked against the manifest's hashes: 16 GB less on a 64 GB disk
        m = load_manifest(out)
        spec = parse(m, "bench")
        assert spec is not None
        t0 = time.perf_counter()
        r = rebuild_delta(out, m, spec, base, {f.path: f for f in load_manifest(base).files}, work / "rebuilt" / f"d{i}")
        rebuilt_s = time.perf_counter() - t0
        for f, d in zip(m.files, hash_files([r.directory / f.path for f in m.files], alg=m.hash_alg or "blake3"),
                        strict=True):  # fmt: skip
            d.check(f, f.path)
        row = {"density": density, "elements_changed": made["elements_changed"], "elements": made["elements"],
               "full_bytes": spec.full_bytes, "delta_bytes": spec.delta_bytes, "ratio": spec.ratio,
               "make_s": round(made["write_s"], 2), "encode_s": round(made["publish_s"], 2),
               "rebuild_s": round(rebuilt_s, 3), "rebuild_verify_s": round(time.perf_counter() - t0, 3)}  # fmt: skip
        if gpu:
            row["gpu_apply"] = gpu_apply(base, r.directory, gpu)
        shutil.rmtree(r.directory)
        shutil.rmtree(out)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if on_row is not None:  # written as it goes: a run stopped at its cap keeps what it measured
            on_row({"layout": layout_name, "rows": rows})
        for left in (new, out, r.directory):
            shutil.rmtree(left, ignore_errors=True)
    return {"layout": layout_name, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="synthetic layout size (default 1 GB: fits a 2-core VM)")
    ap.add_argument("--steps", type=int, default=4, help="Adam steps per learning rate")
    ap.add_argument("--densities", default="0.001,0.01,0.05,0.3,1.0")
    ap.add_argument("--out", type=Path, default=Path("bench/results/delta-2core.json"))
    ap.add_argument("--layout", default=None, help="instead: a bench.common layout (llama3-8b), written bf16")
    ap.add_argument("--gpu", default=None, help="with --layout: also the GPU apply micro on this device")
    args = ap.parse_args()
    if args.layout:
        with tempfile.TemporaryDirectory(prefix="bench-delta-", dir=os.environ.get("BENCH_TMP")) as tmp:
            head = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
                    "command": "python -m bench.delta " + " ".join(sys.argv[1:])}  # fmt: skip
            args.out.parent.mkdir(parents=True, exist_ok=True)
            save = lambda part: args.out.write_text(json.dumps({**head, **part}, indent=1) + "\n")  # noqa: E731
            doc = {**head, **_layout_run(Path(tmp), args.layout, [float(d) for d in args.densities.split(",")],
                                         args.gpu, save)}  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print("| density | delta / full | encode s | rebuild, verified in memory s | + the checks' read s | GPU apply ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in doc["rows"][1:]:
            g = r.get("gpu_apply", {})
            print(f"| {100 * r['density']:g} % | {100 * r['ratio']:.2f} % | {r['encode_s']:.2f} | {r['rebuild_s']:.2f} | "
                  f"{r['rebuild_verify_s']:.2f} | {g.get('apply_ms', '-')} |")  # fmt: skip
        print(f"record: {args.out}")
        return
    torch.set_num_threads(2)
    record: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
                              "command": "python -m bench.delta " + " ".join(f"--{k} {v}" for k, v in
                                                                             (("gb", args.gb), ("steps", args.steps)))}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        work = Path(tmp)
        record["optimizer"] = [r for lr in (3e-6, 2e-5) for r in _trained_pair(work, lr, args.steps)]
        base = _base_layout(work, args.gb)
        record["synthetic"] = [_synthetic(work, float(d), base) for d in args.densities.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("| part | setting | delta / full | encode s | rebuild + verify s |")
    print("|---|---|---:|---:|---:|")
    for lr in (3e-6, 2e-5):
        rs = [r for r in record["optimizer"] if r["lr"] == lr]
        print(f"| tiny Llama, Adam, bf16 | lr {lr:g}, {len(rs)} steps | "
              f"{100 * sum(r['ratio'] for r in rs) / len(rs):.1f} % (mean) | | |")  # fmt: skip
    for r in record["synthetic"]:
        print(f"| synthetic bf16 {args.gb:g} GB | {100 * r['density']:g} % changed | {100 * r['ratio']:.2f} % | "
              f"{r['encode_s']:.2f} | {r['rebuild_verify_s']:.2f} |")  # fmt: skip
    print(f"record: {args.out}")


if __name__ == "__main__":
    main()
