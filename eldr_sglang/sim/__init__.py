"""PD decode simulator (Vidur-style: workload, schedulers and execution-time model apart).

The model catalogue is eldr_sglang.models and the workload eldr_sglang.workload (shared with
the synthetic traces).

- profiles.py   hardware constants from public specs (HARDWARE_PROFILES)
- cost_model.py execution-time model (ExecutionModel: decode_step_time, prefill_time)
- replay.py     trace replay: prefill signatures, decode-token routing per request (TraceReplay)
- policies.py   the Rust Router's policies, plus a label oracle for reference (make_policy)
- prefill.py    the prefill scheduler: placement as the router service does it (PrefillScheduler)
- decode.py     each decode worker's batching scheduler (Replica) and step timing (DecodeStep)
- cluster.py    the discrete-event loop that moves requests between them (simulate)
- metrics.py    TPOT/TTFT/ITL/throughput/experts per step (compute_metrics)
- report.py     table, JSON and plots
- runner.py     several policies over one workload (run_comparison)
- protocol.py   the strict study protocol (splits, orders, loops, bounds; run_protocol)
"""
