"""Issue 41's tables from one bench/h200_session.sh call: read the JSON under OUT, print markdown.

    python -m bench.h200_table $OUT > $OUT/table.md

Phases (medians over the measured versions, bench/e2e_phases.py): detect + fetch + manifest +
headers; the one read (crc32c: hashed and staged); finite; forward canary; minus the time the
forward ran beside finite (counted once); verify_rest + compat +
headroom + stage; start (staged -> first pause call); the pause window per worker (the worker's
own when it resumed itself: pause asked -> scheduler running again); commit -> both serving.
Then the micro figures (ipc copy, swap flip, flip-back after a failed probe) and the anchors
(checkpoint-engine's update() from host memory, ours from host memory with no checks).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return f"{v:,}"
    return (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.2f}") + unit


def phase_rows(result: dict[str, Any], delta: bool = False) -> dict[str, Any]:
    """Medians of the measured full versions (`delta` False) or of the delta versions."""
    samples = [s for s in result.get("samples", []) if not s.get("warmup") and bool(s.get("delta")) == delta]

    def ph(*names: str) -> float | None:
        return _med([sum(s.get("phases_ms", {}).get(n, 0.0) for n in names) for s in samples])

    windows = [w.get("pause_window_ms") for s in samples for w in s.get("workers", {}).values()]
    return {
        "n": len(samples),
        "detect + fetch + manifest + headers": ph("detect", "fetch", "manifest", "headers"),
        "the one read (crc32c: hash + stage)": ph("crc32c"),
        "finite": ph("finite"),
        "forward canary": ph("forward"),
        "minus the forward's time beside finite": ph("overlap"),
        "verify_rest + compat + headroom + stage": ph("verify_rest", "compat", "headroom", "stage"),
        "start (staged -> first pause)": ph("start"),
        "pause window per worker (median)": _med([w for w in windows if w is not None]),
        "pause window per worker (max)": max((w for w in windows if w is not None), default=None),
        "commit -> both serving": _med([s["commit_to_fleet_s"] * 1e3 for s in samples]),
        "failed / ok requests": f"{sum(s['requests_failed'] for s in samples)} / {sum(s['requests_ok'] for s in samples)}",
    }


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ".bench-out/h200")
    lines: list[str] = []
    e2e = next(iter(sorted(out.glob("gpu_e2e-*.json"))), None)
    if e2e is not None:
        doc = json.loads(e2e.read_text())
        by = {r["transport"]: r for r in doc["results"]}
        rows = {t: phase_rows(r) for t, r in by.items() if "error" not in r}
        rows |= {f"{t} delta": phase_rows(r, delta=True) for t, r in by.items()
                 if "error" not in r and any(s.get("delta") for s in r.get("samples", []))}  # fmt: skip
        lines += [f"### {doc['model']['layout']}, {doc['date']}: commit -> both serving, phase by phase (ms, medians)", "",
                  "| phase | " + " | ".join(rows) + " |", "|---|" + "---:|" * len(rows)]  # fmt: skip
        keys = next(iter(rows.values())).keys() if rows else []
        lines += [f"| {k} | " + " | ".join(_f(rows[t][k]) for t in rows) + " |" for k in keys]
        for t, r in by.items():
            if "error" in r:
                lines.append(f"\n{t}: ERROR {r['error'][:300]}")
        deltas = [s for r in by.values() for s in r.get("samples", []) if s.get("delta")]
        if deltas:
            lines += ["", "delta versions: " + "; ".join(
                f"{s['version']} {100 * s['density']:g} % of elements, delta {s['delta_bytes'] / 1e6:,.0f} MB "
                f"= {100 * s['ratio']:.2f} % of full, made in {s['write_s']:.1f} + {s['publish_s']:.1f} s, "
                f"commit -> both serving {s['commit_to_fleet_s'] * 1e3:,.0f} ms" for s in deltas)]  # fmt: skip
        rej = [x for r in by.values() for x in r.get("rejections", [])]
        if rej:
            lines += ["", "| bad version | caught by | no worker paused | failed requests |", "|---|---|---|---|"]
            lines += [f"| {x.get('kind', x.get('version'))} | {x.get('caught_by')} | {x.get('rejected_before_any_pause')} "
                      f"| {x.get('requests_failed')} |" for x in rej]  # fmt: skip
        flip = by.get("ipc", {}).get("flip_back") or {}
        if flip:
            lines += ["", "flip-back after a probe that fails after resume (w0, ipc, 8B): "
                      + ", ".join(f"{m} median {_f(flip[m].get('flip_back_median_ms'), ' ms')} "
                                  f"(pause window {_f(_med(flip[m].get('pause_window_ms') or []), ' ms')}, "
                                  f"errors {len(flip[m].get('errors', []))})" for m in ("copy", "swap") if m in flip)
                      + (f"; error: {flip['error']}" if "error" in flip else "")
                      + (f"; afterwards w0 serves {flip['after']}" if "after" in flip else "")]  # fmt: skip
    ipc = next(iter(sorted(out.glob("ipc_update-*.json"))), None)
    if ipc is not None:
        r = json.loads(ipc.read_text())
        ce = r.get("checkpoint_engine") or {}
        ce_text = (f"update() median {_f(_med([x * 1e3 for x in ce['update_s']]), ' ms')} of {len(ce['update_s'])} "
                   f"(register {ce.get('register_s', 0):.1f} s, not counted)" if "update_s" in ce
                   else ce.get("error", "not run"))  # fmt: skip
        lines += ["", "| micro (8B layout) | median |", "|---|---:|",
                  f"| ipc copy + checksum against the staged copy, pause window | "
                  f"{_f(r.get('copy', {}).get('pause_ms', {}).get('median'), ' ms')} |",
                  f"| ipc copy alone (no checksum) | {_f((r.get('copy_no_checksum_pause_ms') or {}).get('median'), ' ms')} |",
                  f"| ipc swap, pointer flip | {_f(r.get('swap', {}).get('swap_ms', {}).get('median'), ' ms')} |",
                  f"| ipc swap, rollback flip | {_f(r.get('swap', {}).get('rollback_ms', {}).get('median'), ' ms')} |",
                  f"| checkpoint-engine 0.4.2, host memory -> GPU | {ce_text} |"]  # fmt: skip
    disk = out / "disk_reload_check.json"
    if disk.exists():
        d = json.loads(disk.read_text())
        off = _med([x["seconds"] for x in d.get("ours_warm", [])])
        on = _med([x["seconds"] for x in d.get("ours_warm_checked", [])])
        lines += [f"| ours, host memory (page cache) -> GPU, no checks | {_f(off and off * 1e3, ' ms')} |",
                  f"| ours, host memory -> GPU, digests checked | {_f(on and on * 1e3, ' ms')} |"]  # fmt: skip
    delta = next(iter(sorted(out.glob("delta-*.json"))), None)
    if delta is not None:  # issue 38: bench.delta --layout
        d = json.loads(delta.read_text())
        lines += ["", f"| delta, {d.get('layout')} bf16 | delta / full | encode s | rebuild, verified in memory s | + the checks' read s | GPU apply ms |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {100 * r['density']:g} % of elements | {100 * r['ratio']:.2f} % | {r['encode_s']:.2f} | {r['rebuild_s']:.2f} "
                  f"| {r['rebuild_verify_s']:.2f} | {(r.get('gpu_apply') or {}).get('apply_ms', '-')} |"
                  for r in d.get("rows", [])[1:]]  # fmt: skip
    print("\n".join(lines) if lines else f"nothing under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
