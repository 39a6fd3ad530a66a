#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Triton kernels run under the
# interpreter on the CPU; GPU-only tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest "$@"
