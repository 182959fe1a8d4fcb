"""POST /eldr/workers and DELETE /eldr/workers: the admin overlay of the membership
(MembershipHook.admin_add / admin_remove), control endpoints guarded by the admin token as
/eldr/refit is (eldr_sglang.router.admin).

Body: {"role": "prefill" | "decode", "url": "http://host:port", "bootstrap_port": int (prefill
only, optional)}. A POSTed worker joins beside the other sources' workers; a DELETEd one is left
out whatever source lists it, until it is POSTed again. The answer comes once the data plane
serves the change (or after APPLY_WAIT_S): 200 with the worker's slot and state; 400 for bad
input (one message), 404 for a DELETE of a worker the router does not have, 409 for a DELETE
of a role's last worker or a change the data plane refused (a full role).
"""

from __future__ import annotations


from aiohttp import web

from eldr_sglang.router.discovery.hook import LastWorkerError, NotAMemberError
from eldr_sglang.router.discovery.membership import MembershipError, worker_key

APPLY_WAIT_S = 5.0
BODY = 'the body must be a JSON object {"role": "prefill" | "decode", "url": "http://host:port", "bootstrap_port": int?}'


def _error(msg: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": msg}}, status=status)


async def _body(request: web.Request, allowed: set[str]) -> dict:
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        raise MembershipError(BODY) from None
    if not isinstance(body, dict) or "role" not in body or "url" not in body:
        raise MembershipError(BODY)
    extra = sorted(set(body) - allowed)
    if extra:
        raise MembershipError(f"unknown key {extra[0]!r} ({BODY})")
    return body


def add_worker_routes(app: web.Application, pd, applier, admin_token: str | None) -> None:
    from eldr_sglang.router.admin import guarded

    hook = applier.hook

    async def settled(role: str, url: str, want_member: bool) -> web.Response:
        await applier.settle(APPLY_WAIT_S)
        key = worker_key(url)
        slots = [s for s, u in pd.members(role) if worker_key(u) == key]
        if bool(slots) != want_member:
            why = hook.last_apply_error or f"not applied within {APPLY_WAIT_S:g} s"
            return _error(f"{role} worker {url}: {why}", 409)
        state = {"role": role, "url": url, "member": want_member, "slot": slots[0] if slots else None}
        return web.json_response({**state, "members": {r: [u for _, u in pd.members(r)] for r in ("prefill", "decode")}})

    async def post(request: web.Request) -> web.Response:
        try:
            body = await _body(request, {"role", "url", "bootstrap_port"})
            hook.admin_add(body["role"], body["url"], body.get("bootstrap_port"))
        except MembershipError as exc:
            return _error(str(exc), 400)
        return await settled(body["role"], body["url"], True)

    async def delete(request: web.Request) -> web.Response:
        try:
            body = await _body(request, {"role", "url"})
            hook.admin_remove(body["role"], body["url"])
        except NotAMemberError as exc:
            return _error(str(exc), 404)
        except LastWorkerError as exc:
            return _error(str(exc), 409)
        except MembershipError as exc:
            return _error(str(exc), 400)
        return await settled(body["role"], body["url"], False)

    app.router.add_post("/eldr/workers", guarded(post, admin_token))
    app.router.add_delete("/eldr/workers", guarded(delete, admin_token))


