#!/usr/bin/env bash
# The LoRA step-time measurement of issue #65 on one GPU machine, from the repository root: Qwen2.5-Coder-1.5B shapes,
# random bf16 weights, rank-16 random adapters on every projection (jaxspec.lora.peft.write_random_adapter), the
# replayed decode step at batch 1 / 8 / 32 with no adapter, one adapter for every row, and 8 adapters in turn.
# Logs and JSON go to $OUT.
#
#   bash benchmarks/end_to_end/lora_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAX_PLATFORMS=cuda
common="--model qwen2.5-coder-1.5b-instruct --random-weights --num-prompts 8 --input-len 128 --output-len 64
        --max-model-len 1024 --max-concurrency 32 --max-num-batched-tokens 512 --warmup fast --steady-state 1 8 32 --quiet"
for loras in 0 1 8; do
  extra=""
  [ $loras -gt 0 ] && extra="--random-loras $loras --max-lora-rank 16"
  timeout 300 python3 -m jaxspec.bench $common $extra --json $OUT/lora_$loras.json > $OUT/lora_$loras.log 2>&1
  echo "== $loras adapters (exit $?)"; grep -E "Decode step, batch|Error" $OUT/lora_$loras.log
done
