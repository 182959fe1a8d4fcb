"""GPU calibration of the simulator's MoE-layer cost: time of one MoE layer against the number
of distinct experts d its batch touches, at fixed batch B, fitted as t(B, d) = a(B) + b(B) * d.

    python benchmarks/gpu_calibrate.py --out benchmarks/results/moe_calibration_h200.json
    python benchmarks/gpu_calibrate.py --dry-run --out /tmp/cal.json       # CPU, tiny shapes

For each shape (DeepSeek-V2-Lite, Qwen3-30B-A3B, GPT-OSS-20B and one TP rank's slice of
DeepSeek-V3 at TP 8) and each B in {8, 16, 32, 64} it builds random bf16 expert weights and a
top-k assignment whose B x k picks cover exactly d distinct experts (k <= d <= min(B k, E)),
then times, with CUDA events after warm-up, the gate (router GEMM + softmax + top-k) plus
SGLang's fused MoE Triton kernel (`fused_experts_impl`: align/permute, two grouped GEMMs, the
activation, the weighted combine), falling back to a grouped GEMM in torch when SGLang's kernel
is unavailable; the kernel used is recorded per entry. a(B) and b(B) come from a non-negative
least-squares fit (scipy.optimize.nnls) over the d grid; the residual is recorded.

Weights are bf16 for every shape (the checkpoints' FP8 / MXFP4 formats need kernel-specific
scale layouts): for DeepSeek-V3 (FP8) and GPT-OSS-20B (MXFP4) the measured per-expert slope
b is therefore an upper bound on the checkpoint's; each entry records `weight_dtype`. The
output file (format eldr-moe-calibration/1) is read by
`eldr_sglang.sim.cost_model.load_calibration` and replaces the roofline's expert time
(ExecutionModel(calibration=...)). One run is sized to finish well under 10 minutes on one
H100/H200 (--budget-s stops early, keeping what was measured). Not done: timing a whole
decode step of a random-weight model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "eldr-moe-calibration/1"


@dataclass(frozen=True)
class Shape:
    model: str  # name in the model catalogue eldr_sglang.models (what the cost model looks up)
    hidden: int
    inter: int  # per-rank intermediate size of one expert
    experts: int
    top_k: int
    note: str = ""


# From the public configs (see eldr_sglang/models.py for the sources).
SHAPES = (
    Shape("deepseek-v2-lite", 2048, 1408, 64, 6),
    Shape("qwen3-30b-a3b", 2048, 768, 128, 8),
    Shape("gpt-oss-20b", 2880, 2880, 32, 4),
    Shape("deepseek-v3", 7168, 2048 // 8, 256, 8, note="one rank of TP 8: moe_intermediate_size 2048 / 8"),
)
TINY = (Shape("tiny-moe", 64, 32, 16, 2, note="dry run"), Shape("tiny-moe-wide", 96, 48, 24, 3, note="dry run"))
BATCHES = (8, 16, 32, 64)


def d_grid(b: int, s: Shape, points: int) -> list[int]:
    hi = min(b * s.top_k, s.experts)
    return sorted({int(round(x)) for x in np.linspace(s.top_k, hi, points)})


def topk_ids_covering(b: int, k: int, d: int, experts: int, rng) -> np.ndarray:
    """[b, k] ids whose union is exactly d experts (a random d-subset), each row distinct."""
    if not k <= d <= min(b * k, experts):
        raise ValueError(f"need k <= d <= min(B k, E), got k={k} d={d} B={b} E={experts}")
    pool = rng.permutation(experts)[:d]
    flat = np.arange(b * k) % d  # every pool slot used, rows of k consecutive slots are distinct (d >= k)
    return pool[flat.reshape(b, k)]


def _sglang_kernel():
    try:
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts_impl
    except Exception as exc:  # noqa: BLE001 - any import failure means: use the fallback
        return None, f"{type(exc).__name__}: {exc}"
    return fused_experts_impl, None


def grouped_gemm(torch, x, w1, w2, weights, ids):
    """Fallback: per touched expert, gather its tokens, SwiGLU MLP, weighted scatter-add."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x[tok] @ w1[e].t()
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (a @ w2[e].t()) * weights[tok, slot, None].to(x.dtype))
    return out


def time_fn(torch, fn, device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends)])) * 1e-3
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def fit_line(ds, ts) -> tuple[float, float, float]:
    """Non-negative least squares t = a + b d; returns (a, b, relative RMS residual)."""
    from scipy.optimize import nnls

    A = np.stack([np.ones(len(ds)), np.asarray(ds, np.float64)], axis=1)
    y = np.asarray(ts, np.float64)
    (a, b), _ = nnls(A, y)
    resid = float(np.sqrt(np.mean((A @ [a, b] - y) ** 2)) / max(float(y.mean()), 1e-30))
    return float(a), float(b), resid


def measure_shape(torch, s: Shape, batches, points, device, dtype, kernel, warmup, reps, rng, deadline, log):
    g = torch.Generator(device=device).manual_seed(0)
    w1 = (torch.randn(s.experts, 2 * s.inter, s.hidden, device=device, dtype=dtype, generator=g) * 0.02)
    w2 = (torch.randn(s.experts, s.hidden, s.inter, device=device, dtype=dtype, generator=g) * 0.02)
    wg = (torch.randn(s.experts, s.hidden, device=device, dtype=dtype, generator=g) * 0.02)
    entries = []
    for b in batches:
        if time.monotonic() > deadline:
            log(f"   budget reached; skipping {s.model} B >= {b}")
            break
        x = torch.randn(b, s.hidden, device=device, dtype=dtype, generator=g)

        def gate():
            logits = x @ wg.t()
            return torch.topk(torch.softmax(logits.float(), dim=-1), s.top_k, dim=-1)

        t_gate = time_fn(torch, gate, device, warmup, reps)
        ds, ts = [], []
        used = "sglang.fused_experts_impl" if kernel else "torch.grouped_gemm"
        for d in d_grid(b, s, points):
            ids = torch.as_tensor(topk_ids_covering(b, s.top_k, d, s.experts, rng), device=device, dtype=torch.int32)
            wts = torch.full((b, s.top_k), 1.0 / s.top_k, device=device, dtype=torch.float32)
            if kernel is not None and used.startswith("sglang"):
                fn = lambda: kernel(x, w1, w2, wts, ids)  # noqa: E731
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - fall back, and say so in the entry
                    log(f"   sglang kernel failed on {s.model} B={b} d={d} ({type(exc).__name__}: {exc}); torch fallback")
                    used = "torch.grouped_gemm"
            if used.startswith("torch"):
                ids64 = ids.long()
                fn = lambda: grouped_gemm(torch, x, w1, w2, wts, ids64)  # noqa: E731
            ds.append(d)
            ts.append(time_fn(torch, fn, device, warmup, reps) + t_gate)
        a, slope, resid = fit_line(ds, ts)
        entries.append({"model": s.model, "batch": b, "a_s": a, "b_s": slope, "fit_rel_rms": resid, "gate_s": t_gate,
                        "d": ds, "t_s": ts, "kernel": used, "weight_dtype": str(dtype).replace("torch.", ""),
                        "hidden": s.hidden, "intermediate_per_rank": s.inter, "experts": s.experts, "top_k": s.top_k,
                        "note": s.note})
        log(f"   {s.model:18s} B={b:3d}: a {a * 1e6:8.2f} us  b {slope * 1e6:7.3f} us/expert  (rms {resid:.1%}, {used}, "
            f"d {ds[0]}..{ds[-1]})")
    return entries


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="calibration file to write (refuses to overwrite without --force)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch fallback only (for tests)")
    ap.add_argument("--models", default="", help="comma list of shapes (default: all)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--points", type=int, default=6, help="d values per batch")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new batches after this long")
    ap.add_argument("--hardware", default="", help="label written into the file (default: the GPU's name)")
    ap.add_argument("--json", help="also write the entries here (same content)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise SystemExit(f"{out} exists; pass --force to replace it")
    try:
        import torch
    except ImportError:
        raise SystemExit("torch is not installed (pip install -e '.[sglang]' brings it)") from None
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    if not batches or min(batches) < 1:
        raise SystemExit("--batches must be positive integers")
    shapes = TINY if args.dry_run else SHAPES
    if args.models:
        want = {m.strip() for m in args.models.split(",")}
        unknown = want - {s.model for s in shapes}
        if unknown:
            raise SystemExit(f"unknown shapes {sorted(unknown)}; known: {', '.join(s.model for s in shapes)}")
        shapes = tuple(s for s in shapes if s.model in want)
    if args.dry_run:
        torch.set_num_threads(1)  # a shared CPU: one core is enough for tiny shapes
        device, dtype, kernel, why = "cpu", torch.float32, None, "dry run"
        batches = [b for b in batches if b <= 16] or [4]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --dry-run on a CPU")
        device, dtype = "cuda", torch.bfloat16
        kernel, why = _sglang_kernel()
    hw = args.hardware or (torch.cuda.get_device_name(0) if device == "cuda" else "cpu")

    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    log(f"calibrating on {hw} ({device}); kernel: {'sglang fused_experts_impl' if kernel else 'torch grouped GEMM (' + str(why) + ')'}")
    rng = np.random.default_rng(0)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    entries = []
    for s in shapes:
        entries += measure_shape(torch, s, batches, args.points, device, dtype, kernel, args.warmup, args.reps, rng, deadline, log)
        for e in entries:
            e.setdefault("hardware", hw)
    doc = {"format": FORMAT, "hardware": hw, "device": device, "torch": torch.__version__,
           "sglang_kernel": kernel is not None, "fallback_reason": None if kernel else why,
           "dry_run": args.dry_run, "seconds": round(time.monotonic() - t0, 1), "entries": entries}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print("| model | B | a (us) | b (us/expert) | fit rel. RMS | kernel |")
    print("|---|---|---|---|---|---|")
    for e in entries:
        print(f"| {e['model']} | {e['batch']} | {e['a_s'] * 1e6:.2f} | {e['b_s'] * 1e6:.3f} | {e['fit_rel_rms']:.1%} | {e['kernel']} |")
    log(f"wrote {out} ({len(entries)} entries, {doc['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
