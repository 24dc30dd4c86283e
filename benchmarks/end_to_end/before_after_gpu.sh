#!/usr/bin/env bash
# A change that must cost nothing on the GPU, measured against the code before it on one machine: start-up to the
# first token (cold and warm, plain and with the 0.5B draft model at k = 4) and the decode step (bench_core.py) of the
# 1.5B's shapes, random bf16 weights. The older checkout sits in .bench_before/ (`git archive REV jaxspec benchmarks |
# tar -x -C .bench_before`; carried, since .git/info/exclude ignores it).
#   bash benchmarks/end_to_end/before_after_gpu.sh OUTDIR after|before     (one side per call: each fits a 10-minute call)
set -u
OUT=${1:?OUTDIR}; SIDE=${2:?after or before}; mkdir -p "$OUT"
case "$SIDE" in
  after)  ROOT=$PWD ;;
  before) ROOT=$PWD/.bench_before ;;
  *) echo "before_after_gpu.sh: unknown side '$SIDE'; give after or before" >&2; exit 2 ;;
esac
export PYTHONPATH=$ROOT PYTHONUNBUFFERED=1
R=/tmp/ba/$SIDE; rm -rf "$R"
# the flags as the start-up work measured them (benchmarks/end_to_end/startup_gpu.sh)
Q="--model qwen2.5-coder-1.5b-instruct --random-weights --max-num-batched-tokens 256 --max-model-len 448 --max-concurrency 32 --input-len 128"
D="--spec-method draft_model --draft-model qwen2.5-coder-0.5b-instruct --num-spec-tokens 4"
t() { local n=$1; shift; echo "== $SIDE $n"; timeout "$@" > "$OUT/$SIDE-$n.log" 2>&1; echo "rc=$?"
      grep -A8 "^Start-up\|^batch\|TPOT" "$OUT/$SIDE-$n.log" | grep -v "^\s*$" | tail -12; }
# cold start waits for every program at its final tier (the warm start and bench_core then load them from its store)
t plain 280 python3 -m jaxspec.bench startup $Q --runs cold warm --cache-root "$R/plain" --json "$OUT/$SIDE-plain.json"
C=$(ls -d "$R"/plain/*cold* | head -1)
t core 150 env JAXSPEC_CACHE="$C" python3 "$ROOT/benchmarks/end_to_end/bench_core.py" --json "$OUT/$SIDE-core.json"
t draft 150 python3 -m jaxspec.bench startup $Q $D --runs cold warm --no-wait-compiled --cache-root "$R/draft" \
  --json "$OUT/$SIDE-draft.json"
