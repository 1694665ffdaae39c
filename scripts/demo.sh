#!/usr/bin/env bash
# Fresh machine -> installed -> the main job: bitmatch demo (tiny model built in code, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[plot]"
bitmatch --version
bitmatch demo "$@"
