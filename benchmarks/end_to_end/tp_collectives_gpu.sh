#!/usr/bin/env bash
# Which all-reduce setting cuts TP's step (issue #38): Llama-3.1-8B shapes, random bf16, steady decode step at batch
# 1 / 8 / 32 per XLA setting and TP size. Run on nvidia-h100-x4 from the repository root:
#   GPUS=0,1 bash benchmarks/end_to_end/tp_collectives_gpu.sh 2 default sync ...
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
declare -A FLAGS=(
  [default]=""
  [sync]="--xla_gpu_disable_async_collectives=ALLREDUCE"
  [synconeshot]="--xla_gpu_disable_async_collectives=ALLREDUCE --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
  [nvshmem]="--xla_gpu_experimental_enable_nvshmem=true"
)
tp=$1; shift
for v in "$@"; do
  tag=tp${tp}_$v
  CUDA_VISIBLE_DEVICES=${GPUS:-0} XLA_FLAGS="${FLAGS[$v]}" timeout ${LIMIT:-240} python3 -m jaxspec.bench --model llama-3.1-8b \
    --random-weights --dtype bfloat16 --tensor-parallel-size "$tp" --input-len 128 --output-len 64 --num-prompts 8 \
    --max-concurrency 32 --max-model-len 1024 --steady-state 1 8 32 --quiet --json "$OUT/$tag.json" ${EXTRA:-} \
    > "$OUT/$tag.log" 2>&1
  echo "$tag rc=$? $(python3 -c "import json,sys
print(' '.join(f\"b{s['batch']}={s['device_step_ms']:.3f}/{s['wall_step_ms']:.3f}ms\" for r in json.load(open(sys.argv[1])) for s in r.get('steady', [])))" "$OUT/$tag.json" 2>&1 | tail -1)"
done
