#!/usr/bin/env bash
# Fresh machine -> installed -> tests. Used by .ci/run and the README.
#   bash scripts/test.sh                       the whole suite, as CI runs it
#   bash scripts/test.sh tests/test_patch.py   one file (or tests/X.py::test_y, several paths)
#   bash scripts/test.sh -m "not slow"         the quick tier: the whole suite less the slow tests
# Other arguments go to pytest (-x, -k EXPR, -n 0 for one process). An install already in place
# (torch 2.13.0, bitmatch editable from this clone, the [dev] extras, vLLM) is not redone;
# BITMATCH_REINSTALL=1 redoes it.
set -euo pipefail
cd "$(dirname "$0")/.."
installed() {
  python - <<'EOF' 2>/dev/null
import os, torch, bitmatch, pytest, xdist, hypothesis, triton, trl, peft, matplotlib, vllm
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
assert os.path.dirname(os.path.dirname(os.path.abspath(bitmatch.__file__))) == os.getcwd(), bitmatch.__file__
EOF
}
if [ "${BITMATCH_REINSTALL:-0}" != "0" ] || ! installed; then
  # torch first, from the local CPU build: a bare "torch" would pull a multi-GB CUDA build
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[dev]"
  # real vLLM for CPU: the vLLM adapter tests run against it
  bash scripts/install_vllm.sh
else
  echo "scripts/test.sh: torch 2.13.0, bitmatch (this clone), [dev] and vLLM already installed (BITMATCH_REINSTALL=1 redoes it)"
fi
# one package tree: bitmatch.kernels and bitmatch.adapters, no top-level "kernels" package
(cd / && python -c "import bitmatch.kernels, bitmatch.adapters, importlib.util as u; s = u.find_spec('kernels'); assert s is None or 'bitmatch' not in str(s.origin), s")
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-/tmp/bitmatch-vllm-cache}"
# a skip for a broken environment (Triton interpreter not set, a module not importable, a [dev]
# dependency missing) fails the run; tests/conftest.py prints the outcomes and the skips by reason
export BITMATCH_CI=1
# the whole tests/ folder unless an argument names a test path (a file, a folder, file::test)
where=tests
for a in "$@"; do
  case "$a" in -*) continue ;; esac
  if [ -e "${a%%::*}" ]; then where=; break; fi
done
set +e
python -m pytest -q -n 2 --durations=15 $where "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
