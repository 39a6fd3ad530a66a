#!/usr/bin/env bash
# The whole GPU check (about 5 minutes on an H200): LUT matmul kernels (correctness, timings
# against cuBLAS bf16, SmolLM2 decode) and FP8 attention against bf16 flash SDPA. Results, with
# the GPU's name, clocks and versions, go to bench/results/ (or $OUT when set).
#
# On a machine with this project's .venv it runs as is. On the lent GPU machine (bare; its
# python3 has torch and triton) first run `bash bench/gpu_pack.sh` here, then two device calls
# back to back (the machine goes back after 30 s idle; the first call's half stays on it):
#   1. carry [".gpu/wheels", ".gpu/smollm2.gguf.part-aa"]:  bash bench/gpu_check.sh --check
#   2. carry [".gpu/wheels", ".gpu/smollm2.gguf.part-ab"]:  bash bench/gpu_check.sh
# The first checks the kernels only; the second joins the GGUF halves and does everything.
# Without both halves the decode check is reported as not run and the script exits 1, after
# saving everything else.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
py=.venv/bin/python
[ -x "$py" ] || py=python3
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hilt-site \
        .gpu/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/hilt-site${PYTHONPATH:+:$PYTHONPATH}
fi
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
if [ "${1:-}" = "--check" ]; then
    exec "$py" -m hilt.cli bench kernels --check --json "$out/kernels-check-gpu.json"
fi
smollm2=()
if [ -f .gpu/smollm2.gguf.part-aa ] && [ -f .gpu/smollm2.gguf.part-ab ]; then
    cat .gpu/smollm2.gguf.part-aa .gpu/smollm2.gguf.part-ab >/tmp/smollm2.gguf && smollm2=(--smollm2 /tmp/smollm2.gguf)
fi
status=0
"$py" -m hilt.cli bench kernels --all "${smollm2[@]}" --json "$out/kernels-gpu.json" || status=1
"$py" -m hilt.cli bench attention --json "$out/attention-gpu.json" || status=1
exit $status
