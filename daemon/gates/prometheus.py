"""The prometheus gate: a PromQL instant query against `[gates] prometheus_url`, held to a condition.

`{version}`, `{host}` and `{worker}` in the query are replaced by the trial's (escaped as PromQL
string contents); a query naming `{worker}` is asked once per worker of the host. Every series
the answer holds must meet the condition; an empty answer (or NaN) is inconclusive; Prometheus
not answering, or answering an error, is an error (the gate could not run), never a pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx

from daemon.gates.base import Condition, Measurement, Trial, judge
from daemon.gates.settings import GateSpec


def fill(query: str, **values: str) -> str:
    for k, v in values.items():
        query = query.replace("{" + k + "}", v.replace("\\", "\\\\").replace('"', '\\"'))
    return query


@dataclass
class PrometheusGate:
    spec: GateSpec
    url: str

    def measure(self, trial: Trial) -> list[Measurement]:
        per_worker = "{worker}" in self.spec.query
        names: list[str | None] = [n for n, _ in trial.workers] if per_worker else [None]
        return [self._one(trial, w) for w in names]

    def _one(self, trial: Trial, worker: str | None) -> Measurement:
        cond = Condition.parse(self.spec.condition)
        q = fill(self.spec.query, version=trial.version, host=trial.host, worker=worker or "")
        try:
            r = httpx.get(
                f"{self.url.rstrip('/')}/api/v1/query", params={"query": q}, timeout=self.spec.timeout_s
            )
            doc: dict[str, Any] = (
                r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            )
        except (httpx.HTTPError, ValueError) as exc:
            return Measurement(
                "error", None, str(cond), f"Prometheus at {self.url} did not answer: {exc}", worker
            )
        if r.status_code != 200 or doc.get("status") != "success":
            why = doc.get("error") or r.text[:200]
            return Measurement(
                "error", None, str(cond), f"Prometheus answered {r.status_code} to {q!r}: {why}", worker
            )
        values = _values(doc.get("data") or {})
        if not values:
            return Measurement("inconclusive", None, str(cond), f"{q!r} returned no data", worker)
        judged = [judge(v, cond, f"{q!r}{' ' + labels if labels else ''}", worker) for labels, v in values]
        return next((m for m in judged if m.verdict == "failed"), None) or next(
            (m for m in judged if m.verdict == "passed"), judged[0]
        )


def _values(data: dict[str, Any]) -> list[tuple[str, float]]:
    """(labels, value) of each series of an instant vector, or the one scalar."""
    kind, result = data.get("resultType"), data.get("result")
    try:
        if kind == "scalar" and isinstance(result, list):
            return [("", float(result[1]))]
        if kind == "vector" and isinstance(result, list):
            out = []
            for series in result:
                labels = ",".join(f"{k}={v}" for k, v in sorted((series.get("metric") or {}).items()))
                out.append((f"{{{labels}}}" if labels else "", float(series["value"][1])))
            return [(lbl, v) for lbl, v in out if not math.isnan(v)] or []
    except (KeyError, IndexError, TypeError, ValueError):
        return []
    return []
