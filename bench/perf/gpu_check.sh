#!/usr/bin/env bash
# The whole GPU check (minutes on an H200): LUT matmul kernels (correctness, autotuned timings
# against cuBLAS bf16 with and without CUDA graphs, SmolLM2 decode) and FP8 attention against
# bf16 flash SDPA. Results, with the GPU's name, clocks and versions, go to bench/results/ (or
# $OUT when set). Exit 1 if any check fails or cannot run.
#
# With this project's .venv (scripts/setup.sh) it does everything in one run. On a GPU machine
# without network whose python3 has torch and triton: run `bash bench/perf/gpu_pack.sh` where the
# project is set up, copy the repository with its .gpu/ folder there, and run this script; it
# installs hilt and gguf from .gpu/common/ into a scratch folder. The check also runs in two parts
# on the same machine, for when one run must stay short:
#   bash bench/perf/gpu_check.sh kernels   tuning and timings, saved after every layer shape
#                                          (kernels-gpu.json, kernels-gpu.png)
#   bash bench/perf/gpu_check.sh rest      the kernel check (kernels-check-gpu.json), the decode
#                                          check (kernels-decode-gpu.json), FP8 attention
#                                          (attention-gpu.json)
# The SmolLM2 GGUF travels as two halves (.gpu/smollm2.gguf.part-aa/ab) checked against its sha256.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
stage="${1:-all}"
case "$stage" in
    all | kernels | rest) ;;
    *) echo "usage: bash bench/perf/gpu_check.sh [all|kernels|rest]" >&2; exit 2 ;;
esac
out="${OUT:-bench/results}"
mkdir -p "$out" || exit 1
py=.venv/bin/python
[ -x "$py" ] || py=python3
if compgen -G ".gpu/common/*.whl" >/dev/null; then
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hilt-site \
        .gpu/common/*.whl; then
        export PYTHONPATH=/tmp/hilt-site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "gpu_check: could not install .gpu/common/*.whl" >&2
    fi
fi
if ! "$py" -c "import hilt.kernels" 2>/dev/null; then
    echo "gpu_check: hilt is not installed for $py: pip install -e . (or bench/perf/gpu_pack.sh's wheels)" >&2
    exit 1
fi
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1

# The decode check's model: the packaged GGUF (.venv), or bench/perf/gpu_pack.sh's two halves joined.
smollm2=()
decode_ready=1
if [ -f .gpu/smollm2.gguf.part-aa ] && [ -f .gpu/smollm2.gguf.part-ab ]; then
    cat .gpu/smollm2.gguf.part-aa .gpu/smollm2.gguf.part-ab >/tmp/smollm2.gguf
    if [ "$(sha256sum </tmp/smollm2.gguf | cut -d' ' -f1)" = "$(cat .gpu/common/smollm2.gguf.sha256 2>/dev/null)" ]; then
        smollm2=(--smollm2 /tmp/smollm2.gguf)
    else
        echo "gpu_check: the joined .gpu/smollm2.gguf.part-* do not match .gpu/common/smollm2.gguf.sha256" >&2
        decode_ready=0
    fi
elif [ "$stage" != kernels ] && compgen -G ".gpu/smollm2.gguf.part-*" >/dev/null; then
    echo "gpu_check: only $(basename .gpu/smollm2.gguf.part-*) is here; the decode check needs both halves" \
        "on this machine (this script's header)" >&2
    decode_ready=0
fi

status=0
graphs=(--cuda-graphs --plot "$out/kernels-gpu.png" --json "$out/kernels-gpu.json")
if [ "$stage" = all ]; then
    if [ "$decode_ready" = 1 ]; then
        "$py" -m hilt.cli bench kernels --all ${smollm2[@]+"${smollm2[@]}"} "${graphs[@]}" || status=1
    else
        "$py" -m hilt.cli bench kernels "${graphs[@]}" || status=1
        status=1  # the decode check could not run (message above)
    fi
elif [ "$stage" = kernels ]; then
    "$py" -m hilt.cli bench kernels --timings "${graphs[@]}" || status=1
else
    "$py" -m hilt.cli bench kernels --check --json "$out/kernels-check-gpu.json" || status=1
    echo "gpu_check: ${SECONDS} s so far; the decode check next" >&2
    if [ "$decode_ready" = 1 ]; then
        "$py" -m hilt.cli bench kernels --decode ${smollm2[@]+"${smollm2[@]}"} --json "$out/kernels-decode-gpu.json" \
            || status=1
    else
        status=1
    fi
fi
if [ "$stage" != kernels ]; then
    echo "gpu_check: ${SECONDS} s so far; FP8 attention next" >&2
    "$py" -m hilt.cli bench attention --json "$out/attention-gpu.json" || status=1
fi
echo "gpu_check: stage '$stage' done in ${SECONDS} s, status $status" >&2
exit $status
