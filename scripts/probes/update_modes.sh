# XLA's command-buffer update modes against the step's host call (GPU): every mode this jaxlib names, each
# running scripts/probes/graph_updates.py's cases with XLA's command-buffer log counted per case.
#   bash scripts/probes/update_modes.sh [cases]      (logs under $OUT, or /tmp)
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp}
L=$(python3 -c 'import jaxlib,os;print(os.path.dirname(jaxlib.__file__))')/libjax_common.so
modes=$(strings $L | grep -A6 "^CommandBufferUpdateMode$" | tail -n +2 | grep -E "^[A-Z_]+$" | grep -E "UPDATE|ALLOCATE|TEMP|SKIP" | head -4)
echo "update modes in this jaxlib: " $modes
for m in "" $modes; do
  case $m in ALWAYS_UPDATE|DYNAMIC_ALLOCATE) continue;; esac
  echo "=== mode ${m:-default}"
  XLA_FLAGS=${m:+--xla_gpu_command_buffer_update_mode=$m} TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
    timeout 150 python3 scripts/probes/graph_updates.py 1 "" 40 ${1:-boxes,step,put} 2> $OUT/gu_${m:-default}.log | grep batch
  awk '/^CASE/{c=$2} /Update command buffer/{n[c]++} /Execute command buffer/{e[c]++}
       END{for (x in e) print "  case", x, "updates", n[x]+0, "executions", e[x]}' $OUT/gu_${m:-default}.log | sort
  grep -m2 -i " error\|check fail\|Traceback" $OUT/gu_${m:-default}.log | cut -c1-300
done
