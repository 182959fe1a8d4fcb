#!/usr/bin/env bash
# GPU recipe: DeepSeek-V3 PD disaggregation with the ELDR patches, the router per policy, and
# the SGLang serving benchmark (TPOT, ITL, throughput) for each. Not run in CI.
#
# One prefill instance and K decode instances, each a full DeepSeek-V3 copy (TP 8 on 8 x H200
# or H100-80G x 16 with --nnodes 2). Run the roles on their nodes:
#
#   ROLE=prefill ./benchmarks/serving_deepseek_v3.sh     # on each prefill node
#   ROLE=decode  ./benchmarks/serving_deepseek_v3.sh     # on each decode node
#   ROLE=calibrate CALIB_URL=... K=4 ./benchmarks/serving_deepseek_v3.sh  # once: trace + centroids
#   ROLE=bench PREFILL_URLS="http://p0:30000" DECODE_URLS="http://d0:30000 http://d1:30000 ..." \
#       ./benchmarks/serving_deepseek_v3.sh              # on the client node: router + sweep
#
# Every node: pip install 'sglang==0.5.23' 'eldr-sglang[serve]' && eldr patch apply
# Knobs: MODEL [deepseek-ai/DeepSeek-V3], TP [8], PORT [30000], BOOTSTRAP_PORT [8998],
#   IB_DEVICE [unset], CALIB_PROMPTS [calibration prompts JSONL/ShareGPT], CENTROIDS [dsv3.eldr],
#   POLICIES ["random round_robin shortest_queue power_of_two eldr"], RATES ["4 8 16 32"],
#   NUM_PROMPTS [1000], INPUT_LEN [2048], OUTPUT_LEN [512], DATASET [random-ids], OUT [results dir]
set -euo pipefail
ROLE=${ROLE:?set ROLE to prefill, decode, calibrate or bench}
MODEL=${MODEL:-deepseek-ai/DeepSeek-V3}
TP=${TP:-8}
PORT=${PORT:-30000}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
HOST=${HOST:-0.0.0.0}
CENTROIDS=${CENTROIDS:-dsv3.eldr}
OUT=${OUT:-benchmarks/results/serving_deepseek_v3}
IB=()
[ -n "${IB_DEVICE:-}" ] && IB=(--disaggregation-ib-device "$IB_DEVICE")

check_patch() {
  eldr patch check >/dev/null || { echo "the ELDR patch series is not applied: run 'eldr patch apply'" >&2; exit 1; }
}

case "$ROLE" in
prefill)
  check_patch
  # The prefill computes each request's expert counts and streams them before the KV transfer;
  # late binding lets it prefill before any decode worker has connected (optimistic prefill).
  exec python -m sglang.launch_server --model-path "$MODEL" --trust-remote-code --tp-size "$TP" \
    --host "$HOST" --port "$PORT" --disaggregation-mode prefill --disaggregation-transfer-backend mooncake \
    --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" "${IB[@]}" \
    --enable-eldr-signature --enable-eldr-late-binding
  ;;
decode)
  check_patch
  exec python -m sglang.launch_server --model-path "$MODEL" --trust-remote-code --tp-size "$TP" \
    --host "$HOST" --port "$PORT" --disaggregation-mode decode --disaggregation-transfer-backend mooncake \
    "${IB[@]}" --enable-eldr-late-binding
  ;;
calibrate)
  # Routing trace of calibration prompts from an aggregated (non-PD) server started with
  # --enable-return-routed-experts, then the balanced K-means centroids for K decode workers.
  : "${CALIB_URL:?CALIB_URL: an aggregated server started with --enable-return-routed-experts}"
  : "${CALIB_PROMPTS:?CALIB_PROMPTS: a JSONL of {\"prompt\"} or ShareGPT JSON of calibration prompts}"
  : "${K:?K: the number of decode workers}"
  mkdir -p "$OUT"
  eldr collect "$CALIB_PROMPTS" --url "$CALIB_URL" --model deepseek-v3 --out "$OUT/calib.npz" --max-new-tokens 64
  eldr fit "$OUT/calib.npz" --workers "$K" --out "$CENTROIDS" --layers auto --json "$OUT/fit.json"
  ;;
bench)
  : "${PREFILL_URLS:?PREFILL_URLS: space-separated prefill URLs (bootstrap port: BOOTSTRAP_PORT)}"
  : "${DECODE_URLS:?DECODE_URLS: space-separated decode URLs}"
  POLICIES=${POLICIES:-"random round_robin shortest_queue power_of_two eldr"}
  RATES=${RATES:-"4 8 16 32"}
  NUM_PROMPTS=${NUM_PROMPTS:-1000}
  INPUT_LEN=${INPUT_LEN:-2048}
  OUTPUT_LEN=${OUTPUT_LEN:-512}
  DATASET=${DATASET:-random-ids}
  ROUTER_PORT=${ROUTER_PORT:-8000}
  mkdir -p "$OUT"
  ARGS=()
  for u in $PREFILL_URLS; do ARGS+=(--prefill "$u" "$BOOTSTRAP_PORT"); done
  for u in $DECODE_URLS; do ARGS+=(--decode "$u"); done
  for POLICY in $POLICIES; do
    EXTRA=()
    # Baselines bind decode late too, so all policies see the same (patched) prefill path.
    [ "$POLICY" = eldr ] && EXTRA=(--eldr-centroids "$CENTROIDS")
    python -m eldr_sglang.launch_router --pd-disaggregation --disagg-router "$POLICY" "${EXTRA[@]}" "${ARGS[@]}" \
      --eldr-bind late --host 127.0.0.1 --port "$ROUTER_PORT" --worker-startup-timeout-secs 1800 \
      > "$OUT/router_$POLICY.log" 2>&1 &
    RPID=$!
    trap 'kill $RPID 2>/dev/null || true' EXIT
    for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$ROUTER_PORT/health" >/dev/null && break; sleep 1; done
    for RATE in $RATES; do
      python -m sglang.benchmark.serving --backend sglang --base-url "http://127.0.0.1:$ROUTER_PORT" --pd-separated \
        --model "$MODEL" --dataset-name "$DATASET" --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
        --num-prompts "$NUM_PROMPTS" --request-rate "$RATE" --seed 1 \
        --output-file "$OUT/${POLICY}_rate${RATE}.jsonl" | tee "$OUT/bench_${POLICY}_rate${RATE}.log"
      curl -s "http://127.0.0.1:$ROUTER_PORT/metrics" > "$OUT/metrics_${POLICY}_rate${RATE}.txt"
    done
    kill "$RPID"; wait "$RPID" 2>/dev/null || true
  done
  python - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
print(f"{'run':<28}{'TPOT mean':>10}{'TPOT p99':>10}{'ITL mean':>10}{'ITL p99':>10}{'out tok/s':>10}")
for f in sorted(glob.glob(f"{out}/*_rate*.jsonl")):
    r = [json.loads(l) for l in open(f) if l.strip()][-1]
    print(f"{os.path.basename(f)[:-6]:<28}{r['mean_tpot_ms']:>10.2f}{r['p99_tpot_ms']:>10.2f}{r['mean_itl_ms']:>10.2f}"
          f"{r['p99_itl_ms']:>10.2f}{r['output_throughput']:>10.1f}")
EOF
  ;;
*)
  echo "unknown ROLE $ROLE (prefill, decode, calibrate, bench)" >&2; exit 2
  ;;
esac
