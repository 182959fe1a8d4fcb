"""The ELDR PD router service (aiohttp): late-bound, expert-locality-aware decode routing.

Run it with `python -m eldr_sglang.launch_router --pd-disaggregation --disagg-router eldr ...`.
Modules: `config` (command line), `pd` (the per-request flow), `outlier` (per-worker
availability: health plus outlier ejection), `loads` (background loops: /v1/loads blending,
health checks, centroid hot reload), `admin` (control-endpoint access), `logsafe` (escaped,
rate-limited logging), `metrics` (Prometheus), `app`.
"""
