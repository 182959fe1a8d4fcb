"""The ELDR PD router service: late-bound, expert-locality-aware decode routing.

Run it with `python -m eldr_sglang.launch_router --pd-disaggregation --disagg-router eldr ...`.
The request path and the routing state are the Rust data plane's (crate rust/dataplane, the
extension's `_core.DataPlane`); this package is the control plane. Modules: `config`
(command line), `dataplane` (the data plane's settings and drift feed), `control` (the
control plane: the core Router, reports into the data plane, hot reload, /eldr/status),
`loads` (background loops: /v1/loads polling, health checks, the signature probe, reload),
`app` (the control plane's aiohttp app and the runner), `passthrough` (/v1/models,
/server_info, /flush_cache), `admin` (control-endpoint access), `logsafe` (escaped,
rate-limited logging), `metrics` (Prometheus).
"""
