#!/usr/bin/env bash
# Fresh machine -> installed -> full test suite. Used by .ci/run and the README.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first, from the local CPU build: a bare "torch" would pull a multi-GB CUDA build
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -c "import bitmatch.kernels, bitmatch.adapters; import importlib.util as u; assert u.find_spec('kernels') is None or 'site-packages/kernels' in str(u.find_spec('kernels').origin)"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/bitmatch-vllm-cache}"
set +e
python -m pytest -q -n 2 --durations=15 tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
