#!/usr/bin/env bash
# The model families of issue #39 on one GPU, random bf16 weights of each preset's shapes, 128-token prompts, 256
# greedy tokens (EOS ignored), batch 1 / 8 / 32:
#   jaxspec MODEL   bench_core.py: TPOT, output tok/s and the replayed device step, plain and with a random EAGLE-3
#                   head at k = 4 (the speculative step's cost; random drafts are rejected)
#   vllm MODEL      vLLM 0.26 (benchmarks/vllm_wheels_026.sh's set installed to /tmp/vllm-site) on the same workload
#                   (DUMMY_RANGE=A: its dummy weights uniform in [-A, A], see vllm_batches.py)
#                   (vllm_batches.py), load_format dummy, from the preset's config.json (vllm_startup.py's hf_config)
#   MODEL: gemma-3-12b, gpt-oss-20b, qwen3-30b-a3b, mistral-7b, gemma-3-4b
#   CKPT=DIR: both engines load this HF checkpoint's weights (random_hf_checkpoint.py) instead of their own random ones
#   bash benchmarks/end_to_end/families_gpu.sh OUTDIR PART MODEL
set -u
OUT=${1:-/tmp/families}; PART=${2:-jaxspec}; MODEL=${3:-gemma-3-12b}; mkdir -p "$OUT"
t() { local n=$1; shift; echo "== $n"; timeout "$@" > "$OUT/$n.log" 2>&1; echo "rc=$?"; grep -v "VMM\|^W11\|^I11" "$OUT/$n.log" | tail -12; }
if [ "$PART" = jaxspec ]; then
  t "jaxspec_$MODEL${CKPT:+_ckpt}" ${TIMEOUT:-540} env PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/end_to_end/bench_core.py --model "$MODEL" \
    ${CKPT:+--weights $CKPT} --warmup ${WARMUP:-full} --draft-batches --eagle3-batches ${EAGLE3_BATCHES:-1 8 32} --json "$OUT/jaxspec_$MODEL${CKPT:+_ckpt}.json"
fi
if [ "$PART" = vllm ]; then
  DUMMY=--dummy; [ -n "${CKPT:-}" ] && DUMMY=
  CFG=${CKPT:-$(PYTHONPATH=$PWD python3 -c "import sys; sys.path.insert(0, 'benchmarks/end_to_end'); import vllm_startup; print(vllm_startup.model_dir('$MODEL', '/tmp/vllm-configs'))")}
  t "vllm_$MODEL${DUMMY_RANGE:+_range$DUMMY_RANGE}${CKPT:+_ckpt}" ${TIMEOUT:-540} env PYTHONPATH=/tmp/vllm-site:/tmp/vllm-site/nvidia_cutlass_dsl/dsl_packages:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 \
    benchmarks/end_to_end/vllm_batches.py "$CFG" "$OUT/vllm_$MODEL${DUMMY_RANGE:+_range$DUMMY_RANGE}${CKPT:+_ckpt}.json" $DUMMY \
    --gpu-memory-utilization ${GPU_UTIL:-0.9} ${DUMMY_RANGE:+--dummy-range $DUMMY_RANGE}
fi
