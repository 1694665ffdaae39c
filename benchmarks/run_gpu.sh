#!/usr/bin/env bash
# The GPU benchmarks of vLLM on a GPU node without network, stage by stage (each stage fits one
# call of a job runner that keeps /tmp while the node stays warm):
#
#   bash benchmarks/run_gpu.sh stage  .offline/part-00 [...]  copy bundle parts (and manifest.json) to /tmp/bundle
#   bash benchmarks/run_gpu.sh install                       verify + unpack the bundle to /tmp/site, install
#                                                            bitmatch and the wheels in .whl/ (to /tmp/wh)
#   bash benchmarks/run_gpu.sh vllm ARGS...                  benchmarks/vllm_gpu.py ARGS (--out defaults to $OUT)
#
# The bundle is built on a machine with network: python scripts/offline_bundle.py build (see
# docs/offline_install.md); .whl/ holds the wheels the node lacks beyond it (xxhash, hypothesis,
# sortedcontainers; openai 2.48 and distro where the bundle predates their pin).
set -euo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$R/out}
export PYTHONPATH=/tmp/wh:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not in the bundle
export PYTHONFAULTHANDLER=1

case ${1:?usage: run_gpu.sh stage PARTS... | install | vllm ARGS...} in
stage)
  shift
  mkdir -p /tmp/bundle
  for p in "$@"; do cp "$R/$p" /tmp/bundle/; done
  cp "$R/.offline/manifest.json" /tmp/bundle/ 2>/dev/null || true
  ls -la /tmp/bundle
  ;;
install)
  python3 "$R/scripts/offline_bundle.py" install --parts /tmp/bundle --target /tmp/site
  python3 -m pip install -q --no-deps --no-build-isolation --no-index "$R"
  if compgen -G "$R/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wh "$R"/.whl/*.whl
  fi
  (cd /tmp && python3 -c "import vllm, bitmatch; print('vllm', vllm.__version__, 'bitmatch', bitmatch.__version__)")
  ;;
vllm)
  shift
  cd /tmp  # the checkout's folders would shadow the installed package
  python3 "$R/benchmarks/vllm_gpu.py" --out "$OUT" "$@"
  ;;
*)
  echo "run_gpu.sh: unknown stage $1" >&2
  exit 2
  ;;
esac
