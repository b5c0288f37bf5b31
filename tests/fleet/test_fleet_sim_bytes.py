"""The bytes dimension of bench/fleet_sim.py (issue 38): the origin model's shares and times, the
virtual-time rollout, and a tiny real-rows run on PostgreSQL (real FleetAgent, leases and
registry; the hosts fetch through the origin model, then converge), so the bench cannot rot."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from conftest import POSTGRES_ENV

from bench.fleet_sim import simulate
from bench.fleet_sim_bytes import GBIT, Origin, model_rollout, recorded_ratios

REPO = Path(__file__).resolve().parents[2]


def test_shares_are_max_min_fair_and_capped_by_each_link() -> None:
    o = Origin(10 * GBIT)
    o.begin("slow", 1e9, 1 * GBIT, 0.0)
    o.begin("a", 1e9, 25 * GBIT, 0.0)
    o.begin("b", 1e9, 25 * GBIT, 0.0)
    rates = o.rates()
    assert rates["slow"] == pytest.approx(1 * GBIT)  # below its share: keeps its link
    assert rates["a"] == rates["b"] == pytest.approx(4.5 * GBIT)  # the rest, split evenly
    assert sum(rates.values()) == pytest.approx(10 * GBIT)


def test_transfers_end_when_their_last_byte_arrives_and_the_origin_sends_each_byte_once() -> None:
    o = Origin(2 * GBIT)
    o.begin("a", 1e9, 10 * GBIT, 0.0)
    o.begin("b", 2e9, 10 * GBIT, 0.0)
    # both at 1 Gbit/s: a ends at 8 s; b then alone at 2 Gbit/s for its last 1 GB: 12 s
    assert o.left_s("b", 0.0) == pytest.approx(16.0)  # at today's rates
    o.advance(100.0)
    assert o.spans["a"] == pytest.approx((0.0, 8.0)) and o.spans["b"] == pytest.approx((0.0, 12.0))
    assert o.egress == pytest.approx(3e9) and o.peak == 2 and not o.active


def test_a_lone_host_fetches_at_its_link_and_many_at_the_origin_s_rate() -> None:
    o = Origin(100 * GBIT)
    o.begin("h", 16.06e9, 25 * GBIT, 0.0)
    o.advance(1e6)
    assert o.spans["h"][1] == pytest.approx(16.06e9 / (25 * GBIT))
    m = model_rollout(1000, 50, 2.0, 5.0, 16.06e9, [25.0], 100.0)
    assert m["egress_bytes"] == pytest.approx(1000 * 16.06e9, rel=1e-9)
    assert m["last_fetch_end_s"] == pytest.approx(
        16.06e12 / (100 * GBIT), rel=0.01
    )  # the origin is the limit


def test_a_delta_converges_sooner_and_never_below_the_lease_bound() -> None:
    full = model_rollout(200, 10, 2.0, 5.0, 16.06e9, [25.0], 100.0)
    delta = model_rollout(200, 10, 2.0, 5.0, 16.06e9 * 0.015, [25.0], 100.0)
    assert delta["converged_s"] < full["converged_s"] / 5
    assert delta["egress_bytes"] == pytest.approx(full["egress_bytes"] * 0.015, rel=1e-9)
    assert delta["converged_s"] >= delta["ideal_no_bytes_s"] == 40.0  # 20 waves of 2 s


def test_the_ratios_are_read_from_bench_delta_s_record() -> None:
    ratios = recorded_ratios(REPO / "bench" / "results" / "delta-2core.json")
    assert ratios["full"] == 1.0
    assert 0 < ratios["delta 1 % density"] < 0.03  # the goal at 1 % density
    assert (
        ratios["delta 1 % density"]
        < ratios["delta RL-like (lr 3e-6)"]
        < ratios["delta SFT-like (lr 2e-5)"]
        < 1
    )


@pytest.mark.skipif(not os.environ.get(POSTGRES_ENV), reason=f"needs {POSTGRES_ENV}")
@pytest.mark.timeout(240)
def test_a_tiny_real_rows_rollout_fetches_each_copy_once_then_converges() -> None:
    args = argparse.Namespace(direct_max_hosts=6, bound_pct=50.0, update_s=0.3, poll_s=0.5, lease_s=5.0,
                              pool_size=10, procs=1, steady_polls=1.0, no_kill=True, gb=0.5,
                              link_gbps=[10.0], origin_gbps=[8.0], pg_server=os.environ[POSTGRES_ENV])  # fmt: skip
    full = simulate("direct", 6, args, lambda _m: None, ("full", 1.0))
    delta = simulate("direct", 6, args, lambda _m: None, ("delta", 0.01))
    for run, ratio in ((full, 1.0), (delta, 0.01)):
        ro = run["rollout"]
        assert ro["hosts_converged"] == 6 and run["double_grants"] == 0 and run["error_count"] == 0, run
        assert ro["fetches"] == 6 and ro["egress_bytes"] == pytest.approx(6 * 0.5e9 * ratio, rel=1e-6)
        assert run["peak_holders_ledger"] <= 3  # the bound: ceil(6 x 50 %)
    # 3 GB through 1 GB/s: the full copies take >= 3 s, the delta's 30 MB a few ms
    assert full["rollout"]["last_fetch_end_s"] >= 3.0 > delta["rollout"]["last_fetch_end_s"]
    assert full["rollout"]["converged_s"] > delta["rollout"]["converged_s"]
