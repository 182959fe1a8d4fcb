"""PD decode simulator (Vidur-style: workload, scheduler and execution-time model apart).

- profiles.py   model and hardware constants from public specs (MODEL_PROFILES, HARDWARE_PROFILES)
- cost_model.py execution-time model (ExecutionModel: decode_step_time, prefill_time)
- replay.py     trace replay: prefill signatures, decode-token routing per request (TraceReplay)
- workload.py   arrivals: trace, Poisson, bursty, closed loop (make_workload)
- policies.py   the Rust Router's policies, plus a label oracle for reference (make_policy)
- cluster.py    discrete-event PD cluster (simulate)
- metrics.py    TPOT/TTFT/ITL/throughput/experts per step (compute_metrics)
- report.py     table, JSON and plots
- runner.py     several policies over one workload (run_comparison)
- protocol.py   the strict study protocol (splits, orders, loops, bounds; run_protocol)
"""
