#!/usr/bin/env bash
# Where TP=2's extra time goes and which XLA collective settings cut it (issue #38): Llama-3.1-8B shapes, random
# bf16, steady decode step at batch 1 / 8 / 32 under each setting, then a per-kernel trace of one device.
# Run on nvidia-h100-x2 from the repository root: bash benchmarks/end_to_end/tp_collectives_gpu.sh [variants|trace]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
declare -A FLAGS=(
  [default]=""
  [cbcoll]="--xla_gpu_enable_command_buffer=+COLLECTIVES"
  [oneshot]="--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
  [both]="--xla_gpu_enable_command_buffer=+COLLECTIVES --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
)
steady() {   # tag tp xla_flags [extra bench args]
  local tag=$1 tp=$2 flags=$3; shift 3
  XLA_FLAGS="$flags" timeout 240 python3 -m jaxspec.bench --model llama-3.1-8b --random-weights --dtype bfloat16 \
    --tensor-parallel-size "$tp" --input-len 128 --output-len 64 --num-prompts 8 --max-concurrency 32 \
    --max-model-len 1024 --steady-state 1 8 32 --quiet --json "$OUT/$tag.json" "$@" > "$OUT/$tag.log" 2>&1
  echo "$tag rc=$? $(python3 -c "import json,sys
print(' '.join(f\"b{s['batch']}={s['device_step_ms']:.3f}/{s['wall_step_ms']:.3f}ms\" for r in json.load(open(sys.argv[1])) for s in r.get('steady', [])))" "$OUT/$tag.json" 2>&1 | tail -1)"
}
case "${1:-variants}" in
variants)
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  JAX_PLATFORMS=cuda timeout 240 python3 -m pytest -q -n 0 tests/gpu/test_tp_gpu.py 2>&1 | tail -3
  for v in default cbcoll oneshot both; do steady "tp2_$v" 2 "${FLAGS[$v]}"; done
  steady tp1_default 1 "" ;;
trace)   # VARIANT=name: the per-kernel breakdown of TP=1 and of TP=2 under that setting
  for tp in 1 2; do
    XLA_FLAGS="${FLAGS[${VARIANT:-default}]}" timeout 280 python3 benchmarks/profiles/profile_step.py \
      --model llama-3.1-8b --batches 1 8 --tensor-parallel-size $tp --trace-dir /tmp/trace_tp$tp --sequence 60 \
      > "$OUT/profile_tp$tp.txt" 2>&1; echo "profile tp$tp rc=$?"
  done ;;
esac
