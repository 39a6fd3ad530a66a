#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Triton kernels run under the
# interpreter on the CPU; GPU-only tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# llama.cpp's tools, the judges of `hilt export gguf` (tests/test_llama_cpp.py); built once, then cached.
# A failed build is reported and those tests skip; the rest of the suite still runs.
bash scripts/build_llama_cpp.sh || echo "test.sh: llama.cpp tools not built; tests/test_llama_cpp.py will skip" >&2
export TRITON_INTERPRET=1
# One pytest worker per core, at most 4 (pytest-xdist; HILT_TEST_WORKERS=0 runs them in this process), each
# taking whole files, so that a module's shared fixtures are built once.
workers=$(nproc); [ "$workers" -gt 4 ] && workers=4
exec .venv/bin/python -m pytest -n "${HILT_TEST_WORKERS:-$workers}" --dist loadfile "$@"
