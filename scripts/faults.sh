#!/usr/bin/env bash
# The fault suite (`pytest -m fault`: tests/faults/ and the fault cases of tests/airflow and tests/e2e),
# then docs/FAULTS.md from its results: ./scripts/faults.sh [pytest args]. The cases start their own S3,
# Ray or tmpfs where they break one.
# RELAY_TEST_SEED=N picks the kill points (default: the checked-out commit). Exit: pytest's, else the report's.
set -euo pipefail
cd "$(dirname "$0")/.."
rc=0
t0=$(date +%s)
# scripts/test.sh starts what the cases need (PostgreSQL, the session's Ray head), stops it after, and
# leaves the results (each case's FAULTS.md row a junit property) in .relay/test-results/junit.xml.
RELAY_TEST_WORKERS="${RELAY_TEST_WORKERS:-4}" ./scripts/test.sh -m fault "$@" || rc=$?
.venv/bin/python scripts/faults_report.py .relay/test-results/junit.xml --out docs/FAULTS.md \
  --wall "$(( $(date +%s) - t0 ))" --workers "${RELAY_TEST_WORKERS:-4}" || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
exit $rc
