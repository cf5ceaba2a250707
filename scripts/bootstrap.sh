#!/usr/bin/env bash
# Create .venv at the repo root and install Relay's pinned stack into it, then Relay itself (editable:
# `pip install -e .`, which gives .venv/bin/relay). Idempotent: a stamp of the requirements' and
# pyproject's hash skips pip when nothing changed. Prints nothing but progress; fails loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${RELAY_PYTHON:-python3.11}
stamp=.venv/.relay-installed
want=$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $PY"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "[bootstrap] installing torch (CPU build) first"
.venv/bin/pip install -q "$(grep -E '^torch==' requirements.txt)"
echo "[bootstrap] installing requirements.txt and requirements-dev.txt"
.venv/bin/pip install -q -r requirements.txt -r requirements-dev.txt
echo "[bootstrap] installing Relay (editable, from plugins/relay): .venv/bin/relay"
.venv/bin/pip install -q --no-deps --no-build-isolation -e .
.venv/bin/pip check
echo "$want" > "$stamp"
echo "[bootstrap] done: $(.venv/bin/python -c 'import airflow, ray, verl, torch; print(f"airflow {airflow.__version__}, ray {ray.__version__}, verl {verl.__version__}, torch {torch.__version__}")')"
