#!/usr/bin/env bash
# The documentation site (MkDocs, Material theme; mkdocs.yml, docs/):
#   ./scripts/docs.sh serve    read it at http://127.0.0.1:8000 while you edit
#   ./scripts/docs.sh build    build it strictly into .relay/site (every link and anchor must resolve)
# The reference pages are generated: python scripts/docs_reference.py (tests/project/test_docs.py fails when stale).
set -euo pipefail
export NO_MKDOCS_2_WARNING=1  # the Material theme's banner about MkDocs 2
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/python scripts/docs_reference.py
case "${1:-build}" in
  serve) exec .venv/bin/mkdocs serve --dev-addr 127.0.0.1:8000 ;;
  build) exec .venv/bin/mkdocs build --strict -d .relay/site ;;
  *) echo "usage: ./scripts/docs.sh serve|build" >&2; exit 2 ;;
esac
