#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Triton kernels run under the
# interpreter on the CPU; GPU-only tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
# One pytest worker per core, at most 4 (pytest-xdist; HILT_TEST_WORKERS=0 runs them in this process).
workers=$(nproc); [ "$workers" -gt 4 ] && workers=4
exec .venv/bin/python -m pytest -n "${HILT_TEST_WORKERS:-$workers}" "$@"
