#!/usr/bin/env bash
# The measurements of prefix caching, n and the server (issue #13), on one GPU. Run from the repository root on
# the GPU machine, with the server's wheels carried in .wheels/ (fastapi, starlette, uvicorn, pydantic) and the
# multi-turn workload in .gpu/sharegpt_mt.json, written here beforehand by:
#   jaxspec-bench --model smollm2-135m-instruct --dataset sharegpt-multiturn --output-len 128 --num-prompts 64 \
#     --max-model-len 2048 --max-turns 4 --save-workload .gpu/sharegpt_mt.json
# Results: one JSON per run under ${OUT:-/tmp/out}.
set -euo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d .wheels ] && python3 -m pip install -q --no-index --find-links .wheels fastapi uvicorn pydantic starlette
# Every run below has the same engine shapes: the compiled steps come from the persistent cache after the first.
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
MODEL=qwen2.5-coder-1.5b-instruct
ENGINE="--max-model-len 2048 --max-num-batched-tokens 1024"
BENCH="python3 -m jaxspec.bench --model $MODEL --random-weights --dtype bfloat16 $ENGINE --max-concurrency 32 --quiet"

# 1. A 1024-token system prompt + 32-token questions arriving at 8/s; then ShareGPT conversations turn by turn.
for cache in enable no-enable; do
  $BENCH --dataset prefix --prefix-len 1024 --input-len 32 --output-len 64 --num-prompts 128 --request-rate 8 \
    --$cache-prefix-caching --json "$OUT/prefix_$cache.json"
  $BENCH --dataset file --dataset-path .gpu/sharegpt_mt.json --num-prompts 64 --request-rate 4 \
    --$cache-prefix-caching --json "$OUT/multiturn_$cache.json"
done

# 2. The server against the offline LLM at the same concurrency (32), same prompts (random ids, seed 0).
WORK="--dataset random --input-len 128 --output-len 256 --num-prompts 128"
$BENCH $WORK --json "$OUT/offline.json"
python3 -m jaxspec.cli serve $MODEL --random-weights --dtype bfloat16 $ENGINE --max-num-seqs 32 --port 8000 \
  --log-level warning > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
JAX_PLATFORMS=cpu python3 -m jaxspec.bench --base-url http://127.0.0.1:8000 --model $MODEL $WORK \
  --max-concurrency 32 --vocab-size 151936 --quiet --json "$OUT/serve.json"
kill $SERVER
