#!/usr/bin/env bash
# Set up (idempotent) and run the end-to-end report on the embedded defaults:
# real models (SmolLM2-135M, all-MiniLM-L6-v2) quantized to k-means, integer
# and 1-bit weights, evaluated, written to ./report/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hilt report "$@"
