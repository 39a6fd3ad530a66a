#!/usr/bin/env bash
# Build the llama.cpp command-line tools that judge hilt's GGUF files (llama-perplexity,
# llama-simple, llama-completion, llama-tokenize, llama-bench), CPU only, from the llama.cpp
# sources vendored in the llama-cpp-python sdist on the package index.
#
#   bash scripts/build_llama_cpp.sh          # tools in ${HILT_LLAMA_CPP:-~/.cache/hilt/llama.cpp}/bin
#
# Cached: a second run with the same sdist version, compiler and tool list does nothing.
# Nothing else downloads: the sdist comes through pip from the configured package index (kept in
# the cache), or from HILT_LLAMA_CPP_SDIST (a local .tar.gz). Tests that need the tools skip when
# they are absent; hilt finds them through HILT_LLAMA_CPP or the default path above.
set -euo pipefail

VERSION="${HILT_LLAMA_CPP_VERSION:-0.3.36}"
ROOT="${HILT_LLAMA_CPP:-$HOME/.cache/hilt/llama.cpp}"
JOBS="${HILT_LLAMA_CPP_JOBS:-2}"
TOOLS=(llama-perplexity llama-simple llama-completion llama-tokenize llama-bench)
CC_BIN="${CC:-cc}"
CXX_BIN="${CXX:-c++}"

need() { command -v "$1" >/dev/null 2>&1 || { echo "build_llama_cpp: '$1' not found (needed to build llama.cpp)" >&2; exit 1; }; }
need cmake
need "$CC_BIN"
need "$CXX_BIN"

compiler="$("$CXX_BIN" --version | head -n1)"
# No AMX: built for this CPU (-march=native), ggml's AMX matmul runs tile instructions the kernel has not
# enabled for the process, and llama-perplexity dies of SIGILL on batches (seen on a Xeon with AMX).
NO_AMX=""
if [[ "$(uname -m)" == x86_64 ]]; then NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
stamp_text="llama-cpp-python ${VERSION} | ${compiler} | ${TOOLS[*]} | ${NO_AMX:-native} | log drained at exit"
stamp="$ROOT/bin/.stamp"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]]; then
  all=1
  for t in "${TOOLS[@]}"; do [[ -x "$ROOT/bin/$t" ]] || all=0; done
  if [[ $all == 1 ]]; then
    echo "build_llama_cpp: up to date in $ROOT/bin ($stamp_text)"
    exit 0
  fi
fi

mkdir -p "$ROOT/src"
sdist="${HILT_LLAMA_CPP_SDIST:-$ROOT/src/llama_cpp_python-${VERSION}.tar.gz}"
if [[ ! -f "$sdist" ]]; then
  echo "build_llama_cpp: fetching the llama-cpp-python ${VERSION} sdist from the package index"
  tmp_dl="$(mktemp -d "$ROOT/src/dl.XXXXXX")"
  # --no-binary: the sdist (the wheels carry no tools); pip prepares its metadata, which takes a while.
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==${VERSION}" -d "$tmp_dl"
  mv "$tmp_dl"/llama_cpp_python-"${VERSION}".tar.gz "$ROOT/src/"
  rm -rf "$tmp_dl"
  sdist="$ROOT/src/llama_cpp_python-${VERSION}.tar.gz"
fi

work="$ROOT/build-${VERSION}"
rm -rf "$work"
mkdir -p "$work"
echo "build_llama_cpp: unpacking $sdist"
tar -xzf "$sdist" -C "$work" --strip-components=1 \
  "llama_cpp_python-${VERSION}/vendor/llama.cpp"
src="$work/vendor/llama.cpp"

# llama.cpp's tools print through a logging thread whose singleton is never torn down, so a busy machine can
# exit before the thread has written the last lines (llama-perplexity's estimate among them). Drain it at exit.
anchor='log->set_colors(tty_can_use_colors());'
grep -qF "$anchor" "$src/common/log.cpp" || { echo "build_llama_cpp: common/log.cpp has changed; the exit drain cannot be added" >&2; exit 1; }
sed -i "s|$anchor|$anchor std::atexit([]() { common_log_main()->pause(); });|" "$src/common/log.cpp"

echo "build_llama_cpp: configuring (Release, CPU only, static)"
cmake -S "$src" -B "$work/build" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER="$CC_BIN" -DCMAKE_CXX_COMPILER="$CXX_BIN" \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF -DGGML_OPENMP=OFF \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_RPC=OFF \
  >"$work/configure.log" 2>&1 || { tail -n 30 "$work/configure.log" >&2; echo "build_llama_cpp: cmake configure failed (log: $work/configure.log)" >&2; exit 1; }

echo "build_llama_cpp: building ${TOOLS[*]} with -j${JOBS} (several minutes)"
cmake --build "$work/build" --config Release -j "$JOBS" --target "${TOOLS[@]}" \
  >"$work/build.log" 2>&1 || { tail -n 30 "$work/build.log" >&2; echo "build_llama_cpp: build failed (log: $work/build.log)" >&2; exit 1; }

mkdir -p "$ROOT/bin"
for t in "${TOOLS[@]}"; do
  install -m 755 "$work/build/bin/$t" "$ROOT/bin/$t"
done
printf '%s' "$stamp_text" >"$stamp"
rm -rf "$work"
echo "build_llama_cpp: built ${TOOLS[*]} into $ROOT/bin"
