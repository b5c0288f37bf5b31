#!/usr/bin/env bash
# The shipped Prometheus alerting rules (prometheus/hotswap-alerts.yml): `promtool check rules`
# (syntax, templates) and `promtool test rules` (each alert fires, and only, when it should).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PROMTOOL="$("$ROOT/scripts/check-metrics.sh" --install)"
cd "$ROOT/prometheus"
"$PROMTOOL" check rules hotswap-alerts.yml
"$PROMTOOL" test rules hotswap-alerts.test.yml
