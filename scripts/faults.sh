#!/usr/bin/env bash
# The fault suite (tests/faults/), then docs/FAULTS.md from its results: ./scripts/faults.sh [pytest args]
# RELAY_TEST_SEED=N picks the kill points (default: the checked-out commit). Exit: pytest's, else the report's.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export GX_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
PY=.venv/bin/python
mkdir -p .relay/faults
rc=0
# xunit1 keeps each case's properties (its FAULTS.md row) in the junit XML.
$PY -m pytest tests/faults -n "${RELAY_TEST_WORKERS:-2}" --dist loadfile -o junit_family=xunit1 \
  --junitxml=.relay/faults/junit.xml "$@" || rc=$?
$PY scripts/faults_report.py .relay/faults/junit.xml --out docs/FAULTS.md || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
exit $rc
