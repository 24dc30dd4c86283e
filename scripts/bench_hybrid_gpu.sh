#!/usr/bin/env bash
# Issue #15's measurement: Qwen3.5-2B shapes (scripts/configs/qwen3.5-2b-text, random bf16 weights) on one H100:
# TPOT and tok/s at batch 1 / 8 / 32, plain and MTP k=1..3 (random MTP weights accept ~nothing: this is the
# step-time cost of speculation), the chunked-prefill throughput, and vLLM 0.23 (load_format="dummy") side by side.
#
#   bash scripts/bench_hybrid_gpu.sh jax     # call 1 (~6-8 min cold): jaxspec plain b1/b8/b32, MTP k=1..3 at b32
#                                            #   (+ steady-state step times at 1/8/32 in the b32 runs), prefill
#   bash scripts/bench_hybrid_gpu.sh vllm    # call 2: vLLM plain b1/b8/b32 (jaxspec plain rerun beside it, cached)
#   bash scripts/bench_hybrid_gpu.sh vllm-mtp  # call 3 if device time is left: vLLM MTP k=1..3 at b32
#   bash scripts/bench_hybrid_gpu.sh cpu     # the jaxspec commands on a scaled-down copy of the config, on CPU
#
# Run from the repository root. Every JSON goes to $OUT_DIR (/tmp/out); WALL lines give each command's seconds.
# GPU prerequisites: JAX with CUDA in the python3 on PATH (or /tmp/site), vLLM 0.23 installed at /tmp/vllm-site
# (.gpu/prep_vllm.sh: the .whl-vllm wheel set). No tokenizer is needed: prompts are random token ids and vLLM
# runs with skip_tokenizer_init (jaxspec/vllm_baseline.py), language-model-only for this vision-language config.
set -u
STAGE=${1:-jax}
OUT_DIR=${OUT_DIR:-/tmp/out}
CFG=${CFG:-scripts/configs/qwen3.5-2b-text}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 JAXSPEC_CACHE=${JAXSPEC_CACHE:-/tmp/jcache} VLLM_USE_FLASHINFER_SAMPLER=0
export XLA_FLAGS=${XLA_FLAGS:---xla_gpu_enable_triton_gemm=false}
export PYTHONPATH=/tmp/vllm-site:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}

# 128-token random prompts, 256 output tokens, EOS ignored (the bench's default), bf16
IN=128 OUTLEN=256 MML=1024 MNBT=512 STEADY="1 8 32" STEPS=32 BATCHES="1 8 32" PF_IN=2048 PF_N=16 PF_MNBT=2048
if [ "$STAGE" = cpu ]; then   # the same commands, tiny: a scaled copy of the config, 4 prompts, 8 output tokens
  CFG=$(mktemp -d)
  $PY - "$CFG" <<'EOF'
import json, sys
src = json.load(open("scripts/configs/qwen3.5-2b-text/config.json"))
t = src["text_config"]
t.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
         linear_value_head_dim=16, vocab_size=512,
         layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(4)])
src["vision_config"]["out_hidden_size"] = 64
json.dump(src, open(sys.argv[1] + "/config.json", "w"), indent=1)
EOF
  IN=16 OUTLEN=8 MML=128 MNBT=64 STEADY="1 2" STEPS=4 BATCHES="2" PF_IN=64 PF_N=2 PF_MNBT=64
fi
BENCH="$PY -m jaxspec.bench --model $CFG --random-weights --dtype bfloat16 --dataset random --input-len $IN
  --output-len $OUTLEN --max-model-len $MML --max-num-batched-tokens $MNBT --quiet"
[ "$STAGE" = cpu ] && BENCH=${BENCH/bfloat16/float32}
prompts() { local n=$(($1 * 2)); [ $n -lt 4 ] && n=4; echo $n; }   # 2 waves of requests per batch size
run() { local name=$1 t0=$SECONDS rc; shift; "$@"; rc=$?; echo "WALL $name $((SECONDS - t0)) s rc=$rc"; }

case $STAGE in
jax|cpu)
  for b in $BATCHES; do   # plain; the largest batch also takes the steady-state step times at 1 / 8 / 32
    extra=""; [ "$b" = "${BATCHES##* }" ] && extra="--steady-state $STEADY --steady-steps $STEPS"
    run plain_b$b $BENCH --num-prompts $(prompts $b) --max-concurrency $b $extra --json $OUT_DIR/hy_plain_b$b.json
  done
  b=${BATCHES##* }
  for k in 1 2 3; do      # MTP: the serving run at the largest batch, steady-state step times at each batch
    [ "$STAGE" = cpu ] && [ $k -gt 1 ] && break
    run mtp${k}_b$b $BENCH --num-prompts $(prompts $b) --max-concurrency $b --spec-method mtp --num-spec-tokens $k \
      --steady-state $STEADY --steady-steps $STEPS --json $OUT_DIR/hy_mtp${k}_b$b.json
  done
  # chunked prefill: 2048-token prompts, one output token, 2048-token chunks (total_throughput ~ prefill tok/s)
  run prefill $BENCH --max-num-batched-tokens $PF_MNBT --input-len $PF_IN --output-len 1 --max-model-len $((PF_IN + 64)) --num-prompts $PF_N --max-concurrency $PF_N \
    --json $OUT_DIR/hy_prefill.json
  # the delta-rule kernels alone at this config's linear-attention shapes (16 value heads, 128 x 128)
  [ "$STAGE" = jax ] && run delta_rule $PY scripts/bench_delta_rule.py --heads 16 --kinds prefill,decode,verify \
    --k 3 --json $OUT_DIR/hy_delta_rule.json
  ;;
vllm)
  for b in 8 32 1; do
    run vllm_plain_b$b $BENCH --num-prompts $(prompts $b) --max-concurrency $b --baseline vllm --vllm-model $CFG \
      --json $OUT_DIR/hy_vllm_plain_b$b.json
  done
  ;;
vllm-mtp)
  for k in 1 3 2; do
    run vllm_mtp${k}_b32 $BENCH --num-prompts 64 --max-concurrency 32 --spec-method mtp --num-spec-tokens $k \
      --baseline vllm --vllm-model $CFG --json $OUT_DIR/hy_vllm_mtp${k}_b32.json
  done
  ;;
*) echo "unknown stage $STAGE (jax, vllm, vllm-mtp, cpu)"; exit 2 ;;
esac
echo "DONE $STAGE"
