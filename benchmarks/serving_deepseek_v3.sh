#!/usr/bin/env bash
# GPU recipe: DeepSeek-V3 PD disaggregation with the ELDR patches, the router per policy, and
# the SGLang serving benchmark (TPOT, ITL, throughput) for each. Not run in CI. Flag names are
# those of sglang 0.5.23 (--attn-dp-size is its spelling of --dp-size N --enable-dp-attention).
#
# LAYOUT=tp (default): one prefill instance and K decode instances, each a full DeepSeek-V3
# copy (TP 8 on 8 x H200, or H100-80G x 16 with --nnodes 2).
# LAYOUT=ep: SGLang's large-scale EP deployment (the LMSYS PD + EP recipe): prefill EP32 over
# 4 nodes with DP attention and DeepEP normal mode, and K decode groups of EP72 (9 nodes each)
# with DP attention and DeepEP low-latency mode. A decode worker of the router is then a whole
# EP group: K is small (2-4), see docs/operations.md for what ELDR can do there.
# Run the roles on their nodes:
#
#   ROLE=prefill ./benchmarks/serving_deepseek_v3.sh     # on each prefill node
#   ROLE=decode  ./benchmarks/serving_deepseek_v3.sh     # on each decode node
#   LAYOUT=ep NODE_RANK=r DIST_INIT_ADDR=first-node-of-the-group:5757 ROLE=prefill|decode ...
#   ROLE=calibrate CALIB_URL=... K=4 ./benchmarks/serving_deepseek_v3.sh  # once: trace + centroids
#   ROLE=bench PREFILL_URLS="http://p0:30000" DECODE_URLS="http://d0:30000 http://d1:30000 ..." \
#       ./benchmarks/serving_deepseek_v3.sh              # on the client node: router + sweep
#   ROLE=one-node ./benchmarks/serving_deepseek_v3.sh    # first: a smaller MoE on one 8-GPU node
#
# Every node: pip install 'sglang==0.5.23' 'eldr-sglang[serve]' && eldr patch apply
# Knobs: MODEL [deepseek-ai/DeepSeek-V3], TP [8], PORT [30000], BOOTSTRAP_PORT [8998],
#   IB_DEVICE [unset], CALIB_PROMPTS [calibration prompts JSONL/ShareGPT], CENTROIDS [dsv3.eldr],
#   POLICIES ["random round_robin shortest_queue power_of_two eldr"], RATES ["4 8 16 32"],
#   NUM_PROMPTS [1000], INPUT_LEN [2048], OUTPUT_LEN [512], DATASET [random-ids], OUT [results dir];
#   LAYOUT=ep: PREFILL_NODES [4], DECODE_NODES [9], GPUS_PER_NODE [8], NODE_RANK, DIST_INIT_ADDR,
#   REDUNDANT_EXPERTS [32], INIT_EXPERT_LOCATION [trivial; an EPLB expert-distribution file];
#   ROLE=one-node: SMALL_MODEL [Qwen/Qwen3-30B-A3B]
set -euo pipefail
ROLE=${ROLE:?set ROLE to prefill, decode, calibrate, bench or one-node}
MODEL=${MODEL:-deepseek-ai/DeepSeek-V3}
TP=${TP:-8}
PORT=${PORT:-30000}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
HOST=${HOST:-0.0.0.0}
CENTROIDS=${CENTROIDS:-dsv3.eldr}
OUT=${OUT:-benchmarks/results/serving_deepseek_v3}
LAYOUT=${LAYOUT:-tp}
IB=()
[ -n "${IB_DEVICE:-}" ] && IB=(--disaggregation-ib-device "$IB_DEVICE")
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# ELDR on the prefill: each request's expert counts, streamed before the KV transfer; late
# binding lets the prefill run before any decode worker has connected (optimistic prefill).
ELDR_PREFILL=(--enable-eldr-signature --enable-eldr-late-binding)
ELDR_DECODE=(--enable-eldr-late-binding)

# LAYOUT=ep: the parallel flags of one instance spanning NODES nodes (world = NODES x GPUs):
# attention data-parallel on every GPU, experts spread over all of them with DeepEP.
ep_flags() {  # NODES DEEPEP_MODE
  local world=$(( $1 * GPUS_PER_NODE ))
  : "${NODE_RANK:?NODE_RANK: this node's rank within its instance}"
  : "${DIST_INIT_ADDR:?DIST_INIT_ADDR: host:port of the instance's first node}"
  EP=(--nnodes "$1" --node-rank "$NODE_RANK" --dist-init-addr "$DIST_INIT_ADDR"
      --tp-size "$world" --attn-dp-size "$world" --moe-dense-tp-size 1 --enable-dp-lm-head
      --moe-a2a-backend deepep --deepep-mode "$2"
      --ep-num-redundant-experts "${REDUNDANT_EXPERTS:-32}" --init-expert-location "${INIT_EXPERT_LOCATION:-trivial}"
      --page-size 1 --disable-radix-cache)
}

check_patch() {
  eldr patch check >/dev/null || { echo "the ELDR patch series is not applied: run 'eldr patch apply'" >&2; exit 1; }
}

case "$ROLE" in
prefill)
  check_patch
  if [ "$LAYOUT" = ep ]; then
    ep_flags "${PREFILL_NODES:-4}" normal
    # Not --enable-two-batch-overlap here (the LMSYS prefill has it): its micro-batches split a
    # layer's top-k ids in two, and the ELDR prefill refuses that layout (eldr_signature: off).
    # Decode instances keep it. No CUDA graph on the prefill, as in SGLang's recipe.
    exec python -m sglang.launch_server --model-path "$MODEL" --trust-remote-code \
      --host "$HOST" --port "$PORT" --disaggregation-mode prefill --disaggregation-transfer-backend mooncake \
      --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" "${IB[@]}" "${EP[@]}" \
      --chunked-prefill-size 524288 --max-prefill-tokens 16384 --context-length 2000 \
      --mem-fraction-static 0.85 --max-running-requests 1024 --cuda-graph-backend-prefill disabled \
      --watchdog-timeout 1000000 "${ELDR_PREFILL[@]}"
  fi
  exec python -m sglang.launch_server --model-path "$MODEL" --trust-remote-code --tp-size "$TP" \
    --host "$HOST" --port "$PORT" --disaggregation-mode prefill --disaggregation-transfer-backend mooncake \
    --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" "${IB[@]}" "${ELDR_PREFILL[@]}"
  ;;
decode)
  check_patch
  if [ "$LAYOUT" = ep ]; then
    ep_flags "${DECODE_NODES:-9}" low_latency
    exec python -m sglang.launch_server --model-path "$MODEL" --trust-remote-code \
      --host "$HOST" --port "$PORT" --disaggregation-mode decode --disaggregation-transfer-backend mooncake \
      "${IB[@]}" "${EP[@]}" --context-length 4500 --mem-fraction-static 0.835 --max-running-requests 18432 \
      --cuda-graph-bs-decode 256 --enable-two-batch-overlap --watchdog-timeout 1000000 "${ELDR_DECODE[@]}"
  fi
  exec python -m sglang.launch_server --model-path "$MODEL" --trust-remote-code --tp-size "$TP" \
    --host "$HOST" --port "$PORT" --disaggregation-mode decode --disaggregation-transfer-backend mooncake \
    "${IB[@]}" "${ELDR_DECODE[@]}"
  ;;
one-node)
  # A smaller MoE on one 8-GPU node, to see signatures flow before the big deployment: the
  # prefill on GPUs 0-3 with DP attention (4 attention-DP ranks, TP-4 experts), two decode
  # workers on GPUs 4-5 and 6-7, the router binding late. Add PREFILL_EXTRA="--moe-a2a-backend
  # deepep --deepep-mode normal" where DeepEP is installed. Servers stop when the script ends.
  check_patch
  SMALL_MODEL=${SMALL_MODEL:-Qwen/Qwen3-30B-A3B}
  mkdir -p "$OUT"
  PIDS=()
  trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0,1,2,3 python -m sglang.launch_server --model-path "$SMALL_MODEL" --tp-size 4 --attn-dp-size 4 \
    --port 30000 --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 "${IB[@]}" \
    ${PREFILL_EXTRA:-} "${ELDR_PREFILL[@]}" > "$OUT/one_node_prefill.log" 2>&1 & PIDS+=($!)
  CUDA_VISIBLE_DEVICES=4,5 python -m sglang.launch_server --model-path "$SMALL_MODEL" --tp-size 2 --port 30010 \
    --disaggregation-mode decode "${IB[@]}" "${ELDR_DECODE[@]}" > "$OUT/one_node_decode0.log" 2>&1 & PIDS+=($!)
  CUDA_VISIBLE_DEVICES=6,7 python -m sglang.launch_server --model-path "$SMALL_MODEL" --tp-size 2 --port 30020 \
    --disaggregation-mode decode "${IB[@]}" "${ELDR_DECODE[@]}" > "$OUT/one_node_decode1.log" 2>&1 & PIDS+=($!)
  for port in 30000 30010 30020; do
    for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  done
  echo "prefill says: $(curl -s http://127.0.0.1:30000/server_info | python -c 'import json,sys; print(json.load(sys.stdin).get("eldr_signature"))')"
  python -m eldr_sglang.launch_router --pd-disaggregation --disagg-router shortest_queue --eldr-bind late \
    --prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30010 --decode http://127.0.0.1:30020 \
    --host 127.0.0.1 --port 8000 > "$OUT/one_node_router.log" 2>&1 & PIDS+=($!)
  for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  for i in $(seq 1 8); do
    curl -s -D - -o /dev/null http://127.0.0.1:8000/generate -H 'Content-Type: application/json' \
      -d "{\"text\": \"Request $i: explain mixture-of-experts routing.\", \"sampling_params\": {\"max_new_tokens\": 16}}" \
      | grep -i '^x-eldr-reason'
  done
  # signatures flowing: prefill_signatures [true], no prefill_signature_off, and the routes
  # above waited for a signature (no 'no_signature' or 'timeout' fallbacks in the metrics)
  curl -s http://127.0.0.1:8000/eldr/status | python -m json.tool | grep -A2 -E 'prefill_signature'
  curl -s http://127.0.0.1:8000/metrics | grep -E '^eldr_router_(fallbacks|prefill_signature_off)' || true
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
  echo "unknown ROLE $ROLE (prefill, decode, calibrate, bench, one-node)" >&2; exit 2
  ;;
esac
