#!/usr/bin/env bash
# Fresh machine -> installed -> full test suite. Used by .ci/run and the README.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first, from the local CPU build: a bare "torch" would pull a multi-GB CUDA build
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# real vLLM for CPU: the vLLM adapter tests run against it
bash scripts/install_vllm.sh
# one package tree: bitmatch.kernels and bitmatch.adapters, no top-level "kernels" package
(cd / && python -c "import bitmatch.kernels, bitmatch.adapters, importlib.util as u; s = u.find_spec('kernels'); assert s is None or 'bitmatch' not in str(s.origin), s")
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/bitmatch-vllm-cache}"
# a skip for a broken environment (Triton interpreter not set, a module not importable, a [dev]
# dependency missing) fails the run; tests/conftest.py prints the outcomes and the skips by reason
export BITMATCH_CI=1
set +e
python -m pytest -q -n 2 --durations=15 tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
