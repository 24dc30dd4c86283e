#!/usr/bin/env bash
# jaxspec and vLLM 0.23 on one GPU machine, random and real Qwen2.5-Coder-1.5B weights, batch 1 / 8 / 32: the
# device calls of docs/benchmarks.md's side-by-side, after the checkpoint and vLLM's wheel set were staged
# (../shared/tools/device_stage.py) to /tmp/models. Logs and JSON go to $OUT.
#
#   bash scripts/probes/side_by_side.sh convert       # GGUF -> bf16 HF folder for vLLM, in the background
#   bash scripts/probes/side_by_side.sh jaxspec-random  # compile pass, then JAXSPEC_FUSED_NORM=0 / 1 A/B
#   bash scripts/probes/side_by_side.sh vllm          # vLLM, dummy weights then the real ones
#   bash scripts/probes/side_by_side.sh jaxspec-real  # real weights and tokenizer (text rendered every step)
set -uo pipefail
OUT=${OUT:-/tmp/out}
GGUF=/tmp/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
HF=/tmp/models/qwen15-hf
export PYTHONUNBUFFERED=1
summary() { grep -E "TPOT|replayed|one decode layer|tok/s|engine up|copy|cuBLAS|host phases|schedule" "$@"; }
wait_convert() { while pgrep -f gguf_to_hf >/dev/null; do sleep 2; done; tail -2 /tmp/convert.log; }
case "$1" in
  convert)
    PYTHONPATH=/tmp/vllm-site:$PWD setsid nohup python3 scripts/gguf_to_hf.py $GGUF $HF >/tmp/convert.log 2>&1 &
    sleep 1; echo "conversion started" ;;
  jaxspec-random)
    python3 scripts/probes/read_ceiling.py $OUT/read_ceiling.json 2>&1 | tee $OUT/read_ceiling.log
    TRACE=0 JAXSPEC_FUSED_NORM=1 python3 scripts/probes/tpot_phases.py "" 1 8 32 >$OUT/compile_pass.log 2>&1
    summary $OUT/compile_pass.log
    wait_convert
    for v in 0 1; do
      JAXSPEC_FUSED_NORM=$v python3 scripts/probes/tpot_phases.py "" 1 8 32 >$OUT/random_fused_norm_$v.log 2>&1
      echo "== JAXSPEC_FUSED_NORM=$v"; summary $OUT/random_fused_norm_$v.log
    done ;;
  vllm)
    wait_convert
    export PYTHONPATH=/tmp/vllm-site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
    for w in dummy real; do
      python3 scripts/vllm_batches.py $HF $OUT/vllm_$w.json $([ $w = dummy ] && echo --dummy) >$OUT/vllm_$w.log 2>&1
      echo "== vLLM $w weights"; summary $OUT/vllm_$w.log
    done ;;
  jaxspec-real)
    STOP=1 python3 scripts/probes/tpot_phases.py $GGUF 1 8 32 >$OUT/real.log 2>&1
    echo "== jaxspec real weights, text rendered every step"; summary $OUT/real.log
    python3 scripts/probes/host_phases.py $GGUF 32 256 >$OUT/host_phases_real_b32.log 2>&1
    echo "== host phases, batch 32, real weights"; cat $OUT/host_phases_real_b32.log | tail -4 ;;
  *) echo "unknown step $1"; exit 2 ;;
esac
