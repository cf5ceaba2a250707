#!/usr/bin/env bash
# Vulnerability audit of Relay's pinned environment (.venv: requirements.txt and everything it pulls in).
#   ./scripts/audit.sh            pip-audit (PyPI's vulnerability data), from its own venv (.venv-audit)
#   ./scripts/audit.sh --db DIR   offline: against a local OSV advisory database (a checkout of
#                                 github.com/pypa/advisory-database), for machines that cannot reach
#                                 pip-audit's services
# Exit: 0 no known vulnerability, 1 findings (docs/SECURITY.md says what was done about each),
#       3 blocked: the vulnerability service cannot be reached from here (nothing was audited).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
if [ "${1:-}" = "--db" ]; then
  exec .venv/bin/python scripts/audit_offline.py "$2" "${@:3}"
fi
# pip-audit asks PyPI's JSON API for each installed version; a mirror that lacks the per-version
# endpoint (or no route to PyPI) makes every package "not found": say so instead of a false all-clear.
probe=$(.venv/bin/python -c 'import importlib.metadata as m; print("https://pypi.org/pypi/pyyaml/" + m.version("PyYAML") + "/json")')
if ! .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=20)" "$probe" 2>/dev/null; then
  echo "[audit] BLOCKED: $probe does not answer from here, so pip-audit cannot audit anything;" \
       "run ./scripts/audit.sh --db ADVISORY_DB on this machine, or pip-audit where PyPI is reachable" >&2
  exit 3
fi
if [ ! -x .venv-audit/bin/pip-audit ]; then
  # pip-audit pins its own requests/rich/packaging ranges: a venv of its own keeps .venv's `pip check` clean.
  python3.11 -m venv .venv-audit && .venv-audit/bin/pip install -q pip-audit==2.10.1
fi
exec .venv-audit/bin/pip-audit --path .venv/lib/python3.11/site-packages --strict --progress-spinner off "$@"
