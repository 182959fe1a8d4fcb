"""Access to the router's mutating control endpoints (POST /eldr/refit, POST /flush_cache,
POST /eldr/experiment/switch, POST and DELETE /eldr/workers).

They are off unless the operator sets a token (--admin-token or $ELDR_ADMIN_TOKEN), as the
SGLang gateway's API key; a request then needs `Authorization: Bearer TOKEN`, compared in
constant time."""

from __future__ import annotations

import hmac

from aiohttp import web

from eldr_sglang.router.config import ADMIN_TOKEN_ENV


def denied(request: web.Request, token: str | None) -> web.Response | None:
    """None when the request may use a control endpoint, else the answer to send."""
    if token is None:
        return web.json_response({"error": {"message": f"{request.path} is off: start the router with --admin-token "
                                            f"or ${ADMIN_TOKEN_ENV} to enable control endpoints"}}, status=403)
    got = request.headers.get("Authorization", "")
    scheme, _, value = got.partition(" ")
    try:
        # aiohttp reads header bytes that are not UTF-8 as lone surrogates: back to those bytes
        sent = value.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        sent = b""
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, token.encode()):
        return web.json_response({"error": {"message": "control endpoint: missing or wrong bearer token"}}, status=401,
                                 headers={"WWW-Authenticate": "Bearer"})
    return None


def guarded(handler, token: str | None):
    async def wrapped(request: web.Request):
        refusal = denied(request, token)
        return refusal if refusal is not None else await handler(request)

    return wrapped
