#!/usr/bin/env bash
# Builds llama.cpp for bench/perf_bench.py into .venv-llamacpp/ (ignored by git), from PyPI alone.
# llama.cpp's source is the one inside the llama-cpp-python sdist. It is built once with cmake:
# shared libraries for this CPU (GGML_NATIVE: -march=native, so AVX2/FMA on the dev machines), no
# GPU backend, nothing downloaded at build time (the server's prebuilt web UI, which comes from
# Hugging Face by default, is turned off). Both peers run that one build:
#   - build/llama.cpp/bin/llama-server: llama.cpp's native server (parallel slots, continuous
#     batching), the harness's choice;
#   - llama-cpp-python[server] (one request at a time), the fallback: installed into the venv
#     without compiling a second copy (LLAMA_BUILD=OFF); it loads the libraries above through
#     LLAMA_CPP_LIB_PATH.
# About 10 minutes on 2 idle cores. Idempotent: each part is skipped once done.
# A separate venv: never install llama-cpp-python into .venv (vLLM pins its own dependencies).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-llamacpp"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
src="$venv/src/llama_cpp_python-$version"
build="$venv/build/llama.cpp"

python="$(command -v python3.11 || command -v python3)"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip

if [ ! -d "$src" ]; then
  echo "downloading the llama-cpp-python $version sdist (llama.cpp's source) from PyPI" >&2
  "$venv/bin/pip" download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$venv/src"
  tar xzf "$src.tar.gz" -C "$venv/src"
fi

if [ ! -x "$build/bin/llama-server" ] || [ ! -x "$build/bin/llama-quantize" ]; then
  echo "building llama.cpp and llama-server (~10 min on 2 idle cores)" >&2
  mkdir -p "$build"
  cmake -S "$src/vendor/llama.cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$build/configure.log"
  cmake --build "$build" --target llama-server llama-quantize -j "$(nproc)"
fi

export LLAMA_CPP_LIB_PATH="$build/bin"
if ! "$venv/bin/python" -c "import llama_cpp.server.app" 2>/dev/null; then
  echo "installing llama-cpp-python[server] $version (bindings only, on the build above)" >&2
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$venv/bin/pip" install --quiet "$src[server]"
fi

# What the build uses of this CPU (expect AVX2 = 1 and FMA = 1 on the dev machines).
"$venv/bin/python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
echo "llama-server: $("$build/bin/llama-server" --version 2>&1 | tr "\n" " ")"
