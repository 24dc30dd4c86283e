#!/usr/bin/env bash
# FP8 weights on one GPU (issue #36), random weights of each preset's shapes, 128-token prompts, 256 greedy tokens:
#   vllm      vLLM 0.26 (wheel set staged and installed to /tmp/vllm-site) online FP8 (VLLM_FORMATS="fp8 bf16": and bf16), batch 1 / 8 / 32,
#             from a config.json of the 1.5B's shapes in .gpu/qwen15-cfg (load_format dummy)
#   jaxspec   jaxspec bf16 and fp8 on the same workload (bench_core.py: output tok/s of the generate call, TPOT and
#             the replayed device step), 1.5B
#   8b        Llama-3.1-8B shapes, fp8 (BF16_8B=1: and bf16), batch 1 / 8 / 32
#   eagle3    EAGLE-3 k = 4 over a bf16 and an fp8 target (the fp8 engine quantizes the head too), batch 1 / 8
#   bash benchmarks/end_to_end/fp8_gpu.sh OUTDIR PART
set -u
OUT=${1:-/tmp/fp8}; PART=${2:-jaxspec}; mkdir -p "$OUT"
t() { local n=$1; shift; echo "== $n"; timeout "$@" > "$OUT/$n.log" 2>&1; echo "rc=$?"; grep -v "VMM\|^W1127\|^I1127" "$OUT/$n.log" | tail -6; }
if [ $PART = vllm ]; then
for q in ${VLLM_FORMATS:-fp8}; do   # VLLM_FORMATS="fp8 bf16" for both
  Q=$([ $q = fp8 ] && echo "--quantization fp8")
  t vllm_$q 300 env PYTHONPATH=/tmp/vllm-site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/end_to_end/vllm_batches.py .gpu/qwen15-cfg "$OUT/vllm_$q.json" --dummy $Q
done
fi
if [ $PART = jaxspec ]; then
t jaxspec_fp8 200 env PYTHONPATH=$PWD python3 benchmarks/end_to_end/bench_core.py --draft-batches --quantization fp8 --json "$OUT/jaxspec_fp8.json"
t jaxspec_bf16 200 env PYTHONPATH=$PWD python3 benchmarks/end_to_end/bench_core.py --draft-batches --json "$OUT/jaxspec_bf16.json"
fi
if [ $PART = 8b ]; then
t llama8b_fp8 250 env PYTHONPATH=$PWD python3 benchmarks/end_to_end/bench_core.py --model llama-3.1-8b --draft-batches --quantization fp8 --json "$OUT/llama8b_fp8.json"
[ -n "${BF16_8B:-}" ] && t llama8b_bf16 250 env PYTHONPATH=$PWD python3 benchmarks/end_to_end/bench_core.py --model llama-3.1-8b --draft-batches --json "$OUT/llama8b_bf16.json"
fi
if [ $PART = eagle3 ]; then
t eagle3_fp8 250 env PYTHONPATH=$PWD python3 benchmarks/end_to_end/bench_eagle3_step.py --quantization fp8
t eagle3_bf16 250 env PYTHONPATH=$PWD python3 benchmarks/end_to_end/bench_eagle3_step.py
fi
