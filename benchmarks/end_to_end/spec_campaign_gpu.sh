# Issue #37's measurements on one GPU, Qwen2.5-Coder-1.5B-Instruct: self-distilled data, the trainer's throughput
# before and after packing, a chain and a parallel EAGLE-3 head trained on the same data, then every method's output
# tok/s at several concurrencies. One step per device call (each fits a 10-minute call); the data and heads live
# under $D on the machine, so make the calls back to back.
#
#   bash benchmarks/end_to_end/spec_campaign_gpu.sh OUT regen          # .gpu/train_mixed.json -> $D/regen.json (+ OUT)
#   bash benchmarks/end_to_end/spec_campaign_gpu.sh OUT before         # trainer, one example per row (nopack-b8),
#                                                                       # then the packed step's kernels
#   SECONDS_EACH=120 bash benchmarks/end_to_end/spec_campaign_gpu.sh OUT train chain parallel
#   STEPS=900 SECONDS_EACH=1000 bash ...  OUT train chain    # a fixed step count: the same head again next session
#   BATCH=4 STEPS=1800 TAG=-b4 SECONDS_EACH=1000 bash ...  OUT train chain   # a variant beside it, in $D/chain-b4
#   bash benchmarks/end_to_end/spec_campaign_gpu.sh OUT bench "1 8 32 64" none chain:eagle3@4=chain parallel:eagle3@4=parallel
#   bash benchmarks/end_to_end/spec_campaign_gpu.sh OUT vllm chain 1 8 32 64   # vLLM 0.26's EAGLE-3, the same head
#   bash benchmarks/end_to_end/spec_campaign_gpu.sh OUT send-heads 0 chain parallel   # then 1, 2, ...: the heads
#                                                                       # off the machine (bf16, 4 x 15 MiB a call)
#   bash benchmarks/end_to_end/spec_campaign_gpu.sh OUT heads-from /tmp/models/heads.tar   # a later session
#
# Staged first: the GGUF under /tmp/models (../shared/tools/device_stage.py split), `.gpu/` carried with
# prepare_eagle_gpu.py's train_mixed.json, humaneval.json and sharegpt_heldout.json (or regen.json.gz from an earlier
# regen: it is used instead of regenerating), and the gguf wheel in .gpu/ (the machine has no gguf package).
# Bench methods name heads by their directory under $D (`chain:eagle3@4=chain` -> $D/chain). Each bench row runs
# REPEAT times (default 3; the median is reported): single passes of 6-128 requests moved by ~10% (2026-11-28).
set -o pipefail
OUT=$1; STEP=$2; shift 2
M=${M:-/tmp/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf}
D=${D:-/tmp/gpu}
mkdir -p $D $OUT
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TQDM_MININTERVAL=20
echo "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
# the whole output to a log (tee first: a stage that buffers would lose a killed run's tail), the end without bars
quiet() { tee "$1" | tr '\r' '\n' | grep -v "it/s\]\|step/s\]\|row/s\]\|req/s\]\|^\s*$" | tail -${2:-25}; }
have_regen() {
  [ -f $D/regen.json ] && return 0
  [ -f .gpu/regen.json.gz ] && gunzip -c .gpu/regen.json.gz > $D/regen.json
}
# the trainer replays no decode step: XLA's own command-buffer mode (jaxspec.xla_flags.release_update_mode)
TRAIN_ENV="XLA_FLAGS=--xla_gpu_enable_triton_gemm=false JAXSPEC_COMMAND_BUFFER_UPDATE_MODE=default"

# only what is missing: two jobs side by side (one per GPU) must not rewrite a file the other is reading
for f in .gpu/*.json; do [ -e $D/${f##*/} ] || cp $f $D/; done

case $STEP in
regen)
  python3 -m jaxspec.train.cli --model $M --out $D/unused --dataset-path $D/train_mixed.json \
    --num-conversations ${NUM_PROMPTS:-11936} --num-held-out 64 --regenerate --regenerate-max-tokens 320 \
    --regenerate-batch-size 256 --save-regenerated $D/regen.json 2>&1 | quiet $OUT/regen.log
  gzip -1 -c $D/regen.json | split -b 15M - $OUT/regen.json.gz. ;;
before)
  have_regen
  env $TRAIN_ENV python3 benchmarks/end_to_end/train_throughput_gpu.py --model $M --dataset-path $D/regen.json \
    --num-examples 1000 --steps 25 --run nopack-b8 ${RUNS:-} --json $OUT/train_throughput.json 2>&1 \
    | quiet $OUT/throughput.log 8
  env $TRAIN_ENV python3 benchmarks/profiles/profile_train_step.py --model $M --dataset-path $D/regen.json \
    --trace-dir /tmp/train_trace 2>&1 | quiet $OUT/train_profile.log 70 ;;
train)
  have_regen
  N=$(python3 -c "import json; print(len(json.load(open('$D/regen.json'))))")
  for ARCH in "$@"; do
    H=$ARCH${TAG:-}   # TAG: a variant's heads beside the default ones (BATCH=4 STEPS=1800 TAG=-b4 -> $D/chain-b4)
    rm -rf $D/$H
    env $TRAIN_ENV python3 -m jaxspec.train.cli --model $M --out $D/$H --dataset-path $D/regen.json \
      --num-conversations $((N - 64)) --num-held-out 64 --arch $ARCH --batch-size ${BATCH:-8} --steps ${STEPS:-100000} \
      --max-seconds ${SECONDS_EACH:-120} --save-every 2000 2>&1 | quiet $OUT/train_$H.log
    cp $D/$H/training.json $OUT/training_$H.json
  done ;;
bench)
  CONC=$1; shift
  METHODS=""
  for m in "$@"; do
    case $m in *=*) METHODS="$METHODS --method ${m%%=*}=$D/${m#*=}";; *) METHODS="$METHODS --method $m";; esac
  done
  NP=$(for c in $CONC; do echo $(( c < 2 ? 8 : 4 * c )); done)   # 4 x c: the saturated part is 3/4 of a run
  python3 benchmarks/end_to_end/bench_spec_gpu.py --model $M --concurrency $CONC --num-prompts $NP \
    --workload humaneval=$D/humaneval.json --workload sharegpt=$D/sharegpt_heldout.json $METHODS \
    --repeat ${REPEAT:-3} --json $OUT/bench.json 2>&1 | quiet $OUT/bench.log 80 ;;
vllm)
  # vLLM 0.26's EAGLE-3 with a head trained here, on the same HumanEval prompts, beside jaxspec's run of the same
  # head (jaxspec.bench --baseline vllm). Staged first: benchmarks/vllm_wheels_026.sh's set, unpacked to
  # /tmp/models/vllm-wheels by device_stage.py pack. Steps: HEAD CONCURRENCY...
  HEAD=$1; shift
  [ -d /tmp/vllm-site/vllm ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vllm-site \
    /tmp/models/vllm-wheels/*.whl && rm -rf /tmp/vllm-site/benchmarks /tmp/vllm-site/samples; }
  [ -f /tmp/models/qwen15-hf/config.json ] || python3 benchmarks/end_to_end/gguf_to_hf.py $M /tmp/models/qwen15-hf
  for c in ${*:-1 8 32 64}; do
    env PYTHONPATH=/tmp/vllm-site:/tmp/vllm-site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH \
      VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m jaxspec.bench --model $M --dataset file \
      --dataset-path $D/humaneval.json --num-prompts $(( c < 4 ? 8 : 2 * c )) --max-concurrency $c --output-len 256 \
      --no-ignore-eos --temperature 0 --spec-method eagle3 --draft-model $D/$HEAD --num-spec-tokens 4 \
      --max-model-len 2048 --max-num-batched-tokens 512 --baseline vllm --vllm-model /tmp/models/qwen15-hf \
      --json $OUT/vllm_eagle_b$c.json 2>&1 | quiet $OUT/vllm_eagle_b$c.log 12
  done ;;
send-heads)
  # The heads off the machine, for later sessions (benchmarks/end_to_end/head_transfer.py): bfloat16 copies in one
  # tar, in 15 MiB pieces, four a call (what one call brings back). Steps: CALL NAME... (CALL 0, 1, ... until
  # "last piece"); put the pieces together here with `cat heads.tar.* > heads.tar && sha256sum -c heads.tar.sha256`.
  CALL=$1; shift
  S=/tmp/send
  if [ ! -f $S/heads.tar.sha256 ]; then
    rm -rf $S && mkdir -p $S/heads
    for NAME in "$@"; do python3 benchmarks/end_to_end/head_transfer.py bf16 $D/$NAME $S/heads/$NAME || exit 1; done
    tar -C $S -cf $S/heads.tar heads && (cd $S && split -b 15M -d -a 3 heads.tar heads.tar. && sha256sum heads.tar > heads.tar.sha256)
  fi
  PIECES=($(ls $S/heads.tar.[0-9]*))
  cp $S/heads.tar.sha256 "${PIECES[@]:$((4 * CALL)):4}" $OUT/
  echo "pieces $((4 * CALL))-$((4 * CALL + 3)) of ${#PIECES[@]}$([ $((4 * CALL + 4)) -ge ${#PIECES[@]} ] && echo ': last piece')" ;;
heads-from)
  # Heads brought back by send-heads and staged again (device_stage.py split heads.tar): unpacked under $D.
  tar -xf ${1:-/tmp/models/heads.tar} -C $D --strip-components 1 && ls $D ;;
setup) ls $D ;;   # the gguf package and the prompts in place, before two jobs start side by side
*) echo "unknown step $STEP: setup, regen, before, train, bench, vllm, send-heads, heads-from"; exit 2 ;;
esac
