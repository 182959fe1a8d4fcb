"""ELDR's per-request counts against SGLang 0.5.23's own RoutedExpertsCapturer, on constructed
forward batches of parallel layouts that cannot run on a CPU (DP attention, DeepEP).

Run as a script with the patched overlay (CPU shim + ELDR series) first on PYTHONPATH; prints
one line `PROBE{json}`. Each case plays one rank of a layout in this process: SGLang's
parallel-state lookups (`get_parallel`, the DP gather slot and width, whether DP attention is on,
whether the all-to-all backend scatters) answer for that rank, and the attention-TP all-gather
returns the rows all ranks of the group hold. Everything else is SGLang's code: the patched
capture site `capture_routed_experts_if_allowed` feeds both ELDR's accumulator and a real
`RoutedExpertsCapturer`, whose `on_forward_end` slice is the reference, request by request.
"""

from __future__ import annotations

import json
import types

import numpy as np
import torch

import sglang.srt.layers.dp_attention as dpa
import sglang.srt.layers.moe.topk as topk
import sglang.srt.runtime_context as rc
import sglang.srt.state_capturer.routed_experts as rex
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import prepare_server_args

from eldr_sglang.sglang_ext import runtime
from eldr_sglang.sglang_ext.payload import decode_payload

HIDDEN, MOE, E, K = 4, [1, 2, 3], 16, 3  # layer 0 dense (first_k_dense_replace=1)
CHUNK = 64
ALLOW = types.SimpleNamespace(allow_routed_experts_capture=True)

rc.publish(prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                                "--enable-eldr-signature", "--chunked-prefill-size", str(CHUNK)]), role="scheduler")
_GROUP = {"rows": None, "rank": 0}


def _attn_tp_all_gather(out, local):
    """The attention-TP all-gather as every rank of the group would see it."""
    rows = _GROUP["rows"]
    assert torch.equal(local.to(torch.int32), rows[_GROUP["rank"]].to(torch.int32)), "a rank gathered rows it does not hold"
    out.copy_(torch.cat(rows).to(out.dtype))


def play(*, dp_ranks, dp_rank, attn_tp, attn_tp_rank, dp_attention, scattered):
    par = types.SimpleNamespace(attn_tp_size=attn_tp, num_dp_ranks=dp_ranks)
    rc.get_parallel = rex.get_parallel = lambda: par
    dpa.is_dp_attention_enabled = rex.is_dp_attention_enabled = lambda: dp_attention
    dpa.dp_gather_width = lambda: dp_ranks
    dpa.dp_gather_slot = lambda: dp_rank
    rex._is_scattered_a2a_backend = lambda: scattered
    dpa.attn_tp_all_gather_into_tensor = rex.attn_tp_all_gather_into_tensor = _attn_tp_all_gather
    _GROUP["rank"] = attn_tp_rank


def _ceil(n, a):
    return (n + a - 1) // a * a


class Rank:
    """One rank: the patched ModelRunner's hooks, ELDR's accumulator and SGLang's capturer."""

    def __init__(self, shared=0):
        hf = types.SimpleNamespace(num_hidden_layers=HIDDEN, first_k_dense_replace=1, moe_layer_freq=1,
                                   n_routed_experts=E, num_experts_per_tok=K)
        self.pool = types.SimpleNamespace(req_generation=torch.zeros(16, dtype=torch.int64),
                                          req_to_token=torch.zeros((16, 8), dtype=torch.int32))
        self.runner = types.SimpleNamespace(
            is_draft_worker=False, req_to_token_pool=self.pool, device="cpu",
            model_config=types.SimpleNamespace(hf_text_config=hf),
            model=types.SimpleNamespace(shared_experts_config=types.SimpleNamespace(num_fused_shared_experts=shared)))
        runtime.ACCUMULATOR = None
        runtime.install(self.runner)
        self.status = runtime.status()
        self.cap = rex.RoutedExpertsCapturer(self.runner.model_config, num_tokens=256, max_running_requests=8,
                                             num_fused_shared_experts=shared, device="cpu")
        rex.set_global_experts_capturer(self.cap)
        self.reference: dict[int, np.ndarray] = {}
        self.generation = 0

    def new_request(self, slot):
        self.generation += 1
        self.pool.req_generation[slot] = self.generation

    def forward(self, reqs, padded_counts, layer_rows, local_rows=None, replay=False):
        """reqs: [(slot, tokens)] of this rank; padded_counts: the per-DP-rank token counts after
        SGLang's padding (global_num_tokens_cpu once prepare_mlp_sync_batch ran); layer_rows:
        per layer, the rows the capture site sees here (or, scattered, the whole group's rows
        split by attention-TP rank: local_rows[layer] is that list)."""
        slots, lens = [s for s, _ in reqs], [n for _, n in reqs]
        n = sum(lens)
        fb = types.SimpleNamespace(
            forward_mode=ForwardMode.EXTEND if reqs else ForwardMode.IDLE,
            extend_seq_lens_cpu=lens, req_pool_indices_cpu=torch.tensor(slots, dtype=torch.int64),
            req_pool_indices=torch.tensor(slots, dtype=torch.int64), extend_seq_lens=torch.tensor(lens, dtype=torch.int64),
            global_num_tokens_cpu=None, out_cache_loc=torch.arange(n), out_cache_loc_virtual=None)
        runtime.begin_forward(self.runner, fb)
        fb.global_num_tokens_cpu = list(padded_counts)  # SGLang pads inside the forward
        if replay:  # a CUDA-graph replay: no capture call reaches Python
            return
        for layer in range(HIDDEN):
            if local_rows is not None:
                _GROUP["rows"] = local_rows[layer]
                ids = local_rows[layer][_GROUP["rank"]]
            else:
                ids = layer_rows[layer]
            topk.capture_routed_experts_if_allowed(ALLOW, layer, ids)
        out = self.cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=True)
        got = out.topk.numpy()  # [this rank's tokens, layers, K]: what return_routed_experts reads
        start = 0
        for s, ln in reqs:
            ref = self.reference.setdefault(s, np.zeros((len(MOE), E), np.int64))
            for i, layer in enumerate(MOE):
                np.add.at(ref[i], got[start:start + ln, layer].reshape(-1), 1)
            start += ln

    def compare(self, slots):
        reqs = [types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=s)) for s in slots]
        res = {}
        for s, p in zip(slots, runtime.payloads_for(reqs)):
            p = json.loads(json.dumps(p))
            if "none" in p:
                res[s] = {"none": p["none"]}
                continue
            d = decode_payload(p)
            ref = self.reference.get(s, np.zeros((len(MOE), E), np.int64))
            res[s] = {"equal": bool(np.array_equal(d.counts, ref)), "tokens": d.num_tokens, "total": int(ref.sum()),
                      "layers": list(d.layers)}
        return res


def _ids(rng, rows, width=K, shared=0):
    ids = np.stack([rng.permutation(E)[:width] for _ in range(rows)]) if rows else np.zeros((0, width), np.int64)
    if shared:
        ids = np.concatenate([ids, np.full((rows, shared), E)], axis=1)  # fused shared expert ids
    return torch.tensor(ids, dtype=torch.int32)


def dp_attention_case(mode, attn_tp):
    """Three DP ranks with uneven counts (one idle in the second forward), rows gathered across
    DP ranks and padded as SGLang pads them (to attn_tp multiples; MAX_LEN: to the largest).
    Request at slot 5 of rank 0 is chunked across both forwards."""
    rng = np.random.default_rng(11)
    per_rank = [  # forwards x ranks: [(slot, tokens)]
        [[(5, 7), (2, 3)], [(1, 4)], [(3, 9), (4, 2)]],
        [[(5, 6)], [], [(6, 5)]],
    ]
    # the gathered rows of each forward, identical on every rank (random ids in padding too)
    plans = []
    for fwd in per_rank:
        n = [sum(t for _, t in reqs) for reqs in fwd]
        padded = [_ceil(x, attn_tp) for x in n]
        if mode == "max_len":
            padded = [max(padded)] * len(padded)
        plans.append((padded, [_ids(rng, sum(padded)) for _ in range(HIDDEN)]))
    out = {}
    for r in range(3):
        play(dp_ranks=3, dp_rank=r, attn_tp=attn_tp, attn_tp_rank=0, dp_attention=True, scattered=False)
        rank = Rank()
        seen = set()
        for fwd, (padded, rows) in zip(per_rank, plans):
            for s, _ in fwd[r]:
                if s not in seen:
                    seen.add(s)
                    rank.new_request(s)
            rank.forward(fwd[r], padded, rows)
        out[str(r)] = {"status": rank.status, "reqs": rank.compare(sorted(seen))}
    return out


def deepep_case(dp_attention, attn_tp, shared):
    """DeepEP: the DP group's tokens (padded to an attention-TP multiple) are scattered over the
    attention-TP ranks; every rank of the group is played in turn. Two forwards, a chunked request."""
    rng = np.random.default_rng(12)
    fwds = [[(3, 5), (7, 6)], [(3, 4), (1, 2)]]
    plans = []
    for reqs in fwds:
        n = sum(t for _, t in reqs)
        p = _ceil(n, attn_tp)
        layers = []
        for _ in range(HIDDEN):
            rows = _ids(rng, p, shared=shared)
            layers.append(list(rows.split(p // attn_tp)))
        plans.append((p, layers))
    out = {}
    for a in range(attn_tp):
        play(dp_ranks=2 if dp_attention else 1, dp_rank=1 if dp_attention else 0, attn_tp=attn_tp, attn_tp_rank=a,
             dp_attention=dp_attention, scattered=True)
        rank = Rank(shared=shared)
        seen = set()
        for reqs, (p, layers) in zip(fwds, plans):
            for s, _ in reqs:
                if s not in seen:
                    seen.add(s)
                    rank.new_request(s)
            rank.forward(reqs, [p, p] if dp_attention else [p], None, local_rows=layers)
        out[str(a)] = {"status": rank.status, "reqs": rank.compare(sorted(seen))}
    return out


def replay_case():
    """DP attention, but the forward's layers ran inside a graph (no capture reached Python):
    the request is reported as unattributed, never counted wrong."""
    play(dp_ranks=2, dp_rank=1, attn_tp=1, attn_tp_rank=0, dp_attention=True, scattered=False)
    rank = Rank()
    rank.new_request(4)
    rank.forward([(4, 3)], [2, 3], None, replay=True)
    return rank.compare([4])


def refused_case():
    """A layout ELDR cannot attribute: pipeline parallel."""
    rc.publish(prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                                    "--enable-eldr-signature", "--pp-size", "2"]), role="scheduler")
    play(dp_ranks=1, dp_rank=0, attn_tp=1, attn_tp_rank=0, dp_attention=False, scattered=False)
    runtime.ACCUMULATOR = None
    runtime.install(types.SimpleNamespace(is_draft_worker=False))  # refused before it reads the model
    return {"status": runtime.status(), "accumulator": runtime.ACCUMULATOR is not None}


if __name__ == "__main__":
    res = {
        "dp_attention_sum_len": dp_attention_case("sum_len", 1),
        "dp_attention_sum_len_attn_tp2": dp_attention_case("sum_len", 2),
        "dp_attention_max_len": dp_attention_case("max_len", 2),
        "deepep_tp4": deepep_case(False, 4, 0),
        "deepep_dp_attention_tp2_shared": deepep_case(True, 2, 1),
        "dp_attention_graph_replay": replay_case(),
        "refused_pp": refused_case(),
    }
    print("PROBE" + json.dumps(res))
