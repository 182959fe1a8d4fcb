"""The router's own switchback on one long-lived real SGLang cluster on this CPU: the data the
simulator is checked against (benchmarks/sim_vs_engine.py reads what this keeps).

    python benchmarks/real_cpu_switchback.py --keep WORK [--minutes 25] [--control-minutes 12] [--bind late]

Per setting (the two-domain locality model, then the uniform control; both CONSTRUCTED models,
eldr_sglang/testing/sglang_cpu/locality_model.py, with 2 domains so that 2 decode workers can
hold domain-pure batches):
1. a reference server (non-PD, --enable-return-routed-experts) records the calibration trace
   with `eldr collect` (decode routing kept), and `eldr fit --workers 2` fits the centroids;
2. one patched prefill (--enable-eldr-signature --enable-eldr-late-binding, at nice 10) and two
   decode servers, each pinned to its own core, each writing its MoE step log (the CPU shim's
   step_log: every decode step's batch and the distinct experts per layer it touched, counted
   inside the engine);
3. ONE router for the whole run with `--experiment ARMS --switch-every BLOCK`: the router
   switches the cluster's decode policy per block itself, in balanced seeded rounds, and flags
   the requests that start while another arm's are still decoding (warm-up);
4. a closed loop of `--concurrency` streaming clients (domain picked at random per request,
   `--input-len` prompt tokens, `--output-len` output tokens, EOS ignored) for the run.
At the end it saves the router's per-block figures (GET /eldr/experiment), the step logs, the
trace, the centroids, the model directory and the clock offset that maps the step logs'
perf_counter onto the blocks' unix times. Nothing is analysed here: `sim_vs_engine.py` does.

Time is measured on 2 cores: the decodes own one core each; the prefill (at nice 10), the
router and the client share them. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from eldr_sglang import _core
from eldr_sglang.testing.sglang_cpu import locality_model as lm
from eldr_sglang.testing.sglang_cpu.cluster import wait_ready
from eldr_sglang.testing.sglang_cpu.harness import Harness

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_cpu_tpot  # noqa: E402  (the same collect and fit as the per-run benchmark)

REPO = Path(__file__).resolve().parent.parent
MAIN_ARMS = "round_robin,eldr/none,locality/0.05"
CONTROL_ARMS = "round_robin,locality/0.05"


def collect_and_fit(h: Harness, model: Path, geo, work: Path, a, rng) -> tuple[Path, Path]:
    """The calibration trace from a reference server, and 2 centroids fitted on it."""
    ref = h.start(f"reference-{work.name}", model, ["--enable-return-routed-experts", "--random-seed", "0"], cpus={0})
    try:
        wait_ready([ref], 900)
        trace = real_cpu_tpot.collect_trace(ref, geo, work, a, rng)
    finally:
        h.stop([ref])
    return trace, real_cpu_tpot.fit_centroids(trace, work)


async def _closed_loop(url: str, geo, a, seconds: float, seed: int) -> dict:
    """`concurrency` clients, each sending its next streamed request as soon as the last ended."""
    import aiohttp

    rng = np.random.default_rng(seed)
    D = geo.spec["domains"]
    done = {"ok": 0, "failed": 0, "errors": {}}
    end = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=600)

    async def client(session):
        while time.monotonic() < end:
            body = {"text": lm.domain_prompt(geo, int(rng.integers(D)), a.input_len, rng), "stream": True,
                    "sampling_params": {"max_new_tokens": a.output_len, "temperature": 0.0, "ignore_eos": True}}
            try:
                async with session.post(url + "/generate", json=body) as r:
                    async for _ in r.content.iter_any():
                        pass
                    ok = r.status == 200
                    why = f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                ok, why = False, type(exc).__name__
            done["ok" if ok else "failed"] += 1
            if not ok:
                done["errors"][why] = done["errors"].get(why, 0) + 1

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(a.concurrency)))
    return done


def _get_json(url: str, timeout: float = 60) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def run_setting(h: Harness, a, name: str, locality: float, arms: str, minutes: float, log) -> dict:
    t0 = time.monotonic()
    work = h.workdir / name
    work.mkdir(parents=True, exist_ok=True)
    model = h.locality_model(locality, seed=a.seed, domains=2)
    geo = lm.load_geometry(model)
    rng = np.random.default_rng(a.seed)
    trace, centroids = collect_and_fit(h, model, geo, work, a, rng)
    log(f"== {name}: model built, {a.calibration_prompts} prompts collected, centroids fitted "
        f"({time.monotonic() - t0:.0f} s)")
    prefill, boot, decodes = h.start_pd(model, 2, prefill_extra=["--enable-eldr-signature", "--enable-eldr-late-binding"],
                                        decode_step_log=True, decode_cpus=[{0}, {1}], prefix=f"{name}-",
                                        prefill_nice=a.prefill_nice, prefill_step_log=True)
    try:
        wait_ready([prefill, *decodes], 900)
        warm = h.start_router(f"{name}-warmup-router", [(prefill.url, boot)], [d.url for d in decodes],
                              ["--disagg-router", "round_robin", "--log-level", "warning"])
        try:
            wait_ready([warm], 120)
            # a fresh cluster's first requests pay one-off costs (lazy init, first KV transfers)
            asyncio.run(_closed_loop(warm.url, geo, a, 20, a.seed + 7))
        finally:
            h.stop([warm])
        router = h.start_router(f"{name}-router", [(prefill.url, boot)], [d.url for d in decodes],
                                ["--experiment", arms, "--switch-every", f"{a.block_s:g}s", "--experiment-seed",
                                 str(a.seed), "--eldr-centroids", str(centroids), "--request-timeout-secs", "600",
                                 "--eldr-signature-timeout-secs", "60", "--eldr-bind", a.bind, "--log-level", "warning"])
        try:
            wait_ready([router], 120)
            offset = time.time() - time.perf_counter()  # unix = perf_counter + offset (CLOCK_MONOTONIC)
            log(f"   cluster up, experiment {arms}, blocks of {a.block_s:g} s for {minutes:g} min "
                f"({time.monotonic() - t0:.0f} s)")
            clients = asyncio.run(_closed_loop(router.url, geo, a, minutes * 60, a.seed + 11))
            time.sleep(a.output_len * 0.5)  # let the last block's requests end so it completes
            blocks = _get_json(router.url + "/eldr/experiment")
            offset2 = time.time() - time.perf_counter()
        finally:
            h.stop([router])
    finally:
        h.stop([prefill, *decodes])
    logs = []
    if h.step_log(prefill.name).exists():  # the prefill's forwards, for the prefill-time check
        shutil.copyfile(h.step_log(prefill.name), work / f"{prefill.name}.steps")
    for d in decodes:
        dst = work / f"{d.name}.steps"
        shutil.copyfile(h.step_log(d.name), dst)
        logs.append(str(dst))
    (work / "experiment.json").write_text(json.dumps(blocks))
    log(f"   {clients['ok']} requests, {clients['failed']} failed {clients['errors']} "
        f"({time.monotonic() - t0:.0f} s)")
    return {"name": name, "locality": locality, "domains": 2, "arms": arms.split(","), "block_s": a.block_s,
            "minutes": minutes, "concurrency": a.concurrency, "input_len": a.input_len, "output_len": a.output_len,
            "clients": clients, "clock_offset_s": offset, "clock_offset_end_s": offset2,
            "experiment": str(work / "experiment.json"), "step_logs": logs,
            "prefill_step_log": str(work / f"{prefill.name}.steps"), "layers": geo.spec["layers"],
            "trace": str(trace), "centroids": str(centroids), "model_dir": str(model),
            "prefill_nice": a.prefill_nice, "bind": a.bind, "seconds": round(time.monotonic() - t0),
            "request_cost": _core.DEFAULT_REQUEST_COST}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", required=True, metavar="DIR", help="work directory (kept: sim_vs_engine.py reads it)")
    ap.add_argument("--locality", type=float, default=0.95, help="the two-domain model's locality knob (default 0.95)")
    ap.add_argument("--arms", default=MAIN_ARMS, help=f"experiment arms on the locality model (default {MAIN_ARMS})")
    ap.add_argument("--control-arms", default=CONTROL_ARMS, help=f"arms on the uniform control (default {CONTROL_ARMS})")
    ap.add_argument("--minutes", type=float, default=25, help="length of the locality model's run (0: skip; default 25)")
    ap.add_argument("--control-minutes", type=float, default=12, help="length of the control's run (0: skip; default 12)")
    ap.add_argument("--bind", choices=("auto", "late", "early"), default="auto",
                    help="the router's --eldr-bind (default auto: each arm binds as it would alone, late for eldr and "
                         "locality, early for the balancers; late: every arm binds late)")
    ap.add_argument("--block-s", type=float, default=10, help="switchback block length, seconds (default 10)")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop streaming clients (default 8)")
    ap.add_argument("--input-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--calibration-prompts", type=int, default=64)
    ap.add_argument("--prefill-nice", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main() -> int:
    a = _parser().parse_args()
    if a.concurrency < 1 or a.block_s <= 0 or a.minutes < 0 or a.control_minutes < 0 or not (a.minutes or a.control_minutes):
        print("error: need --concurrency >= 1, --block-s > 0, --minutes and --control-minutes >= 0, one of them > 0",
              file=sys.stderr)
        return 2
    work = Path(a.keep)
    if (work / "run.json").exists():
        print(f"error: {work}/run.json exists; choose another --keep (nothing is overwritten)", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)

    h = Harness(work)
    settings = []
    try:
        if a.minutes:
            settings.append(run_setting(h, a, "locality", a.locality, a.arms, a.minutes, log))
            (work / "run.json").write_text(json.dumps({"settings": settings}, indent=1))
        if a.control_minutes:
            settings.append(run_setting(h, a, "control", 0.0, a.control_arms, a.control_minutes, log))
    finally:
        h.close()
        if settings:
            (work / "run.json").write_text(json.dumps({"settings": settings, "machine_cores": 2}, indent=1))
    log(f"wrote {work / 'run.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
