"""The bytes dimension of bench/fleet_sim.py (issue 38): what a version's size does to a rollout.

A fleet host fetches its own copy of the fleet target outside the lease (daemon.fleet.fetch, from
`FleetAgent._here` in its tick) and only then converges, so every host behind the target fetches
at once while the lease bound paces the updates. Two things limit a fetch:

* the host's own link (`link_bps`, per host), and
* the origin (an S3 prefix, a push server): `origin_bps` in all, shared by the hosts fetching at
  that moment, max-min fair (a host slower than its share keeps its link speed and leaves the
  rest to the others).

`Origin` is that model as a fluid simulation (exact: every finish between two looks is processed
at its own time). The simulated hosts of bench/fleet_sim.py fetch through it in real time
(`Ledger.fetch_begin` / `fetch_left_s`) before their real `FleetAgent` converges, with real rows.
`model_rollout` runs the same policy in virtual time (each host's first tick after the commit,
its fetch, then the first free slot for `update_s`), which is how 1,000 hosts fetching 16 GB each
are answered without waiting 20 minutes; the real-rows runs at a size this machine can drive
check it (bench/RESULTS.md).
"""

from __future__ import annotations

import heapq
import json
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
EPS = 1e-3  # bytes: a transfer this close to done is done


@dataclass
class Flow:
    remaining: float
    link: float
    start: float


@dataclass
class Origin:
    """One origin's bandwidth shared by the transfers in flight, in the clock its caller gives."""

    origin_bps: float
    now: float = 0.0
    active: dict[str, Flow] = field(default_factory=dict)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # host -> (start, end) of its fetch
    egress: float = 0.0  # bytes the origin sent
    peak: int = 0  # most transfers at once
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def rates(self) -> dict[str, float]:
        """Max-min fair shares of the origin, each capped by its host's link."""
        out: dict[str, float] = {}
        left, n = self.origin_bps, len(self.active)
        for host, f in sorted(self.active.items(), key=lambda kv: kv[1].link):
            out[host] = min(f.link, left / n)
            left -= out[host]
            n -= 1
        return out

    def advance(self, now: float) -> None:
        """Move every transfer to `now`, finishing each one at the moment its last byte arrives."""
        while self.active and now > self.now:
            rates = self.rates()
            step = min(now - self.now, *(f.remaining / rates[h] for h, f in self.active.items()))
            for h, f in self.active.items():
                f.remaining -= rates[h] * step
                self.egress += rates[h] * step
            self.now += step
            # done: its last bytes would take under a nanosecond (float residue of a 16 GB transfer)
            for h in [h for h, f in self.active.items() if f.remaining <= max(EPS, rates[h] * 1e-9)]:
                self.spans[h] = (self.active.pop(h).start, self.now)
        self.now = max(self.now, now)

    def begin(self, host: str, nbytes: float, link_bps: float, now: float) -> None:
        self.advance(now)
        self.active[host] = Flow(float(nbytes), link_bps, now)
        self.peak = max(self.peak, len(self.active))

    def left_s(self, host: str, now: float) -> float:
        """Seconds until `host`'s transfer ends at today's rates (0: it has ended)."""
        self.advance(now)
        f = self.active.get(host)
        return 0.0 if f is None else f.remaining / self.rates()[host]

    def next_finish(self) -> float | None:
        """When the next transfer ends if nothing else begins (None: none in flight)."""
        if not self.active:
            return None
        rates = self.rates()
        return self.now + min(f.remaining / rates[h] for h, f in self.active.items())

    def summary(self, t0: float) -> dict[str, Any]:
        ends = [e for _, e in self.spans.values()]
        return {"egress_bytes": round(self.egress), "peak_fetching": self.peak,
                "fetches": len(self.spans), "last_fetch_end_s": round(max(ends) - t0, 2) if ends else None,
                "fetch_mean_s": round(sum(e - s for s, e in self.spans.values()) / len(self.spans), 2)
                if self.spans else None}  # fmt: skip


def links_for(names: list[str], link_gbps: list[float]) -> dict[str, float]:
    """Each host's link in bytes/s: the speeds given, round-robin over the hosts."""
    return {n: link_gbps[i % len(link_gbps)] * GBIT for i, n in enumerate(names)}


def model_rollout(n: int, bound: int, update_s: float, poll_s: float, nbytes: float, link_gbps: list[float],
                  origin_gbps: float, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Commit at t = 0 -> every host serving, in virtual time: each host's first tick after the
    commit (uniform over one poll) starts its fetch through the origin; its fetch done, it takes
    the first free slot of `bound` (first come, first served) and updates for `update_s`."""
    rng = random.Random(seed)
    names = [f"sim-{i:04d}" for i in range(n)]
    links = links_for(names, link_gbps)
    starts = sorted((rng.uniform(0, poll_s), h) for h in names)
    origin = Origin(origin_gbps * GBIT)
    done: list[tuple[float, str]] = []  # (fetch end, host), in order
    i = 0
    while i < len(starts) or origin.active:
        finish = origin.next_finish()
        if i < len(starts) and (finish is None or starts[i][0] <= finish):
            t, h = starts[i]
            origin.begin(h, nbytes, links[h], t)
            i += 1
        else:
            assert finish is not None
            before = set(origin.active)
            origin.advance(finish)
            done += sorted((origin.spans[h][1], h) for h in before - set(origin.active))
    free = [0.0] * bound  # when each slot is next free
    heapq.heapify(free)
    served = []
    for ready, _h in sorted(done):
        slot = heapq.heappop(free)
        end = max(slot, ready) + update_s
        served.append(end)
        heapq.heappush(free, end)
    ideal = -(-n // bound) * update_s
    return {"hosts": n, "bound": bound, "bytes_per_host": nbytes, "converged_s": round(max(served), 2),
            "ideal_no_bytes_s": ideal, **origin.summary(0.0)}  # fmt: skip


def recorded_ratios(record: Path) -> dict[str, float]:
    """The delta/full ratios bench/delta.py recorded: 1 % density on the synthetic bf16 layout, and
    the first Adam step of the tiny model at the RL-like and SFT-like learning rates."""
    doc = json.loads(record.read_text())
    (dense,) = [r["ratio"] for r in doc["synthetic"] if r["density"] == 0.01]
    first = {r["lr"]: r["ratio"] for r in doc["optimizer"] if r["step"] == 1}
    return {"full": 1.0, "delta 1 % density": dense, "delta RL-like (lr 3e-6)": first[3e-6],
            "delta SFT-like (lr 2e-5)": first[2e-5]}  # fmt: skip


def model_table(runs: list[dict[str, Any]]) -> str:
    head = ["hosts", "bound", "origin", "link / host", "encoding", "bytes / host", "origin egress",
            "commit -> every host serving", "last fetch done", "mean fetch", "without bytes (ideal)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        lines.append("| " + " | ".join([
            f"{r['hosts']:,}", str(r["bound"]), f"{r['origin_gbps']:g} Gbit/s", "/".join(f"{x:g}" for x in r["link_gbps"]) + " Gbit/s",
            f"{r['encoding']} ({100 * r['ratio']:.2f} %)", f"{r['bytes_per_host'] / 1e9:.3f} GB",
            f"{r['egress_bytes'] / 1e12:.3f} TB", f"{r['converged_s']:.1f} s", f"{r['last_fetch_end_s']:.1f} s",
            f"{r['fetch_mean_s']:.1f} s", f"{r['ideal_no_bytes_s']:g} s"]) + " |")  # fmt: skip
    return "\n".join(lines)


def bytes_table(runs: list[dict[str, Any]]) -> str:
    """The real-rows runs with bytes, beside the model's figure for the same setting."""
    head = ["mode", "hosts", "bound", "origin / link", "encoding", "bytes / host", "origin egress",
            "commit -> every host serving (model)", "last fetch done (model)", "most fetching at once",
            "SIGKILL rollout (model)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        ro, k = r["rollout"], r.get("kill", {})
        m, km = ro.get("model", {}), k.get("model", ro.get("model", {}))
        lines.append("| " + " | ".join([
            r["mode"], str(r["hosts"]), str(r["bound"]),
            f"{r['origin_gbps']:g} / {'/'.join(f'{x:g}' for x in r['link_gbps'])} Gbit/s",
            f"{r['encoding']} ({100 * r['ratio']:.2f} %)", f"{r['bytes_per_host'] / 1e9:.3f} GB",
            f"{ro.get('egress_bytes', 0) / 1e9:.1f} GB", f"{ro.get('converged_s')} s ({m.get('converged_s')} s)",
            f"{ro.get('last_fetch_end_s')} s ({m.get('last_fetch_end_s')} s)", str(ro.get("peak_fetching")),
            f"{k.get('converged_s')} s ({km.get('converged_s')} s)" if k else "-"]) + " |")  # fmt: skip
    return "\n".join(lines)
