"""The router's workers as one value: which prefill workers (URL and bootstrap port) and which
decode workers (URL) it should route to. Every discovery source produces one; the hook unions
them and diffs the result against what the data plane serves.

The URL rules are the command line's (config.py): plain http:// with a host, a trailing slash
dropped, and two URLs that name the same host, port and path are the same worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse


class MembershipError(ValueError):
    """An invalid membership; the message is one line saying what and where."""


@dataclass(frozen=True)
class PrefillSpec:
    url: str
    bootstrap_port: int | None = None


def worker_key(url: str) -> tuple:
    """What makes two worker URLs the same worker: host (case-insensitive), port (80 when
    none is given) and path, whatever the trailing slash."""
    p = urlparse(url)
    try:
        port = p.port or 80
    except ValueError:
        port = p.netloc
    return (p.scheme.lower(), (p.hostname or "").lower(), port, p.path.rstrip("/"))


def check_url(url: object, where: str) -> str:
    """A worker URL as the router takes it (trailing slash dropped), or MembershipError."""
    if not isinstance(url, str) or not url:
        raise MembershipError(f"{where}: the url must be a non-empty string, got {url!r}")
    p = urlparse(url)
    if p.scheme != "http" or not p.hostname:
        raise MembershipError(f"{where}: {url!r} is not a URL like http://host:port (the router speaks plain http:// "
                              "to workers)")
    try:
        p.port
    except ValueError:
        raise MembershipError(f"{where}: {url!r} has a port out of range") from None
    if p.query or p.fragment or any(c.isspace() for c in url):
        raise MembershipError(f"{where}: {url!r} holds a query, a fragment or a space")
    return url.rstrip("/")


def check_bootstrap_port(port: object, where: str) -> int | None:
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise MembershipError(f"{where}: bootstrap_port must be an integer 1-65535 or null, got {port!r}")
    return port


@dataclass(frozen=True)
class Membership:
    """Prefill and decode workers, in the order their source gave them."""
    prefill: tuple[PrefillSpec, ...] = ()
    decode: tuple[str, ...] = ()

    def check(self, source: str, need_prefill: bool = True, need_decode: bool = True) -> "Membership":
        """This membership with its URLs normalised, or MembershipError: a bad URL or port, a
        worker given twice in one role, one in both roles, or an empty role that is needed."""
        prefill = tuple(PrefillSpec(check_url(w.url, f"{source}: prefill[{i}]"),
                                    check_bootstrap_port(w.bootstrap_port, f"{source}: prefill[{i}] {w.url}"))
                        for i, w in enumerate(self.prefill))
        decode = tuple(check_url(u, f"{source}: decode[{i}]") for i, u in enumerate(self.decode))
        roles: dict[tuple, str] = {}
        for role, urls in (("prefill", [w.url for w in prefill]), ("decode", list(decode))):
            seen: dict[tuple, str] = {}
            for url in urls:
                key = worker_key(url)
                if key in seen:
                    same = f"{url!r} twice" if seen[key] == url else f"{seen[key]!r} and {url!r} (the same worker)"
                    raise MembershipError(f"{source}: {role} lists {same}: each worker once")
                if key in roles:
                    raise MembershipError(f"{source}: {url!r} is both a prefill and a decode worker")
                seen[key] = url
            roles.update({k: role for k in seen})
        if need_decode and not decode:
            raise MembershipError(f"{source}: the decode list is empty (the router needs at least one decode worker)")
        if need_prefill and not prefill:
            raise MembershipError(f"{source}: the prefill list is empty (the router needs at least one prefill worker)")
        return Membership(prefill, decode)

    def to_json(self) -> dict:
        return {"prefill": [{"url": w.url, "bootstrap_port": w.bootstrap_port} for w in self.prefill],
                "decode": [{"url": u} for u in self.decode]}

    def union(self, other: "Membership", conflicts: list[str] | None = None) -> "Membership":
        """This membership plus `other`'s workers that it does not hold. A worker in both keeps
        this one's entry (its bootstrap port); each such difference is noted in `conflicts`.
        A worker that is prefill in one and decode in the other is kept in this one's role."""
        mine = {worker_key(w.url): ("prefill", w.bootstrap_port) for w in self.prefill}
        mine.update({worker_key(u): ("decode", None) for u in self.decode})
        prefill, decode = list(self.prefill), list(self.decode)
        for w in other.prefill:
            have = mine.get(worker_key(w.url))
            if have is None:
                prefill.append(w)
                mine[worker_key(w.url)] = ("prefill", w.bootstrap_port)
            elif conflicts is not None and have != ("prefill", w.bootstrap_port):
                conflicts.append(f"{w.url} (prefill, bootstrap port {w.bootstrap_port}) is already {have[0]}"
                                 + (f" with bootstrap port {have[1]}" if have[0] == "prefill" else ""))
        for u in other.decode:
            have = mine.get(worker_key(u))
            if have is None:
                decode.append(u)
                mine[worker_key(u)] = ("decode", None)
            elif conflicts is not None and have[0] != "decode":
                conflicts.append(f"{u} (decode) is already prefill")
        return Membership(tuple(prefill), tuple(decode))


@dataclass
class MembershipDiff:
    """What changes from one membership to the next, per role (URLs; a prefill worker whose
    bootstrap port changed is removed and added)."""
    added_prefill: list[PrefillSpec] = field(default_factory=list)
    removed_prefill: list[PrefillSpec] = field(default_factory=list)
    added_decode: list[str] = field(default_factory=list)
    removed_decode: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.added_prefill or self.removed_prefill or self.added_decode or self.removed_decode)

    def describe(self) -> str:
        parts = [f"+prefill {w.url}" for w in self.added_prefill] + [f"-prefill {w.url}" for w in self.removed_prefill]
        parts += [f"+decode {u}" for u in self.added_decode] + [f"-decode {u}" for u in self.removed_decode]
        return ", ".join(parts) or "no change"

    def to_json(self) -> dict:
        return {"added_prefill": [w.url for w in self.added_prefill],
                "removed_prefill": [w.url for w in self.removed_prefill],
                "added_decode": list(self.added_decode), "removed_decode": list(self.removed_decode)}


def diff(old: Membership, new: Membership) -> MembershipDiff:
    old_p = {(worker_key(w.url), w.bootstrap_port): w for w in old.prefill}
    new_p = {(worker_key(w.url), w.bootstrap_port): w for w in new.prefill}
    old_d = {worker_key(u): u for u in old.decode}
    new_d = {worker_key(u): u for u in new.decode}
    return MembershipDiff(
        added_prefill=[w for k, w in new_p.items() if k not in old_p],
        removed_prefill=[w for k, w in old_p.items() if k not in new_p],
        added_decode=[u for k, u in new_d.items() if k not in old_d],
        removed_decode=[u for k, u in old_d.items() if k not in new_d],
    )


def same_workers(a: Membership, b: Membership) -> bool:
    """The same workers in each role, whatever their order."""
    return diff(a, b).empty


def from_json(obj: object, source: str, need_prefill: bool = True) -> Membership:
    """A workers-file document, {"prefill": [{"url", "bootstrap_port"}], "decode": [{"url"}]},
    as a checked Membership; MembershipError names the first thing wrong. Unknown keys are
    refused (a misspelt "bootstrap-port" would otherwise be silently dropped)."""
    if not isinstance(obj, dict):
        raise MembershipError(f"{source}: expected a JSON object with \"prefill\" and \"decode\" lists")
    extra = sorted(set(obj) - {"prefill", "decode"})
    if extra:
        raise MembershipError(f"{source}: unknown key {extra[0]!r} (expected \"prefill\" and \"decode\")")
    prefill, decode = [], []
    for role, out, allowed in (("prefill", prefill, {"url", "bootstrap_port"}), ("decode", decode, {"url"})):
        items = obj.get(role, [])
        if not isinstance(items, list):
            raise MembershipError(f"{source}: \"{role}\" must be a list")
        for i, item in enumerate(items):
            if not isinstance(item, dict) or "url" not in item:
                raise MembershipError(f"{source}: {role}[{i}] must be an object with a \"url\"")
            bad = sorted(set(item) - allowed)
            if bad:
                raise MembershipError(f"{source}: {role}[{i}] has an unknown key {bad[0]!r} (allowed: {', '.join(sorted(allowed))})")
            out.append(PrefillSpec(item["url"], item.get("bootstrap_port")) if role == "prefill" else item["url"])
    if "decode" not in obj:
        raise MembershipError(f"{source}: no \"decode\" list")
    return Membership(tuple(prefill), tuple(decode)).check(source, need_prefill=need_prefill)
