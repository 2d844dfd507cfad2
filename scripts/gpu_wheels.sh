#!/usr/bin/env bash
# The wheels a device machine of this workplace lacks (Python 3.12, torch 2.11 and no package index there),
# downloaded here into .whl/ (git-excluded) at the versions this checkout's venv holds, so that one device
# call installs them and runs the GPU checks. What the H100 run of the fourteenth session used:
#
#   bash scripts/gpu_wheels.sh          # here, once (about 19 MB)
#   device run, carry [".whl"], command:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; mkdir -p /tmp/bin; for c in engine tuner \
#       workloads; do printf '#!/bin/sh\nexec python3 -m %s.cli "$@"\n' $c > /tmp/bin/$c; chmod +x /tmp/bin/$c; \
#       done; export PATH=/tmp/bin:$PATH MOETUNE_CACHE=/tmp/mc; bash scripts/gpu_check.sh
#
# MOETUNE_CACHE outside $OUT: the built-in checkpoints and kernels must not crowd out the 8 result files.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null \
  || echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"
py=${PYTHON:-.venv/bin/python}
# Not on the device image (its package list: /work/.library/device/KINDS.md), with what they need.
names="optuna sqlalchemy greenlet alembic mako colorlog fastapi starlette pydantic pydantic-core annotated-types
typing-inspection uvicorn httptools plotly gguf typing-extensions"
pins=()
for n in $names; do
  v=$("$py" -m pip show "$n" 2>/dev/null | awk '/^Version:/{print $2}')
  [[ -n $v ]] || { echo "gpu_wheels: $n is not installed in $py's environment" >&2; exit 1; }
  pins+=("$n==$v")
done
rm -rf .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls .whl | wc -l; du -sh .whl
