# SKIP_PROFILED (the default) against XLA's own mode (GPU, one call): the engine's greedy outputs with and without it
# (digests must match), the step profile and the bench's TPOT at batch 1 / 8 / 32 with and without it.
#   bash scripts/probes/update_mode_check.sh [model]
#   MODES=SKIP_PROFILED bash scripts/probes/update_mode_check.sh   # one mode per call ("default": XLA's own)
export PYTHONPATH=$PWD
M=${1:-qwen2.5-coder-1.5b-instruct}
quiet() { grep -v "^W0\|^I0\|Warning"; }
for mode in ${MODES:-default SKIP_PROFILED}; do
  [ "$mode" = default ] && mode=
  echo "=== JAXSPEC_COMMAND_BUFFER_UPDATE_MODE=${mode}"
  JAXSPEC_COMMAND_BUFFER_UPDATE_MODE=$mode python3 scripts/probes/update_mode_exact.py $M 2>&1 | grep digest
  JAXSPEC_COMMAND_BUFFER_UPDATE_MODE=$mode python3 scripts/profile_step.py --model $M --batches 1 8 32 2>&1 | quiet |
    grep "engine loop\|phases\|host time to launch\|step ms\|^ *[0-9]\+ \+[0-9]\+ \+[0-9.]\+"
  for b in 1 8 32; do
    JAXSPEC_COMMAND_BUFFER_UPDATE_MODE=$mode python3 -m jaxspec.bench --model $M --random-weights --dtype bfloat16 \
      --dataset random --input-len 128 --output-len 256 --num-prompts $b --max-concurrency $b --max-model-len 1024 \
      2>&1 | quiet | grep -i "median tpot\|output token throughput"
  done
done
