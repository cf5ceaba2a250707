#!/usr/bin/env bash
# The test command: install (.venv, and Debian's chromium for the browser tests), start the services the
# tests need (PostgreSQL if it is down, a Ray head; the tests start S3 and Airflow themselves), run
# pytest, stop what it started, and say what the run cost (scripts/test_budget.py: its wall time and its
# slowest tests). Extra arguments go to pytest (e.g. scripts/test.sh tests/checkpoints -x).
#
# The lanes (docs/development.md keeps their table: what each runs, its time, when to run it):
#   (none)    CI's suite (.ci/run): every test but the lanes' below, the kill matrix as a seeded sample.
#   --fast    the unit tests: neither `services` nor `processes` (tests/conftest.py says which are); nothing is
#             installed but .venv and nothing is started (scripts/test.sh --fast tests/spec -x).
#   --local   every test that needs no service, the `processes` ones included (a few minutes).
#   --verl    verl's trainer end to end on CPUs (the tests marked lane("verl")).
#   --faults  the whole fault matrix (every test marked `fault`, every kill point), then docs/FAULTS.md from it.
#   --seams   the seam stress test alone, RELAY_SEAM_ROUNDS rounds (default 100; CI runs 10).
#   --lanes   every lane that is not in CI (--verl, --faults, then --seams), each timed; run before every landing.
# A test marked lane(...) is left out of CI; RELAY_TEST_LANE selects a lane's tests (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
lane=ci
case "${1:-}" in --fast | --local | --verl | --faults | --seams | --lanes) lane=${1#--}; shift ;; esac

if [ "$lane" = lanes ]; then
  # Each lane in a run of its own (its own services, started and stopped), timed; all run even if one fails.
  rc=0 summary=()
  for each in verl faults seams; do
    t=$SECONDS r=0
    ./scripts/test.sh --"$each" "$@" || r=$?
    summary+=("$(printf '%-7s %s in %d:%02d' "$each" "$([ $r = 0 ] && echo passed || echo "FAILED (exit $r)")" \
      $(((SECONDS - t) / 60)) $(((SECONDS - t) % 60)))")
    [ $r = 0 ] || rc=$r
  done
  echo "[lanes] what ran (docs/development.md keeps these times):"
  printf '  %s\n' "${summary[@]}"
  exit $rc
fi

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
PY=.venv/bin/python
results=.relay/test-results
mkdir -p "$results"

if [ "$lane" = fast ] || [ "$lane" = local ]; then
  marks=$([ "$lane" = fast ] && echo "not services and not processes" || echo "not services")
  exec $PY -m pytest -m "$marks" -n "${RELAY_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -q "$@"
fi

# What the run cost, from its junit results; CI's suite is held to its budget (docs/development.md).
budget() {
  local budget_args=()
  [ "$lane" = ci ] && budget_args=(--budget 30)
  $PY scripts/test_budget.py "$1" --wall $((SECONDS - t0)) "${budget_args[@]}" || true
}

# verl's lane: its tests start the S3 server and the Ray heads they need (a verl chunk holds more logical CPUs and
# GPUs than CI's head gives), one at a time.
if [ "$lane" = verl ]; then
  rm -f "$results/verl.xml"
  rc=0
  RELAY_TEST_LANE=verl $PY -m pytest -q -o junit_family=xunit1 --junitxml="$results/verl.xml" "$@" || rc=$?
  [ -f "$results/verl.xml" ] && budget "$results/verl.xml"
  exit $rc
fi

# The seam stress lane: an old incarnation's writers around a fresh start, more rounds than CI's 20 (the test starts
# the S3 server it needs).
if [ "$lane" = seams ]; then
  rm -f "$results/seams.xml"
  rc=0
  RELAY_SEAM_ROUNDS=${RELAY_SEAM_ROUNDS:-100} $PY -m pytest -q -o junit_family=xunit1 --junitxml="$results/seams.xml" \
    tests/preflight/test_seam_stress.py "$@" || rc=$?
  [ -f "$results/seams.xml" ] && budget "$results/seams.xml"
  exit $rc
fi

# Debian's chromium for the browser tests (tests/e2e/test_ui.py): Playwright drives it, nothing is downloaded
# by Playwright itself. About 10 s on these machines.
if [ "$lane" = ci ] && ! command -v chromium >/dev/null; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  t=$SECONDS
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    chromium >/dev/null
  echo "[test] installed Debian's chromium in $((SECONDS - t)) s"
fi

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
# The results go to .relay/test-results/ (xunit1 keeps each fault case's FAULTS.md row in them).
junit=$results/$([ "$lane" = faults ] && echo faults.xml || echo junit.xml)
rm -f "$junit"
# The faults lane: every fault case, CI's and its own, and every kill point under both handoffs.
[ "$lane" = faults ] && export RELAY_TEST_LANE=faults
rc=0
$PY -m pytest -n "${RELAY_TEST_WORKERS:-4}" --dist loadfile --no-loadscope-reorder -o junit_family=xunit1 \
  --junitxml="$junit" "$@" || rc=$?
if [ -f "$junit" ]; then
  # The fault cases among the tests: their rows of the fault matrix. CI's sample goes beside its results; the
  # faults lane's whole matrix is docs/FAULTS.md.
  out=$([ "$lane" = faults ] && echo docs/FAULTS.md || echo "$results/FAULTS.md")
  r=0
  $PY scripts/faults_report.py "$junit" --out "$out" --wall $((SECONDS - t0)) --workers "${RELAY_TEST_WORKERS:-4}" || r=$?
  if [ "$lane" = faults ] && [ "$rc" = 0 ]; then rc=$r; fi  # a case that lost data fails the faults lane
  budget "$junit"
fi
exit $rc
