#!/usr/bin/env bash
# SGLang's own benchmark client (python -m sglang.benchmark.serving) against the ELDR PD router
# and an emulated cluster (2 prefill + 4 decode workers on 127.0.0.1), once per routing policy.
#
# The emulated decode workers run continuous batching with step times from the simulator's
# ExecutionModel on the trace's real decode routing; prefill workers stream the trace request's
# expert signature. Requests take trace requests in arrival order (--assign sequential), and
# the cluster restarts for every policy, so each policy serves the same request sequence.
#
# Needs: pip install 'eldr-sglang[serve]' 'sglang==0.5.23' (for the client only; no GPU).
# Environment knobs (defaults in brackets):
#   TRACE [../shared/traces/gptoss20b.npz, else a synthetic gpt-oss-20b trace]
#   POLICIES ["random round_robin shortest_queue power_of_two eldr"]
#   NUM_PROMPTS [300]  RATE [16]  MAX_CONCURRENCY [128]  INPUT_LEN [256]  OUTPUT_LEN [128]
#   TIME_SCALE [1.0]   HARDWARE [h200]   BASE_PORT [37000]   OUT [benchmarks/results/serving_emulated]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/serving_emulated}
POLICIES=${POLICIES:-"random round_robin shortest_queue power_of_two eldr"}
NUM_PROMPTS=${NUM_PROMPTS:-300}
RATE=${RATE:-16}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-128}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
TIME_SCALE=${TIME_SCALE:-1.0}
HARDWARE=${HARDWARE:-h200}
BASE_PORT=${BASE_PORT:-37000}
ROUTER_PORT=$((BASE_PORT + 500))
mkdir -p "$OUT"
WORK=$(mktemp -d)
CLUSTER_PID=""
ROUTER_PID=""
cleanup() {
  [ -n "$ROUTER_PID" ] && kill "$ROUTER_PID" 2>/dev/null || true
  [ -n "$CLUSTER_PID" ] && kill "$CLUSTER_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

TRACE=${TRACE:-}
if [ -z "$TRACE" ] && [ -f ../shared/traces/gptoss20b.npz ]; then TRACE=../shared/traces/gptoss20b.npz; fi
if [ -z "$TRACE" ]; then
  TRACE=$WORK/synth.npz
  $PY -c "from eldr_sglang.traces.synth import generate; from eldr_sglang.traces import save_trace; save_trace(generate(model='gpt-oss-20b', requests=800, seed=0), '$TRACE')"
fi
echo "trace: $TRACE"
# Centroids: fit on the first 60% of the trace, serve all of it (held-out tail included).
$PY - "$TRACE" "$WORK/c.eldr" <<'EOF'
import sys, numpy as np
from eldr_sglang.offline.fit import fit_trace
from eldr_sglang.traces import load_trace
t = load_trace(sys.argv[1])
fit_trace(t, workers=4, requests=np.arange(int(0.6 * t.num_requests))).write(sys.argv[2])
EOF
# A local word-level tokenizer: the benchmark client needs one, the emulator ignores the text.
$PY - "$WORK/tok" <<'EOF'
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, **{f"w{i}": i + 3 for i in range(8000)}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.decoder = decoders.WordPiece(prefix="##")
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]").save_pretrained(sys.argv[1])
EOF

wait_http() {  # url, seconds
  for _ in $(seq 1 $(($2 * 10))); do
    if $PY -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=1)" "$1" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "timeout waiting for $1" >&2; return 1
}

for POLICY in $POLICIES; do
  echo "=== $POLICY"
  $PY -m eldr_sglang.emulate cluster --trace "$TRACE" --prefill 2 --decode 4 --base-port "$BASE_PORT" \
      --time-scale "$TIME_SCALE" --hardware "$HARDWARE" --assign sequential > "$OUT/cluster_$POLICY.log" 2>&1 &
  CLUSTER_PID=$!
  for j in 0 1 2 3; do wait_http "http://127.0.0.1:$((BASE_PORT + 10 + j))/health" 60; done
  EXTRA=()
  [ "$POLICY" = eldr ] && EXTRA=(--eldr-centroids "$WORK/c.eldr")
  $PY -m eldr_sglang.launch_router --pd-disaggregation --disagg-router "$POLICY" "${EXTRA[@]}" \
      --prefill "http://127.0.0.1:$BASE_PORT" $((BASE_PORT + 100)) --prefill "http://127.0.0.1:$((BASE_PORT + 1))" $((BASE_PORT + 101)) \
      --decode "http://127.0.0.1:$((BASE_PORT + 10))" --decode "http://127.0.0.1:$((BASE_PORT + 11))" \
      --decode "http://127.0.0.1:$((BASE_PORT + 12))" --decode "http://127.0.0.1:$((BASE_PORT + 13))" \
      --host 127.0.0.1 --port "$ROUTER_PORT" --log-level warning > "$OUT/router_$POLICY.log" 2>&1 &
  ROUTER_PID=$!
  wait_http "http://127.0.0.1:$ROUTER_PORT/health" 60
  rm -f "$OUT/$POLICY.jsonl"
  $PY -m sglang.benchmark.serving --backend sglang --base-url "http://127.0.0.1:$ROUTER_PORT" --pd-separated \
      --model emulated --tokenizer "$WORK/tok" --dataset-name random-ids --random-input-len "$INPUT_LEN" \
      --random-output-len "$OUTPUT_LEN" --random-range-ratio 0.5 --num-prompts "$NUM_PROMPTS" \
      --request-rate "$RATE" --max-concurrency "$MAX_CONCURRENCY" --seed 1 --disable-tqdm \
      --output-file "$OUT/$POLICY.jsonl" > "$OUT/bench_$POLICY.log" 2>&1 || { tail -20 "$OUT/bench_$POLICY.log"; exit 1; }
  $PY - "$BASE_PORT" "$OUT/emulator_$POLICY.json" <<'EOF'
import json, sys, urllib.request
base = int(sys.argv[1])
stats = [json.loads(urllib.request.urlopen(f"http://127.0.0.1:{base + 10 + j}/emulator/stats", timeout=10).read()) for j in range(4)]
json.dump(stats, open(sys.argv[2], "w"))
EOF
  curl -s "http://127.0.0.1:$ROUTER_PORT/metrics" > "$OUT/metrics_$POLICY.txt" 2>/dev/null || true
  kill "$ROUTER_PID"; wait "$ROUTER_PID" 2>/dev/null || true; ROUTER_PID=""
  kill "$CLUSTER_PID"; wait "$CLUSTER_PID" 2>/dev/null || true; CLUSTER_PID=""
done

$PY - "$OUT" $POLICIES <<'EOF'
import json, sys
out, policies = sys.argv[1], sys.argv[2:]
rows = {}
print(f"{'policy':<16}{'TPOT mean':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'ITL mean':>10}{'ITL p99':>10}{'out tok/s':>10}{'experts/step':>13}")
for p in policies:
    r = [json.loads(l) for l in open(f"{out}/{p}.jsonl") if l.strip()][-1]
    st = json.load(open(f"{out}/emulator_{p}.json"))
    steps = sum(s["steps"] for s in st)
    distinct = sum(s["mean_distinct_experts"] * s["steps"] for s in st) / max(steps, 1)
    rows[p] = {k: r.get(k) for k in ("mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                                      "output_throughput", "completed")}
    rows[p]["mean_distinct_experts_per_layer_step"] = distinct
    x = rows[p]
    print(f"{p:<16}{x['mean_tpot_ms']:>10.2f}{x['median_tpot_ms']:>10.2f}{x['p99_tpot_ms']:>10.2f}{x['mean_itl_ms']:>10.2f}"
          f"{x['p99_itl_ms']:>10.2f}{x['output_throughput']:>10.1f}{distinct:>13.2f}")
json.dump(rows, open(f"{out}/summary.json", "w"), indent=2)
print(f"(emulated decode on the simulator's execution model; per-policy details in {out})")
EOF
