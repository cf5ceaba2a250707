#!/usr/bin/env bash
# The fault suite (`pytest -m fault`: tests/faults/ and the fault cases of tests/airflow and tests/e2e),
# then docs/FAULTS.md from its results: ./scripts/faults.sh [pytest args]. Needs what scripts/test.sh
# starts (a Ray head, PostgreSQL); the cases start their own S3, Ray or tmpfs where they break one.
# RELAY_TEST_SEED=N picks the kill points (default: the checked-out commit). Exit: pytest's, else the report's.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .relay/faults
rc=0
t0=$(date +%s)
# scripts/test.sh starts what the cases need (PostgreSQL, the session's Ray head) and stops it after.
# xunit1 keeps each case's properties (its FAULTS.md row) in the junit XML.
RELAY_TEST_WORKERS="${RELAY_TEST_WORKERS:-4}" ./scripts/test.sh -m fault -o junit_family=xunit1 \
  --junitxml=.relay/faults/junit.xml "$@" || rc=$?
.venv/bin/python scripts/faults_report.py .relay/faults/junit.xml --out docs/FAULTS.md \
  --wall "$(( $(date +%s) - t0 ))" --workers "${RELAY_TEST_WORKERS:-4}" || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
exit $rc
