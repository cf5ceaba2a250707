#!/usr/bin/env bash
# The test command: install (.venv, and Debian's chromium for the browser tests), start the services the
# tests need (PostgreSQL if it is down, a Ray head; the tests start S3 and Airflow themselves), run
# pytest, stop what it started.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/checkpoints -x).
# --fast first: the fast lane, the unit tests: every test marked neither `services` (tests/conftest.py says which
# are) nor `processes` (trainers and ranks in processes of their own); nothing is installed but .venv and nothing
# is started (scripts/test.sh --fast tests/spec -x). --local first: every test that needs no service, the
# `processes` ones included (a few minutes).
# --verl first: verl's trainer end to end on CPUs, its own lane (tests/trainers/test_verl_cpu_fit.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export GX_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
# Bytecode cached in __pycache__ (gitignored) where these machines set PYTHONDONTWRITEBYTECODE: pytest keeps its
# rewritten test modules there and every process of the tests Relay's own modules, so a second run collects in
# about half the time.
unset PYTHONDONTWRITEBYTECODE
# Lint, import order and layout first (ruff check, ruff format), then types (mypy over plugins/relay; the core
# layers strictly; settings of all in pyproject.toml): seconds, not a test run.
.venv/bin/ruff check --quiet
.venv/bin/ruff format --check --quiet || { echo "[test] run .venv/bin/ruff format to lay the code out" >&2; exit 1; }
.venv/bin/mypy
if [ "${1:-}" = "--fast" ] || [ "${1:-}" = "--local" ]; then
  lane=$([ "$1" = "--fast" ] && echo "not services and not processes" || echo "not services")
  shift
  exec .venv/bin/python -m pytest -m "$lane" -n "${RELAY_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
    -q "$@"
fi
# --verl: verl's own trainer end to end on CPUs, alone (7 to 12 minutes, 4 to 5 more for a run resharded
# from world size 2 to 1, and about 5 for the separate_async trainer; tests/conftest.py: VERL_E2E).
if [ "${1:-}" = "--verl" ]; then
  shift
  RELAY_VERL_E2E=1 exec .venv/bin/python -m pytest -q tests/trainers/test_verl_cpu_fit.py \
    tests/trainers/test_verl_reshard_resume.py tests/trainers/test_verl_separate_async.py "$@"
fi

# Debian's chromium for the browser tests (tests/e2e/test_ui.py): Playwright drives it, nothing is downloaded
# by Playwright itself. About 10 s on these machines.
if ! command -v chromium >/dev/null; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  t0=$SECONDS
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    chromium >/dev/null
  echo "[test] installed Debian's chromium in $((SECONDS - t0)) s"
fi
PY=.venv/bin/python

# What this script started is stopped at the end, and only that.
stop=()
trap 'for c in "${stop[@]}"; do eval "$c" >/dev/null 2>&1 || true; done' EXIT

# PostgreSQL for the real-scheduler tests (tests/e2e make a database of their own on it).
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg=$(ls /usr/lib/postgresql | sort -V | tail -1)
  pg_ctlcluster "$pg" main start
  stop+=("pg_ctlcluster $pg main stop")
  for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi

# One Ray head for the whole session (ports: include/stack.env). Stopped at the end only if started here.
if $PY -c 'import sys; sys.path.insert(0, "plugins"); import relay.devstack.stack as s; sys.exit(0 if s._http_ok(s.ray_address() + "/api/version") else 1)'; then
  echo "[test] using the Ray head already running"
else
  # 2 logical CPUs, as many chunk jobs at once as the 2 cores take (tests/conftest.py: ray_address); the
  # stack's default (at least 8, for verl's lane) let the suite's jobs pile onto the cores.
  $PY -m relay stack up --no-airflow --ray-cpus 2
  stop+=("$PY -m relay stack down")
fi

# Four workers on two cores, one test file each at a time: most tests wait on Ray, Airflow or S3 as
# much as on the CPU. The files go out in the order tests/conftest.py collects them, slowest first
# (--no-loadscope-reorder: xdist would hand out the files with the most tests first).
# The results go to .relay/test-results/junit.xml (xunit1 keeps each fault case's FAULTS.md row in it).
results=.relay/test-results
mkdir -p "$results" && rm -f "$results/junit.xml"
rc=0
$PY -m pytest -n "${RELAY_TEST_WORKERS:-4}" --dist loadfile --no-loadscope-reorder -o junit_family=xunit1 \
  --junitxml="$results/junit.xml" "$@" || rc=$?
# The fault cases among the tests (pytest -m fault): their rows of docs/FAULTS.md, and a one-line summary.
if [ -f "$results/junit.xml" ]; then
  $PY scripts/faults_report.py "$results/junit.xml" --out "$results/FAULTS.md" || true
fi
exit $rc
