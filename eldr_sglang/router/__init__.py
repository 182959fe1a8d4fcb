"""The ELDR PD router service (aiohttp): late-bound, expert-locality-aware decode routing.

Run it with `python -m eldr_sglang.launch_router --pd-disaggregation --disagg-router eldr ...`.
Modules: `config` (command line), `pd` (the per-request flow), `loads` (background loops:
/v1/loads blending, health checks, centroid hot reload), `metrics` (Prometheus), `app`.
"""
