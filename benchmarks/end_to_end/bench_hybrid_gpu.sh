#!/usr/bin/env bash
# Issue #15's measurement: Qwen3.5-2B shapes (benchmarks/configs/qwen3.5-2b-text, random bf16 weights) on one H100:
# TPOT and tok/s at batch 1 / 8 / 32, plain and MTP k=1..3 (random MTP weights accept ~nothing: this is the
# step-time cost of speculation), the chunked-prefill throughput, and vLLM 0.23 (load_format="dummy") side by side.
#
#   bash benchmarks/end_to_end/bench_hybrid_gpu.sh jax
#       jaxspec plain and MTP k=1..3 at b1/b8/b32 (~10 min on an H100: each method's engine compiles the steps it
#       uses, ~19 s each), then the 2048-token prefill run (~6 min: 18 steps compiled) and the kernels
#   bash benchmarks/end_to_end/bench_hybrid_gpu.sh vllm        # vLLM plain b1/b8/b32 on the same prompts (~2.5 min each)
#   bash benchmarks/end_to_end/bench_hybrid_gpu.sh vllm-mtp    # vLLM MTP k=1..3 at b32 and b1
#   bash benchmarks/end_to_end/bench_hybrid_gpu.sh cpu         # the jaxspec commands on a scaled-down config, on CPU
#
# Run from the repository root. Every JSON goes to $OUT_DIR (/tmp/out); WALL lines give each command's seconds.
# GPU prerequisites: JAX with CUDA in the python3 on PATH (or /tmp/site), vLLM 0.23 installed at /tmp/vllm-site
# (.gpu/prep_vllm.sh: the .whl-vllm wheel set). No tokenizer is needed: prompts are random token ids and vLLM
# runs with skip_tokenizer_init (jaxspec/bench/baselines/vllm.py), language-model-only for this vision-language config.
set -u
STAGE=${1:-jax}
OUT_DIR=${OUT_DIR:-/tmp/out}
CFG=${CFG:-benchmarks/configs/qwen3.5-2b-text}
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
src = json.load(open("benchmarks/configs/qwen3.5-2b-text/config.json"))
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
DTYPE=bfloat16; [ "$STAGE" = cpu ] && DTYPE=float32
BENCH="$PY -m jaxspec.bench --model $CFG --random-weights --dtype $DTYPE --dataset random --input-len $IN
  --output-len $OUTLEN --max-model-len $MML --max-num-batched-tokens $MNBT --quiet"
prompts() { local n=$(($1 * 2)); [ $n -lt 4 ] && n=4; echo $n; }   # 2 waves of requests per batch size
vocab() { $PY -c "import json,sys; c=json.load(open(sys.argv[1]+'/config.json')); print(c.get('text_config', c)['vocab_size'])" $CFG; }
run() { local name=$1 t0=$SECONDS rc; shift; "$@"; rc=$?; echo "WALL $name $((SECONDS - t0)) s rc=$rc"; }

case $STAGE in
jax|cpu)
  # the workload: random prompts over the config's vocabulary (the first 2 x batch of them run at each batch size)
  $PY -c "import json,sys,numpy as np; r=np.random.default_rng(0); json.dump({'sessions': [[[r.integers(0, int(sys.argv[1]), int(sys.argv[2])).tolist(), int(sys.argv[3])]] for _ in range(64)]}, open(sys.argv[4], 'w'))" \
    $(vocab) $IN $OUTLEN $OUT_DIR/random_prompts.json
  # plain and MTP k=1..3 on one loaded target, each method one engine driven at every batch size
  NP=""; for b in $BATCHES; do NP="$NP $(prompts $b)"; done
  run plain_and_mtp $PY benchmarks/end_to_end/bench_spec_gpu.py --random-weights --model $CFG --dtype $DTYPE --method none \
    --method mtp@1 --method mtp@3 --method mtp@2 --workload random=$OUT_DIR/random_prompts.json --ignore-eos \
    --concurrency $BATCHES --num-prompts $NP --output-len $OUTLEN --max-model-len $MML --max-num-batched-tokens $MNBT \
    --json $OUT_DIR/hy_spec.json
  # chunked prefill: 2048-token prompts, one output token, 2048-token chunks (total_throughput ~ prefill tok/s)
  run prefill $BENCH --max-num-batched-tokens $PF_MNBT --input-len $PF_IN --output-len 1 --max-model-len $((PF_IN + 64)) --num-prompts $PF_N --max-concurrency $PF_N \
    --json $OUT_DIR/hy_prefill.json
  # the delta-rule kernels alone at this config's linear-attention shapes (16 value heads, 128 x 128)
  [ "$STAGE" = jax ] && run delta_rule $PY benchmarks/kernels/bench_delta_rule.py --heads 16 --kinds prefill,decode,verify \
    --k 3 --json $OUT_DIR/hy_delta_rule.json
  ;;
vllm)   # vLLM alone on the same prompts (the first 2 x batch of the same generator's draws)
  run vllm_plain $PY benchmarks/end_to_end/vllm_random_prompts.py $CFG $OUT_DIR/hy_vllm_plain.json $(vocab) 1,8,32
  ;;
vllm-mtp)
  for k in 1 3 2; do
    run vllm_mtp$k $PY benchmarks/end_to_end/vllm_random_prompts.py $CFG $OUT_DIR/hy_vllm_mtp$k.json $(vocab) 32,1 mtp=$k
  done
  ;;
*) echo "unknown stage $STAGE (jax, vllm, vllm-mtp, cpu)"; exit 2 ;;
esac
echo "DONE $STAGE"
