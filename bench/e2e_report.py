"""The tables of bench/gpu_e2e.py: medians per transport, phases of commit -> fleet, rejections."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.common import Layout, print_table
from bench.e2e_phases import median_phases
from bench.e2e_reject import print_rejections

ALL_CHECKS = ["manifest", "headers", "crc32c", "compat", "finite", "headroom", "forward"]


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    measured = [s for s in result["samples"] if not s["warmup"] and not s.get("delta")]  # deltas: h200_table

    def stat(values: list[float]) -> dict[str, float] | None:
        values = sorted(v for v in values if v is not None)
        if not values:
            return None
        return {
            "median": statistics.median(values),
            "p90": values[int(0.9 * (len(values) - 1))],
            "max": values[-1],
        }

    checks = sorted(
        {n for s in measured for n in s["checks_ms"]},
        key=lambda n: ALL_CHECKS.index(n) if n in ALL_CHECKS else 99,
    )
    pause = [w.get("pause_window_ms") for s in measured for w in s["workers"].values()]
    return {
        "n": len(measured),
        "commit_to_verified_s": stat([s["commit_to_verified_s"] for s in measured]),
        "verified_to_fleet_s": stat([s["verified_to_fleet_s"] for s in measured]),
        "commit_to_fleet_s": stat([s["commit_to_fleet_s"] for s in measured]),
        "pause_window_ms": stat(pause),
        "update_call_ms": stat([w.get("update_call_ms") for s in measured for w in s["workers"].values()]),
        "worker_update_ms": stat(
            [w.get("worker_update_ms") for s in measured for w in s["workers"].values()]
        ),
        "post_check_ms": stat([w.get("post_check_ms") for s in measured for w in s["workers"].values()]),
        "checks_ms_median": {
            n: statistics.median(s["checks_ms"][n] for s in measured if n in s["checks_ms"]) for n in checks
        },
        "phases_ms_median": median_phases(measured),
        "forward_parts_ms_median": {  # the forward check's steps and its child's share (issue 41)
            k: statistics.median(v for s in measured if (v := (s.get("forward_parts_ms") or {}).get(k)) is not None)
            for k in sorted({k for s in measured for k in (s.get("forward_parts_ms") or {})})
        },
        "requests_failed_during_updates": sum(s["requests_failed"] for s in measured),
        "requests_ok_during_updates": sum(s["requests_ok"] for s in measured),
        "all_deployed": all(s["status"] in ("deployed", "retired", "superseded") for s in measured),
    }


def print_results(args: argparse.Namespace, layout: Layout, results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        s = r.get("summary")
        if not s:
            rows.append([r["transport"], "ERROR", r.get("error", "")[:60]] + [""] * 9)
            continue

        def m(key: str, sub: str = "median", s: dict[str, Any] = s) -> Any:
            return s[key][sub] if s[key] else "-"

        rows.append([r["transport"], s["n"], m("commit_to_verified_s"), m("verified_to_fleet_s"), m("commit_to_fleet_s"),
                     m("commit_to_fleet_s", "max"), m("pause_window_ms"), m("pause_window_ms", "max"),
                     m("worker_update_ms"), f'{s["requests_failed_during_updates"]}/{s["requests_ok_during_updates"]}',
                     _fmt(r.get("health", {}).get("p99_ms")),
                     " ".join(f"{k}={v:.0f}" for k, v in s["checks_ms_median"].items())])  # fmt: skip
    print_table(
        f"{layout.name} ({layout.total_bytes / 1e9:.2f} GB, {len(layout.tensors())} tensors), 2 workers on {args.device}, "
        "pause mode; medians (s / ms)",
        ["transport", "n", "commit->verified s", "verified->fleet s", "commit->fleet s", "max s",
         "pause ms", "max pause ms", "worker update ms", "failed/ok", "/health p99 ms", "checks ms (median)"],
        rows,
    )  # fmt: skip
    ok = [r for r in results if r.get("summary")]
    cols = [c for r in ok for c in r["summary"]["phases_ms_median"]]
    cols = list(dict.fromkeys(cols))
    if ok:
        print_table(
            "where commit -> every worker serving goes (median ms per phase, bench/e2e_phases.py; sum of medians)",
            ["transport", *cols, "sum", "commit->fleet"],
            [[r["transport"], *[_fmt(r["summary"]["phases_ms_median"].get(c)) for c in cols],
              _fmt(sum(r["summary"]["phases_ms_median"].values())),
              _fmt((cf := r["summary"]["commit_to_fleet_s"]) and cf["median"] * 1000)] for r in ok],
        )  # fmt: skip
    rejections = [x for r in results for x in r.get("rejections", [])]
    if rejections:
        print_rejections(rejections)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if v < 100 else f"{v:.0f}"

