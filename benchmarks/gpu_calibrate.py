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
decode step of a random-weight model on a GPU.

CPU mode (`--device cpu`), for the real-engine CPU benchmark (benchmarks/real_cpu_tpot.py):

    python benchmarks/gpu_calibrate.py --device cpu --model-dir MODEL_DIR --out cal_cpu.json

At the constructed Qwen3-MoE's shape (from MODEL_DIR's config.json, else CPU_DEFAULT, equal to
LocalityModelSpec's defaults), on one torch thread (the servers run with OMP_NUM_THREADS=1),
bf16, batches 1, 2, 4, 8, 16, it times one MoE layer through SGLang's own CPU path,
`moe_forward_native` (sglang/srt/layers/moe/fused_moe_native.py: one F.linear pair per expert
that has tokens), plus the gate, against d as above; and, per batch, the non-MoE work of one
decode step with torch ops (`other_s`: per layer RMSNorm, q/k/v projections, q/k norms, rotary,
SDPA per request over --context cached tokens as SGLang's torch_native decode does, o
projection, post-attention norm; then the final norm, LM head and argmax). The simulator then
models a decode step as other_s(B) + sum over layers of a(B) + b(B) * d_l. Not in other_s:
the engine's scheduler and Python overhead per step (so it is a lower bound of the non-MoE
time). Importing SGLang here needs SGLANG_USE_CPU_ENGINE=1 and a libcuda stand-in on
LD_LIBRARY_PATH; without them the script builds the test stub
(eldr_sglang.testing.sglang_cpu.stub) and re-executes itself once with both set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class CpuShape:
    """The whole model shape a CPU calibration needs: the MoE layer and the non-MoE step."""

    model: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    note: str = ""


# Equal to LocalityModelSpec's defaults (eldr_sglang/testing/sglang_cpu/locality_model.py): the
# constructed Qwen3-MoE of the real-engine CPU benchmark.
CPU_DEFAULT = CpuShape("qwen3-moe-locality", hidden=512, inter=1536, experts=32, top_k=4, layers=4, heads=8,
                       kv_heads=4, head_dim=64, vocab=2048, note="constructed Qwen3-MoE (LocalityModelSpec defaults)")
# experts of 384 kB, so the per-expert cost stands out of one core's timing noise in tests
CPU_TINY = CpuShape("tiny-cpu-moe", hidden=128, inter=512, experts=16, top_k=2, layers=2, heads=2, kv_heads=1,
                    head_dim=16, vocab=128, note="tiny shape (tests)")
CPU_BATCHES = (1, 2, 4, 8, 16)
REEXEC_ENV = "ELDR_CALIBRATE_REEXEC"  # set on the one re-execution with the CPU engine environment
CPU_MOE_KERNELS = ("sglang", "torch")


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


# ---------------------------------------------------------------- CPU mode
def cpu_shape_from_model_dir(path) -> CpuShape:
    """The CpuShape of a model directory (its config.json, read as the simulator reads it)."""
    from eldr_sglang.models import get_model

    m = get_model(str(path))  # ValueError names what is missing
    if m.attention != "gqa":
        raise ValueError(f"{path}: --device cpu times GQA attention; this config is {m.attention}")
    if m.num_dense_layers or m.num_shared_experts:
        raise ValueError(f"{path}: --device cpu handles all-MoE layers without shared experts (Qwen3-MoE)")
    return CpuShape(m.name, m.hidden_size, m.moe_intermediate_size, m.num_experts, m.top_k, m.num_layers,
                    m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size, note=f"config {m.source.removeprefix('config ')}")


def cpu_label() -> str:
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {name}, 1 thread"


def _stub_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eldr-sglang"


def sglang_cpu_moe(argv, log):
    """(moe_forward_native, MoeRunnerConfig) from SGLang. Without the CPU engine environment it
    builds the libcuda stub and re-executes this script once with SGLANG_USE_CPU_ENGINE=1 and the
    stub on LD_LIBRARY_PATH (never returns then); a second failure is a clear error."""
    err = "SGLANG_USE_CPU_ENGINE is not 1"
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        try:
            from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
            from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

            return moe_forward_native, MoeRunnerConfig
        except Exception as exc:  # noqa: BLE001 - any failure: set the environment up, or say why
            err = f"{type(exc).__name__}: {exc}"
    if os.environ.get(REEXEC_ENV) == "1":
        raise SystemExit(f"cannot import SGLang's CPU MoE path (sglang.srt.layers.moe.fused_moe_native) even with "
                         f"SGLANG_USE_CPU_ENGINE=1 and the libcuda stub on LD_LIBRARY_PATH: {err}\n"
                         "install sglang (pip install -e '.[sglang]'), or time the torch reference with --moe-kernel torch")
    try:
        from eldr_sglang.testing.sglang_cpu.stub import HarnessError, build_libcuda_stub
    except ImportError as exc:
        raise SystemExit(f"cannot import SGLang's CPU MoE path ({err}) nor eldr_sglang to set it up ({exc})") from None
    try:
        stub = build_libcuda_stub(_stub_cache())
    except (HarnessError, OSError) as exc:
        raise SystemExit(f"cannot import SGLang's CPU MoE path ({err}), and building the libcuda stub failed: {exc}") from None
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", **{REEXEC_ENV: "1"})
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(stub), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    log(f"re-executing with SGLANG_USE_CPU_ENGINE=1 and the libcuda stub {stub} ({err})")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)


def _rms(torch, x, w, eps=1e-6):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


def make_other_step(torch, s: CpuShape, b: int, context: int, dtype, g):
    """fn() running the non-MoE work of one decode step of b tokens (see the module docstring)."""
    F = torch.nn.functional
    H, nh, nkv, hd = s.hidden, s.heads, s.kv_heads, s.head_dim

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    layers = [dict(ln=torch.ones(H, dtype=dtype), q=w(nh * hd, H), k=w(nkv * hd, H), v=w(nkv * hd, H),
                   o=w(H, nh * hd), qn=torch.ones(hd, dtype=dtype), kn=torch.ones(hd, dtype=dtype),
                   post=torch.ones(H, dtype=dtype),
                   kc=w(b * (context + 1), nkv, hd), vc=w(b * (context + 1), nkv, hd))
              for _ in range(s.layers)]
    emb, head, final = w(s.vocab, H), w(s.vocab, H), torch.ones(H, dtype=dtype)
    ids = torch.randint(0, s.vocab, (b,), generator=g)
    req_tokens = torch.arange(b * (context + 1)).view(b, context + 1)  # each request's KV slots
    pos = torch.full((b,), context)
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos().to(dtype)[:, None], ang.sin().to(dtype)[:, None]

    def rope(x):  # neox-style rotary on [b, heads, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def step():
        h = emb[ids]
        for ly in layers:
            r = h
            x = _rms(torch, h, ly["ln"])
            q = rope(_rms(torch, F.linear(x, ly["q"]).view(b, nh, hd), ly["qn"]))
            k = rope(_rms(torch, F.linear(x, ly["k"]).view(b, nkv, hd), ly["kn"]))
            v = F.linear(x, ly["v"]).view(b, nkv, hd)
            ly["kc"][req_tokens[:, -1]] = k
            ly["vc"][req_tokens[:, -1]] = v
            out = torch.empty(b, nh, hd, dtype=dtype)
            for i in range(b):  # one SDPA per request, as SGLang's torch_native decode backend
                kk = ly["kc"][req_tokens[i]].movedim(0, 1)
                vv = ly["vc"][req_tokens[i]].movedim(0, 1)
                out[i] = F.scaled_dot_product_attention(q[i][:, None], kk, vv, enable_gqa=nh != nkv)[:, 0]
            h = r + F.linear(out.view(b, nh * hd), ly["o"])
            h = _rms(torch, h, ly["post"])  # the MoE's input norm (the MoE itself is in a_s + b_s d)
        return F.linear(_rms(torch, h, final), head).argmax(-1)

    return step


def measure_cpu(torch, s: CpuShape, batches, points, context, kernel, warmup, reps, rng, deadline, log):
    """Entries of one CPU calibration: per batch, t(B, d) of one MoE layer (gate + the MoE path)
    against d, its fit, and other_s, the non-MoE work of one decode step."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(s.experts, 2 * s.inter, s.hidden, generator=g) * 0.02).to(dtype)
    w2 = (torch.randn(s.experts, s.hidden, s.inter, generator=g) * 0.02).to(dtype)
    wg = (torch.randn(s.experts, s.hidden, generator=g) * 0.02).to(dtype)
    if kernel is not None:
        moe_forward_native, MoeRunnerConfig = kernel
        layer = types.SimpleNamespace(w13_weight=w13, w2_weight=w2, num_experts=s.experts, layer_id=0)
        cfg = MoeRunnerConfig(activation="silu")
        used = "sglang.moe_forward_native"
    else:
        used = "torch.grouped_gemm"
    entries = []
    for b in batches:
        if time.monotonic() > deadline:
            log(f"   budget reached; skipping B >= {b}")
            break
        x = (torch.randn(b, s.hidden, generator=g)).to(dtype)

        def gate():
            logits = torch.nn.functional.linear(x, wg)
            w, i = torch.topk(torch.softmax(logits.float(), dim=-1), s.top_k, dim=-1)
            return w / w.sum(dim=-1, keepdim=True), i

        t_gate = time_fn(torch, gate, "cpu", warmup, reps)
        ds, ts = [], []
        for d in d_grid(b, s, points):
            ids = torch.as_tensor(topk_ids_covering(b, s.top_k, d, s.experts, rng), dtype=torch.int32)
            wts = torch.full((b, s.top_k), 1.0 / s.top_k, dtype=torch.float32)
            if kernel is not None:
                fn = lambda: moe_forward_native(layer, x, (wts, ids, None), cfg)  # noqa: E731
            else:
                ids64 = ids.long()
                fn = lambda: grouped_gemm(torch, x, w13, w2, wts, ids64)  # noqa: E731
            ds.append(d)
            ts.append(time_fn(torch, fn, "cpu", warmup, reps) + t_gate)
        other = time_fn(torch, make_other_step(torch, s, b, context, dtype, g), "cpu", warmup, reps)
        a, slope, resid = fit_line(ds, ts)
        entries.append({"model": s.model, "batch": b, "a_s": a, "b_s": slope, "fit_rel_rms": resid, "gate_s": t_gate,
                        "other_s": other, "d": ds, "t_s": ts, "kernel": used, "weight_dtype": "bfloat16",
                        "hidden": s.hidden, "intermediate_per_rank": s.inter, "experts": s.experts, "top_k": s.top_k,
                        "layers": s.layers, "heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
                        "vocab": s.vocab, "context_tokens": context, "threads": torch.get_num_threads(),
                        "note": s.note})
        log(f"   {s.model:18s} B={b:3d}: a {a * 1e6:8.1f} us  b {slope * 1e6:7.1f} us/expert  other {other * 1e3:6.2f} ms "
            f"(rms {resid:.1%}, {used}, d {ds[0]}..{ds[-1]})")
    return entries


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="calibration file to write (refuses to overwrite without --force)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch fallback only (for tests)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda (default): the GPU shapes; cpu: the real-engine CPU benchmark's model through SGLang's "
                         "CPU MoE path, one thread, with the non-MoE step time other_s")
    ap.add_argument("--model-dir", help="--device cpu: take the shape from this model directory's config.json "
                                        "(default: the constructed Qwen3-MoE's, LocalityModelSpec)")
    ap.add_argument("--tiny", action="store_true", help="--device cpu: a tiny shape (tests)")
    ap.add_argument("--context", type=int, default=48, help="--device cpu: cached tokens per request in other_s (default 48)")
    ap.add_argument("--moe-kernel", choices=CPU_MOE_KERNELS, default="sglang",
                    help="--device cpu: sglang (default, moe_forward_native) or torch (the grouped-GEMM reference; "
                         "recorded per entry)")
    ap.add_argument("--models", default="", help="comma list of shapes (default: all)")
    ap.add_argument("--batches", default=None, help=f"comma list (default {','.join(map(str, BATCHES))}; "
                                                   f"--device cpu: {','.join(map(str, CPU_BATCHES))})")
    ap.add_argument("--points", type=int, default=6, help="d values per batch")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new batches after this long")
    ap.add_argument("--hardware", default="", help="label written into the file (default: the GPU's name)")
    ap.add_argument("--json", help="also write the entries here (same content)")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise SystemExit(f"{out} exists; pass --force to replace it")
    if args.device == "cpu":
        return main_cpu(args, list(sys.argv[1:] if argv is None else argv))
    if args.model_dir or args.tiny or args.moe_kernel != "sglang":
        raise SystemExit("--model-dir, --tiny and --moe-kernel go with --device cpu")
    return main_gpu(args, out)


def _gpu_shapes(args) -> tuple:
    """The shapes --models names (all when empty), tiny ones for --dry-run."""
    shapes = TINY if args.dry_run else SHAPES
    if args.models:
        want = {m.strip() for m in args.models.split(",")}
        unknown = want - {s.model for s in shapes}
        if unknown:
            raise SystemExit(f"unknown shapes {sorted(unknown)}; known: {', '.join(s.model for s in shapes)}")
        shapes = tuple(s for s in shapes if s.model in want)
    return shapes


def step_terms(entries: list[dict], layers: int) -> dict:
    """The three terms the simulator's engine fit uses (benchmarks/sim_vs_engine.py), per model:
    step = fixed + per_request * B + per_expert * (distinct experts summed over `layers` MoE
    layers). per_expert is the median over batches of b(B); fixed and per_request a least-squares
    line over B through other_s(B) + layers * a(B) (CPU: the whole step but the engine's
    scheduler) or layers * a(B) (GPU: the MoE layers only, no other_s measured)."""
    out: dict = {}
    for model in dict.fromkeys(e["model"] for e in entries):
        es = sorted((e for e in entries if e["model"] == model), key=lambda e: e["batch"])
        b = np.array([e["batch"] for e in es], float)
        y = np.array([e.get("other_s", 0.0) + layers * e["a_s"] for e in es])
        per_request, fixed = np.polyfit(b, y, 1) if len(es) > 1 else (0.0, float(y[0]))
        out[model] = {"fixed_s": float(fixed), "per_request_s": float(per_request),
                      "per_expert_s": float(np.median([e["b_s"] for e in es])), "layers": layers,
                      "scope": "whole step but the scheduler" if "other_s" in es[0] else "MoE layers only"}
    return out


def main_gpu(args, out: Path) -> int:
    """--device cuda (or --dry-run on a CPU): SGLang's fused MoE kernel, or the torch fallback."""
    args.batches = args.batches or ",".join(map(str, BATCHES))
    try:
        import torch
    except ImportError:
        raise SystemExit("torch is not installed (pip install -e '.[sglang]' brings it)") from None
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    if not batches or min(batches) < 1:
        raise SystemExit("--batches must be positive integers")
    shapes = _gpu_shapes(args)
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
    _log(f"calibrating on {hw} ({device}); kernel: {'sglang fused_experts_impl' if kernel else 'torch grouped GEMM (' + str(why) + ')'}")
    rng = np.random.default_rng(0)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    entries = []
    for s in shapes:
        entries += measure_shape(torch, s, batches, args.points, device, dtype, kernel, args.warmup, args.reps, rng, deadline, _log)
        for e in entries:
            e.setdefault("hardware", hw)
    doc = {"format": FORMAT, "hardware": hw, "device": device, "torch": torch.__version__,
           "sglang_kernel": kernel is not None, "fallback_reason": None if kernel else why,
           "dry_run": args.dry_run, "seconds": round(time.monotonic() - t0, 1), "entries": entries,
           "step_terms": step_terms(entries, 1)}
    _write(out, doc, args.json)
    print("| model | B | a (us) | b (us/expert) | fit rel. RMS | kernel |")
    print("|---|---|---|---|---|---|")
    for e in entries:
        print(f"| {e['model']} | {e['batch']} | {e['a_s'] * 1e6:.2f} | {e['b_s'] * 1e6:.3f} | {e['fit_rel_rms']:.1%} | {e['kernel']} |")
    _log(f"wrote {out} ({len(entries)} entries, {doc['seconds']:.0f} s)")
    return 0


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def _write(out: Path, doc: dict, also: str | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out)
    if also:
        Path(also).write_text(json.dumps(doc, indent=1))


def main_cpu(args, argv) -> int:
    """--device cpu: one torch thread, SGLang's moe_forward_native (or the torch reference)."""
    if args.dry_run or args.models:
        raise SystemExit("--device cpu takes its shape from --model-dir (or --tiny); drop --dry-run / --models")
    if args.model_dir and args.tiny:
        raise SystemExit("give --model-dir or --tiny, not both")
    if args.context < 1:
        raise SystemExit("--context must be at least 1 token")
    try:
        batches = [int(x) for x in (args.batches or ",".join(map(str, CPU_BATCHES))).split(",") if x.strip()]
    except ValueError:
        raise SystemExit("--batches must be a comma list of positive integers") from None
    if not batches or min(batches) < 1:
        raise SystemExit("--batches must be positive integers")
    try:
        shape = cpu_shape_from_model_dir(args.model_dir) if args.model_dir else (CPU_TINY if args.tiny else CPU_DEFAULT)
    except ValueError as exc:
        raise SystemExit(f"--model-dir: {exc}") from None
    kernel = sglang_cpu_moe(argv, _log) if args.moe_kernel == "sglang" else None
    try:
        import torch
    except ImportError:
        raise SystemExit("torch is not installed (pip install -e '.[sglang]' brings it)") from None
    torch.set_num_threads(1)  # the decode servers run with OMP_NUM_THREADS=1, one core each
    hw = args.hardware or cpu_label()
    if "cpu" not in hw.lower():
        hw = f"cpu: {hw}"  # `eldr simulate --hardware cpu` selects entries by this label
    _log(f"calibrating on {hw}; shape {asdict(shape)}; MoE kernel "
         f"{'sglang moe_forward_native' if kernel else 'torch grouped GEMM (reference)'}")
    t0 = time.monotonic()
    entries = measure_cpu(torch, shape, batches, args.points, args.context, kernel, args.warmup, args.reps,
                          np.random.default_rng(0), t0 + args.budget_s, _log)
    for e in entries:
        e["hardware"] = hw
    doc = {"format": FORMAT, "hardware": hw, "device": "cpu", "torch": torch.__version__, "threads": 1,
           "sglang_kernel": kernel is not None, "fallback_reason": None if kernel else "--moe-kernel torch",
           "dry_run": False, "shape": asdict(shape), "context_tokens": args.context,
           "seconds": round(time.monotonic() - t0, 1), "entries": entries,
           "step_terms": step_terms(entries, shape.layers)}
    _write(Path(args.out), doc, args.json)
    print("| model | B | a (us) | b (us/expert) | other (ms) | fit rel. RMS | kernel |")
    print("|---|---|---|---|---|---|---|")
    for e in entries:
        print(f"| {e['model']} | {e['batch']} | {e['a_s'] * 1e6:.1f} | {e['b_s'] * 1e6:.1f} | {e['other_s'] * 1e3:.3f} | "
              f"{e['fit_rel_rms']:.1%} | {e['kernel']} |")
    _log(f"wrote {args.out} ({len(entries)} entries, {doc['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
