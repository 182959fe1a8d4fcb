#!/usr/bin/env bash
# GPU recipe: the expert-cache regime on ONE GPU. Decode servers run SGLang's paged experts
# (--enable-paged-experts --paged-experts-num-resident C: C routed experts per MoE layer stay on
# the GPU, the rest are paged in from pinned host memory), the prefill server is patched as
# usual (ELDR signature + late binding), and the ELDR router routes with the cache-aware cost
# (--disagg-router locality --eldr-paged-experts C) against the load balancers. NOT RUN by the
# project (it was written on a machine without a GPU); docs/operations.md, "Paged experts", has
# what it is for and what the simulator predicts (benchmarks/results/paged_experts_study.md).
#
#   eldr patch apply                                   # once, as for every ELDR deployment
#   ROLE=calibrate CALIB_URL=http://127.0.0.1:30000 CALIB_PROMPTS=prompts.jsonl \
#       ./benchmarks/serving_paged_experts.sh           # once: trace + centroids for K = 2
#   ROLE=one-gpu ./benchmarks/serving_paged_experts.sh # servers + router per policy + benchmark
#
# Layout on one GPU (default Qwen3-30B-A3B, bf16, 61 GB of weights, on one 80-141 GB GPU): one
# prefill server with every expert resident (a prefill touches almost every expert, so paging it
# would run in waves), and two decode servers with C experts per layer resident each (at C = 32:
# 3 GB of non-expert weights + 14.5 GB of experts per server). Each decode server also pins a
# full host copy of the experts (61 GB of host RAM each). Memory fractions are per process and
# must add up to less than 1; lower them (or set PREFILL_PAGED=1 to page the prefill too) on a
# smaller GPU. One decode server (NUM_DECODE=1) still shows the page-in rate, not routing.
#
# Knobs: MODEL [Qwen/Qwen3-30B-A3B], C [32], NUM_DECODE [2], MEM_PREFILL [0.5], MEM_DECODE [0.2],
#   PREFILL_PAGED [0], CENTROIDS [paged.eldr], POLICIES ["round_robin shortest_queue locality
#   locality-paged"], RATES ["2 4 8"], NUM_PROMPTS [400], INPUT_LEN [1024], OUTPUT_LEN [256],
#   DATASET [random-ids; a domain-skewed dataset shows locality, random ids do not], OUT.
set -euo pipefail
ROLE=${ROLE:?set ROLE to calibrate or one-gpu}
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
C=${C:-32}
NUM_DECODE=${NUM_DECODE:-2}
MEM_PREFILL=${MEM_PREFILL:-0.5}
MEM_DECODE=${MEM_DECODE:-0.2}
CENTROIDS=${CENTROIDS:-paged.eldr}
OUT=${OUT:-benchmarks/results/serving_paged_experts}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
# SGLang's paged experts: single GPU, the triton or Marlin MoE runner, decode CUDA graphs full
# (captured up to C // top_k requests) and prefill graphs breakable or disabled
# (sglang/srt/layers/moe/paged_experts/method.py check_paged_experts_compat).
PAGED=(--enable-paged-experts --paged-experts-num-resident "$C" --cuda-graph-backend-prefill disabled)
ELDR_PREFILL=(--enable-eldr-signature --enable-eldr-late-binding)
ELDR_DECODE=(--enable-eldr-late-binding)

check_patch() {
  eldr patch check >/dev/null || { echo "the ELDR patch series is not applied: run 'eldr patch apply'" >&2; exit 1; }
}

wait_up() {  # URL SECONDS
  for _ in $(seq 1 "$2"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "$1 did not come up in $2 s" >&2; return 1
}

case "$ROLE" in
calibrate)
  # Routing trace of calibration prompts from an aggregated (non-PD) server started with
  # --enable-return-routed-experts (paged or not: routing does not depend on residency).
  : "${CALIB_URL:?CALIB_URL: an aggregated server started with --enable-return-routed-experts}"
  : "${CALIB_PROMPTS:?CALIB_PROMPTS: a JSONL of {\"prompt\"} or ShareGPT JSON of calibration prompts}"
  mkdir -p "$OUT"
  eldr collect "$CALIB_PROMPTS" --url "$CALIB_URL" --model "$MODEL" --out "$OUT/calib.npz" --max-new-tokens 64
  eldr fit "$OUT/calib.npz" --workers "$NUM_DECODE" --out "$CENTROIDS" --layers auto --json "$OUT/fit.json"
  ;;
one-gpu)
  check_patch
  [ -f "$CENTROIDS" ] || { echo "no centroid file $CENTROIDS: run ROLE=calibrate first" >&2; exit 1; }
  POLICIES=${POLICIES:-"round_robin shortest_queue locality locality-paged"}
  RATES=${RATES:-"2 4 8"}
  NUM_PROMPTS=${NUM_PROMPTS:-400}
  INPUT_LEN=${INPUT_LEN:-1024}
  OUTPUT_LEN=${OUTPUT_LEN:-256}
  DATASET=${DATASET:-random-ids}
  mkdir -p "$OUT"
  PIDS=()
  trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
  PRE=()
  [ "${PREFILL_PAGED:-0}" = 1 ] && PRE=("${PAGED[@]}")
  python -m sglang.launch_server --model-path "$MODEL" --port 30000 --mem-fraction-static "$MEM_PREFILL" \
    --disaggregation-mode prefill --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" "${PRE[@]}" "${ELDR_PREFILL[@]}" \
    > "$OUT/prefill.log" 2>&1 & PIDS+=($!)
  wait_up http://127.0.0.1:30000 1800
  DEC=()
  for i in $(seq 0 $((NUM_DECODE - 1))); do
    port=$((30010 + 10 * i))
    python -m sglang.launch_server --model-path "$MODEL" --port "$port" --mem-fraction-static "$MEM_DECODE" \
      --disaggregation-mode decode "${PAGED[@]}" "${ELDR_DECODE[@]}" > "$OUT/decode$i.log" 2>&1 & PIDS+=($!)
    wait_up "http://127.0.0.1:$port" 1800  # one at a time: each loads and pins the host store
    DEC+=(--decode "http://127.0.0.1:$port")
  done
  for POLICY in $POLICIES; do
    EXTRA=(--eldr-centroids "$CENTROIDS")
    NAME=$POLICY
    case "$POLICY" in
    locality-paged) POLICY=locality; EXTRA+=(--eldr-paged-experts "$C") ;;
    locality|eldr) ;;
    *) EXTRA=() ;;
    esac
    python -m eldr_sglang.launch_router --pd-disaggregation --disagg-router "$POLICY" "${EXTRA[@]}" \
      --prefill http://127.0.0.1:30000 "$BOOTSTRAP_PORT" "${DEC[@]}" --eldr-bind late \
      --host 127.0.0.1 --port 8000 > "$OUT/router_$NAME.log" 2>&1 &
    RPID=$!
    wait_up http://127.0.0.1:8000 120
    for RATE in $RATES; do
      python -m sglang.benchmark.serving --backend sglang --base-url http://127.0.0.1:8000 --pd-separated \
        --model "$MODEL" --dataset-name "$DATASET" --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
        --num-prompts "$NUM_PROMPTS" --request-rate "$RATE" --seed 1 \
        --output-file "$OUT/${NAME}_rate${RATE}.jsonl" | tee "$OUT/bench_${NAME}_rate${RATE}.log"
      curl -s http://127.0.0.1:8000/metrics > "$OUT/metrics_${NAME}_rate${RATE}.txt"
    done
    kill "$RPID"; wait "$RPID" 2>/dev/null || true
  done
  python - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
print(f"{'run':<32}{'TPOT mean':>10}{'TPOT p99':>10}{'ITL mean':>10}{'ITL p99':>10}{'out tok/s':>10}")
for f in sorted(glob.glob(f"{out}/*_rate*.jsonl")):
    r = [json.loads(l) for l in open(f) if l.strip()][-1]
    print(f"{os.path.basename(f)[:-6]:<32}{r['mean_tpot_ms']:>10.2f}{r['p99_tpot_ms']:>10.2f}{r['mean_itl_ms']:>10.2f}"
          f"{r['p99_itl_ms']:>10.2f}{r['output_throughput']:>10.1f}")
EOF
  ;;
*)
  echo "unknown ROLE $ROLE (calibrate, one-gpu)" >&2; exit 2
  ;;
esac
