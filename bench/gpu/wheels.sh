#!/usr/bin/env bash
# Wheels for running bench/gpu/check.py on a GPU machine that cannot download (Python 3.12, x86-64, a CUDA torch
# and transformers' own dependencies already installed): verl 0.9.1 without extras and what its imports need that
# such a machine lacks, transformers and tokenizers at the versions requirements.txt pins, and Ray 2.60 without
# its cluster binaries (gcs_server, raylet, the Java jar, the dashboard's web client): verl imports Ray, the check
# never starts it, and the whole set stays under 64 MiB.
#   bench/gpu/wheels.sh [DIR]         # default DIR: .whl
# There, from the repo root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && PYTHONPATH=/tmp/site \
#     python3 bench/gpu/check.py --json gpu-check.json
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.whl}
mkdir -p "$out"
out=$(cd "$out" && pwd)
platform=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pin() { grep -E "^$1==" requirements.txt | head -1; }
# What the check imports that such a machine lacks (read off an import of the check's modules with only the
# machine's packages and these).
wanted=(
  "$(pin verl)" "$(pin transformers)" "$(pin tokenizers)" "$(pin torchdata)" "$(pin pydantic)"
  hydra-core==1.3.2 omegaconf==2.3.0 tensordict==0.10.0 "pyvers<0.2" orjson importlib_metadata==8.7.0 codetiming
  dill pydantic-core annotated-types typing-inspection jsonschema referencing rpds-py jsonschema-specifications
  colorful cachetools datasets multiprocess uvicorn fastapi starlette
)
for w in "${wanted[@]}"; do
  python3 -m pip download -q "${platform[@]}" -d "$out" "$w"
done
# omegaconf needs antlr4 4.9.*, published as a source archive only: built here (pure Python).
python3 -m pip wheel -q --no-deps -w "$out" antlr4-python3-runtime==4.9.3
# Ray without what only a running cluster needs.
python3 -m pip download -q "${platform[@]}" -d "$out" "$(pin 'ray\[default\]' | sed 's/\[default\]//')"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && unzip -q "$out"/ray-*.whl && rm -rf ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet \
  ray/jars ray/dashboard/client/build ray/_private/runtime_env/agent/thirdparty_files &&
  python3 - <<'PY'
import glob, os
rec = glob.glob("ray-*.dist-info/RECORD")[0]
lines = [l for l in open(rec) if os.path.exists(l.split(",")[0]) or l.startswith(rec)]
open(rec, "w").writelines(lines)
PY
)
whl=$(ls "$out"/ray-*.whl)
rm "$whl"
(cd "$tmp" && zip -q -r -9 "$whl" ray ray-*.dist-info)
du -sh "$out"
