#!/usr/bin/env bash
# The benchmarks on a GPU node without network, stage by stage (each stage fits one call of a job
# runner that keeps /tmp while the node stays warm; results go to $OUT, default ./out):
#
#   bash benchmarks/run_gpu.sh bench NAME SECONDS SCRIPT ARGS  install bitmatch (+ .whl/), run benchmarks/SCRIPT
#                                                            (GROUP/NAME.py: ops/gpu_ops.py, engine/gpu_e2e.py, ...)
#                                                            ARGS --out $OUT/NAME under a time limit, log beside it
#   bash benchmarks/run_gpu.sh tp                            tensor / expert parallel layouts over NCCL (2 GPUs)
#   bash benchmarks/run_gpu.sh stage  .offline/part-00 [...]  copy vLLM bundle parts (and manifest.json) to /tmp/bundle
#   bash benchmarks/run_gpu.sh install                       verify + unpack the bundle to /tmp/site, install
#                                                            bitmatch and the wheels in .whl/ (to /tmp/wh)
#   bash benchmarks/run_gpu.sh vllm ARGS...                  benchmarks/adapters/vllm_gpu.py ARGS (--out: $OUT)
#
# Every benchmark writes JSON with its command, machine and versions; copy it to benchmarks/results/
# (named <benchmark>_<card>[_runN].json) and run python scripts/results_page.py.
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

install_project() {
  python3 -m pip install -q --no-deps --no-build-isolation --no-index "$R"
  if compgen -G "$R/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wh "$R"/.whl/*.whl
  fi
}

bench() {  # NAME SECONDS SCRIPT ARGS...: a benchmark that runs out of time loses only its own rows
  local name=$1 lim=$2 script=$3
  shift 3
  if [[ ! -f $R/benchmarks/$script ]]; then  # e.g. a bare NAME.py from before the groups
    echo "run_gpu.sh: no benchmarks/$script (scripts live in groups: benchmarks/GROUP/NAME.py)" >&2
    return 2
  fi
  mkdir -p "$OUT"
  (cd /tmp && timeout -s ABRT -k 10 "$lim" python3 "$R/benchmarks/$script" --out "$OUT/$name" "$@") \
    >"$OUT/$name.log" 2>&1
  echo "== $name rc=$?"
  tail -4 "$OUT/$name.log"
}

case ${1:?usage: run_gpu.sh bench NAME SECONDS SCRIPT ARGS | tp | stage PARTS... | install | vllm ARGS...} in
bench)
  shift
  install_project
  bench "$@"
  ;;
tp)
  install_project
  bench tp_layout 280 parallel/tp_layout.py --world 2
  bench tp_dp_ep 250 parallel/tp_layout.py --world 2 --layout dp_ep
  ;;
stage)
  shift
  mkdir -p /tmp/bundle
  for p in "$@"; do cp "$R/$p" /tmp/bundle/; done
  cp "$R/.offline/manifest.json" /tmp/bundle/ 2>/dev/null || true
  ls -la /tmp/bundle
  ;;
install)
  python3 "$R/scripts/offline_bundle.py" install --parts /tmp/bundle --target /tmp/site
  install_project
  (cd /tmp && python3 -c "import vllm, bitmatch; print('vllm', vllm.__version__, 'bitmatch', bitmatch.__version__)")
  ;;
vllm)
  shift
  cd /tmp  # the checkout's folders would shadow the installed package
  python3 "$R/benchmarks/adapters/vllm_gpu.py" --out "$OUT" "$@"
  ;;
*)
  echo "run_gpu.sh: unknown stage $1" >&2
  exit 2
  ;;
esac
