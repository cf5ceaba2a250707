#!/usr/bin/env bash
# The main job: install (.venv), start the local stack, run the demo spec's DAG end to end through
# Airflow and Ray (60 steps, 3 chunks, one provoked resume), print where checkpoints and metrics are.
# Options: --keep-running (explore the UI afterwards), --no-kill (no provoked resume).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export GX_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m relay demo "$@"
