"""Where the router's workers come from besides --prefill/--decode (issue 31): a watched
workers file and Kubernetes pod discovery with smg's flags. The sources produce a
`Membership` (membership.py); the hook (hook.py) unions them with the command line's workers
and the admin overlay and hands each change to an `apply` callback. Modules: `membership`
(the value, its checks and diff), `workers_file` (--workers-file), `pods` (label selectors and
which pods count), `kube` (LIST + WATCH against the API server), `flags` (the command line),
`hook` (the sources together, the startup membership, /eldr/status), `apply` (the change applied
to the running data plane), `endpoints` (POST/DELETE /eldr/workers). See README.md here and
docs/discovery.md.

This package imports nothing at its top so that `config` can read `flags` without a loop.
"""
