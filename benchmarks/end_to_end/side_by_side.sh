#!/usr/bin/env bash
# jaxspec and vLLM 0.23 on one GPU machine, random and real Qwen2.5-Coder-1.5B weights, batch 1 / 8 / 32: the
# device calls of docs/lab/2026-11-26-h200-side-by-side.md, run from the repository root after the checkpoint and vLLM's
# wheel set were staged (../shared/tools/device_stage.py) to /tmp/models and the wheels installed to
# /tmp/vllm-site. Logs and JSON go to $OUT.
#
#   bash benchmarks/end_to_end/side_by_side.sh convert   # GGUF -> bf16 HF folder for vLLM, in the background
#   bash benchmarks/end_to_end/side_by_side.sh compile   # jaxspec's steps compiled (random weights), once per machine
#   bash benchmarks/end_to_end/side_by_side.sh vllm      # vLLM, dummy weights then the real ones
#   bash benchmarks/end_to_end/side_by_side.sh real      # jaxspec, real weights and tokenizer, text rendered every step
set -uo pipefail
OUT=${OUT:-/tmp/out}
GGUF=/tmp/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
HF=/tmp/models/qwen15-hf
# jaxspec reads GGUF through the gguf package, which the wheel set carries: that package alone on the path
mkdir -p /tmp/gguf-only && ln -sf /tmp/vllm-site/gguf /tmp/vllm-site/gguf-*.dist-info /tmp/gguf-only/ 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/gguf-only
summary() { grep -E "gc off|replayed|one decode layer|tok/s \(|engine up|copy|cuBLAS|host ms|Error" "$@"; }
wait_convert() { while pgrep -f gguf_to_hf >/dev/null; do sleep 2; done; tail -1 /tmp/convert.log; }
case "$1" in
  convert)
    PYTHONPATH=/tmp/vllm-site:$PWD setsid nohup python3 benchmarks/end_to_end/gguf_to_hf.py $GGUF $HF \
      >/tmp/convert.log 2>&1 &
    sleep 1; echo "conversion started" ;;
  compile)
    TRACE=0 timeout 540 python3 benchmarks/end_to_end/tpot_phases.py "" 1 8 32 >$OUT/compile_pass.log 2>&1
    summary $OUT/compile_pass.log ;;
  vllm)
    wait_convert
    for w in dummy real; do
      PYTHONPATH=/tmp/vllm-site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 timeout 280 python3 benchmarks/end_to_end/vllm_batches.py \
        $HF $OUT/vllm_$w.json $([ $w = dummy ] && echo --dummy) >$OUT/vllm_$w.log 2>&1
      echo "== vLLM $w weights"; summary $OUT/vllm_$w.log
    done ;;
  real)
    STOP=1 timeout 330 python3 benchmarks/end_to_end/tpot_phases.py $GGUF 1 8 32 >$OUT/real.log 2>&1
    echo "== jaxspec, real weights, text rendered every step"; summary $OUT/real.log
    timeout 200 python3 benchmarks/profiles/host_phases.py $GGUF 32 256 >$OUT/host_phases_real_b32.log 2>&1
    echo "== host phases, batch 32, real weights"; tail -2 $OUT/host_phases_real_b32.log ;;
  *) echo "unknown step $1"; exit 2 ;;
esac
