#!/usr/bin/env bash
# The long-prompt measurements of issue #62 on one GPU machine, from the repository root, one step per device call
# (docs/lab/2026-12-07-long-prompts-gpu.md). Logs and JSON go to $OUT (at most 8 files come back a call).
#
#   bash benchmarks/end_to_end/long_prompts_gpu.sh checks       # GPU tests of the prefill kernel and the fp8 cache
#   bash benchmarks/end_to_end/long_prompts_gpu.sh kernels      # prefill and decode attention kernels alone
#   bash benchmarks/end_to_end/long_prompts_gpu.sh decode       # decode over 32k: split counts, kernel and engine
#   bash benchmarks/end_to_end/long_prompts_gpu.sh jaxspec NAME [long_prompts.py flags]   # -> $OUT/NAME.json
#   bash benchmarks/end_to_end/long_prompts_gpu.sh vllm NAME [the same flags]   # vLLM 0.26 (wheels in /tmp/vllm-site)
#
# The vllm step installs the wheel set first if /tmp/models/vllm-wheels holds it and /tmp/vllm-site does not
# (benchmarks/vllm_wheels_026.sh with LEAN=1, staged by ../shared/tools/device_stage.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JAX_PLATFORMS=cuda
step=$1; shift
case "$step" in
  checks)
    timeout 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/gpu/test_prefill_attention_gpu.py \
      tests/gpu/test_kv_cache_fp8_gpu.py 2>&1 | tail -15 ;;
  kernels)
    timeout 150 python3 benchmarks/kernels/bench_prefill_attention.py --contexts 8192 32768 --chunks 512 2048 \
      --q-tiles 16 32 64 128 --heads 1 2 6 --iters 5 --json $OUT/prefill_kernel.json 2>&1 | grep -v "^W0000\|^I0000" | tail -40
    timeout 120 python3 benchmarks/kernels/bench_decode_attention.py --contexts 1024 8192 32768 --batches 1 8 32 \
      --iters 10 --json $OUT/decode_kernel.json 2>&1 | grep -v "^W0000\|^I0000" | tail -40 ;;
  decode)   # the split count of a decode row over a long context (FUSED_PAGES_PER_SPLIT), in one call: the kernel
            # alone (a device loop of layers, no dispatch counted), then the engine's TPOT at 1k and 32k with 0 and 32
    timeout 120 python3 benchmarks/kernels/bench_decode_attention.py --contexts 1024 32768 --batches 1 8 \
      --splits 16 64 128 --pages-per-iter 0 4 --iters 5 --inner 20 --json $OUT/decode_kernel.json 2>&1 \
      | grep -v "^W0000\|^I0000" | tail -26
    for pages in 0 32; do
      STEP_TIMEOUT=150 bash "$0" jaxspec split$pages --runs 1x1024 1x32704 8x32704 --max-num-batched-tokens 2048 \
        --fused-pages-per-split $pages
    done ;;
  jaxspec)
    name=$1; shift
    timeout ${STEP_TIMEOUT:-300} python3 benchmarks/end_to_end/long_prompts.py --random-weights "$@" \
      --json $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== jaxspec $name (exit $?): $*"; grep -E " tokens: |Error|error:" $OUT/$name.log | tail -12 ;;
  vllm)
    name=$1; shift
    if [ ! -d /tmp/vllm-site ] && [ -d /tmp/models/vllm-wheels ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-site \
        /tmp/models/vllm-wheels/*.whl && rm -rf /tmp/vllm-site/benchmarks /tmp/vllm-site/samples
    fi
    PYTHONPATH=/tmp/vllm-site:/tmp/vllm-site/nvidia_cutlass_dsl/dsl_packages:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 \
      JAX_PLATFORMS= timeout ${STEP_TIMEOUT:-300} python3 benchmarks/end_to_end/vllm_long_prompts.py \
      --random-weights "$@" --json $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== vLLM $name (exit $?): $*"; grep -E " tokens: |Error|error:|max_num_batched_tokens" $OUT/$name.log | tail -12 ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
