# The attention kernel with rotary and the KV write inside (JAXSPEC_FUSED_ATTENTION=1, the default) against the
# separate kernels (=0), GPU, one setting per call: the kernel against the separate kernels
# (scripts/probes/fused_attention_exact.py), the kernel tests compiled for the GPU, greedy digests, the step
# profile and the bench's TPOT at batch 1 / 8 / 32. Full logs under $OUT.
#   FUSED=1 bash scripts/probes/fused_attention_check.sh [model]
export PYTHONPATH=$PWD
M=${1:-qwen2.5-coder-1.5b-instruct}
O=${OUT:-/tmp/out}; mkdir -p $O
quiet() { grep -v "^W0\|^I0\|Warning"; }
for f in ${FUSED:-1 0}; do
  echo "=== JAXSPEC_FUSED_ATTENTION=$f"
  if [ "$f" = 1 ]; then
    python3 scripts/probes/fused_attention_exact.py 2>&1 | quiet | grep "diff\|Error"
    JAX_PLATFORMS=cuda python3 -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" \
      tests/test_paged_attention.py > $O/pytest_gpu.log 2>&1; tail -1 $O/pytest_gpu.log
  fi
  JAXSPEC_FUSED_ATTENTION=$f python3 scripts/probes/update_mode_exact.py $M 2>&1 | grep digest
  JAXSPEC_FUSED_ATTENTION=$f python3 scripts/profile_step.py --model $M --batches 1 8 32 --sequence 32 2>&1 | quiet \
    > $O/profile_fused$f.log
  grep "engine loop, async\|phases\|host time to launch\|kernel time per step\|^ *[0-9]\+ \+[0-9]\+ \+[0-9.]\+" \
    $O/profile_fused$f.log
  for b in 1 8 32; do
    JAXSPEC_FUSED_ATTENTION=$f python3 -m jaxspec.bench --model $M --random-weights --dtype bfloat16 \
      --dataset random --input-len 128 --output-len 256 --num-prompts $b --max-concurrency $b --max-model-len 1024 \
      2>&1 | quiet | grep -i "median tpot\|output token throughput" | tr '\n' ' '; echo " (batch $b)"
  done
done
