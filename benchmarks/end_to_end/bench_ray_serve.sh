#!/usr/bin/env bash
# Data-parallel serving on Ray Serve (issue #38): Qwen2.5-Coder-1.5B shapes (random bf16), one replica against two
# (one GPU each) behind Ray Serve's one HTTP ingress; an online workload (Poisson arrivals, 256-token prompts, 128
# greedy tokens, streamed /v1/completions) at rising request rates; TTFT percentiles and throughput per rate.
# Run on nvidia-h100-x2 from the repository root with Ray Serve importable (PYTHONPATH);
#   bash benchmarks/end_to_end/bench_ray_serve.sh "1 2" "4 8 16 32 64"
# results under ${OUT:-/tmp/out}/ray_r{replicas}_q{rate}.json.
set -uo pipefail
REPLICAS=${1:-"1 2"}; RATES=${2:-"4 8 16 32 64"}
MODEL=${MODEL:-qwen2.5-coder-1.5b-instruct}; PORT=${PORT:-8000}; SECONDS_PER_RATE=${SECONDS_PER_RATE:-20}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for n in $REPLICAS; do
  python3 -m jaxspec.serve.ray "$MODEL" --random-weights --num-replicas "$n" --port "$PORT" --max-num-seqs 128 \
    --max-model-len 1024 --warmup full ${SERVE_ARGS:-} > "$OUT/ray_r$n.log" 2>&1 &
  server=$!
  t0=$(date +%s)
  until curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null; do   # every replica answers once it is up
    sleep 2
    if ! kill -0 $server 2> /dev/null || (( $(date +%s) - t0 > ${START_TIMEOUT:-400} )); then
      echo "replicas=$n: the server did not come up"; tail -20 "$OUT/ray_r$n.log"; kill $server 2> /dev/null; continue 2
    fi
  done
  until grep -q "replica(s) of" "$OUT/ray_r$n.log"; do sleep 1; done   # serve.run returns once every replica is ready
  echo "replicas=$n up in $(( $(date +%s) - t0 )) s"
  for rate in $RATES; do
    python3 -m jaxspec.bench --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --vocab-size "${VOCAB:-151000}" \
      --request-rate "$rate" --num-prompts $(( rate * SECONDS_PER_RATE )) --max-concurrency 100000 \
      --input-len 256 --output-len 128 --seed "$rate" --quiet --json "$OUT/ray_r${n}_q$rate.json" \
      > "$OUT/ray_r${n}_q$rate.log" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))[0]; print(f\"replicas={sys.argv[2]} rate={r['request_rate']:g}: \
{r['request_throughput']:.2f} req/s, {r['output_throughput']:.0f} out tok/s, TTFT p50/p99 {r['ttft_ms']['median']:.0f}/\
{r['ttft_ms']['p99']:.0f} ms, TPOT p50 {r['tpot_ms']['median']:.2f} ms, {r['requests']} requests\")" \
      "$OUT/ray_r${n}_q$rate.json" "$n" 2>&1 | tail -1
  done
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^vllm:(num_requests_running|kv_cache_usage_perc|time_to_first_token_seconds_count)" | head -5
  kill -INT $server; sleep 5; kill $server 2> /dev/null; python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  wait $server 2> /dev/null
done
