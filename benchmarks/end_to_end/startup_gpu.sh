#!/usr/bin/env bash
# Start-up on one GPU (issue #35): cold and warm start to the first token, plain, with the 0.5B draft model at k = 4,
# adaptive k, and Llama-3.1-8B shapes (random bf16 weights); then the steady decode step of the programs the cold run
# compiled (tuned, and the fast tier), and of an older checkout in .bench_before/ (the same programs before this
# change) on the same machine.
#   bash benchmarks/end_to_end/startup_gpu.sh OUTDIR [plain|core|spec|eagle3|tp]   (each part within one 10-minute
#   call; core after plain on the same machine, for its cache; tp on two GPUs: nvidia-h100-x2)
set -u
OUT=${1:-/tmp/startup}; PART=${2:-plain}; mkdir -p "$OUT"; R=/tmp/su/$PART; [ $PART = core ] || rm -rf $R
M="--random-weights --max-num-batched-tokens 256 --max-model-len 448 --max-concurrency 32 --input-len 128"
Q="--model qwen2.5-coder-1.5b-instruct $M"
D="--spec-method draft_model --draft-model qwen2.5-coder-0.5b-instruct --num-spec-tokens 4"
t() { local n=$1; shift; echo "== $n"; timeout "$@" > "$OUT/$n.log" 2>&1; echo "rc=$?"; grep -A6 "^Start-up\|^batch" "$OUT/$n.log" | grep -v "^\s*$" | tail -8; }
if [ $PART = plain ]; then
t plain 300 python3 -m jaxspec.bench startup $Q --runs cold warm --cache-root $R/plain --json "$OUT/plain.json"
fi
if [ $PART = core ]; then
C=$(ls -d /tmp/su/plain/plain/jaxspec-0-cold-* | head -1)
t core_tuned 120 env JAXSPEC_CACHE=$C python3 benchmarks/end_to_end/bench_core.py --draft-batches --json "$OUT/core_tuned.json"
t core_before 150 env JAXSPEC_CACHE=$C PYTHONPATH=$PWD/.bench_before python3 .bench_before/benchmarks/end_to_end/bench_core.py --draft-batches --json "$OUT/core_before.json"
t core_fast 90 env JAXSPEC_CACHE=$C python3 benchmarks/end_to_end/bench_core.py --draft-batches --warmup fast --json "$OUT/core_fast.json"
fi
if [ $PART = spec ]; then
t draft 150 python3 -m jaxspec.bench startup $Q $D --runs cold warm --no-wait-compiled --cache-root $R/draft --json "$OUT/draft.json"
t adaptive 100 python3 -m jaxspec.bench startup $Q $D --adaptive-spec --runs cold --no-wait-compiled --cache-root $R/adaptive --json "$OUT/adaptive.json"
t llama8b 150 python3 -m jaxspec.bench startup --model llama-3.1-8b $M --runs cold warm --no-wait-compiled --cache-root $R/8b --json "$OUT/llama8b.json"
fi
if [ $PART = eagle3 ]; then   # a random head in the published layout (tests/eagle_heads.py), 32000-token draft vocabulary
python3 -c "import sys; sys.path.insert(0, 'tests'); from eagle_heads import write_eagle3_head
from jaxspec.models.random import KNOWN_SHAPES
write_eagle3_head('$R/eagle3_head', KNOWN_SHAPES['qwen2.5-coder-1.5b-instruct'], seed=0, draft_vocab_size=32000)"
t eagle3 200 python3 -m jaxspec.bench startup $Q --speculative-config "{\"method\": \"eagle3\", \"model\": \"$R/eagle3_head\", \"num_speculative_tokens\": 4}" --runs cold warm --no-wait-compiled --cache-root $R/eagle3 --json "$OUT/eagle3.json"
fi
if [ $PART = tp ]; then
t llama8b_tp2 200 python3 -m jaxspec.bench startup --model llama-3.1-8b $M -tp 2 --runs cold warm --no-wait-compiled --cache-root $R/tp2 --json "$OUT/llama8b_tp2.json"
fi
