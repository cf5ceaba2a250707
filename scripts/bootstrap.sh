#!/usr/bin/env bash
# Create .venv at the repo root and install Relay's pinned stack into it, then Relay itself (editable:
# `pip install -e .`, which gives .venv/bin/relay). Idempotent: a stamp of the requirements' and
# pyproject's hash skips the install when nothing changed. Prints nothing but progress; fails loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${RELAY_PYTHON:-python3.11}
UV_VERSION=0.13.9  # pinned, as everything else
stamp=.venv/.relay-installed
want=$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $PY"
  "$PY" -m venv .venv
fi
# pip installs uv, and torch on its own (pip reads this machine's configuration: its find-links hold the CPU
# build); uv installs the rest, several times faster than pip. The bytecode is compiled at install on every
# core (uv's --compile-bytecode, then compileall for what pip installed), not left to the first import: where
# PYTHONDONTWRITEBYTECODE is set (it is on these machines) nothing would ever be cached, and every process
# of the tests would compile torch, Airflow and verl again.
.venv/bin/python -m pip install -q --no-compile --upgrade pip "uv==$UV_VERSION"
echo "[bootstrap] installing torch (CPU build) first"
.venv/bin/pip install -q --no-compile "$(grep -E '^torch==' requirements.txt)"
# uv reads no pip configuration: the index and find-links pip was given are passed on.
uv_args=()
[ -n "${PIP_INDEX_URL:-}" ] && uv_args+=(--index-url "$PIP_INDEX_URL")
for d in ${PIP_FIND_LINKS:-}; do [ -e "$d" ] && uv_args+=(--find-links "$d"); done
echo "[bootstrap] installing requirements.txt and requirements-dev.txt (uv), compiling .venv's bytecode"
.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python "${uv_args[@]}" \
  -r requirements.txt -r requirements-dev.txt
# uv compiles what it installs; torch and its dependencies, which pip installed, are compiled here on every core
# (a few of torch's files are templates that do not compile: compileall's exit status is not a failed install).
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3.11/site-packages >/dev/null || true
echo "[bootstrap] installing Relay (editable, from plugins/relay): .venv/bin/relay"
.venv/bin/pip install -q --no-compile --no-deps --no-build-isolation -e .
.venv/bin/uv pip check -q --python .venv/bin/python
echo "$want" > "$stamp"
echo "[bootstrap] done: $(.venv/bin/python -c 'import airflow, ray, verl, torch; print(f"airflow {airflow.__version__}, ray {ray.__version__}, verl {verl.__version__}, torch {torch.__version__}")')"
