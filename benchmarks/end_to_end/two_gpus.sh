# Two device jobs side by side on a two-GPU machine, each on its own GPU, for measurements that need one GPU each:
#   bash benchmarks/end_to_end/two_gpus.sh "CMD0" "CMD1"
# CMD0 runs with CUDA_VISIBLE_DEVICES=0 and OUT=$OUT/g0, CMD1 with 1 and $OUT/g1; each one's console goes to
# /tmp/console_gN.log, and the ends of both are printed once both are done. The jobs share the host's CPUs: a
# host-bound run beside a busy neighbour reads low (2026-11-28: plain decoding at batch 64, 17% below the same pass
# alone, beside a training run), so compare runs made under the same neighbour.
echo "$(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || cat .gpu/COMMIT 2>/dev/null)"
nvidia-smi -L
for g in 0 1; do
  if [ $g = 0 ]; then cmd=$1; else cmd=$2; fi
  (export CUDA_VISIBLE_DEVICES=$g OUT=$OUT/g$g; mkdir -p $OUT; bash -c "$cmd" > /tmp/console_g$g.log 2>&1
   echo "g$g rc=$? $(date -u +%FT%TZ)" >> /tmp/console_g$g.log) &
done
wait
for g in 0 1; do echo "=== g$g"; tail -c 5800 /tmp/console_g$g.log; done
