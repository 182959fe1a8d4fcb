"""Which Kubernetes pods are workers, and what each one's worker is: smg's rules
(model_gateway/src/service_discovery.rs), read and restated, not copied.

- A pod belongs to a role when its labels hold every key=value of that role's selector
  (--prefill-selector, --decode-selector), and of --selector when it is given. A pod that
  matches both role selectors is a prefill worker (smg's order).
- It counts only while it is Ready (its Ready condition "True"), Running (phase), has a pod IP
  and has no deletionTimestamp (a pod being deleted is dropped at once).
- Its URL is http://POD_IP:--service-discovery-port.
- A prefill pod's bootstrap port is its `sglang.ai/bootstrap-port` annotation. Without it, or
  with a value that is not a port, smg adds the worker with no bootstrap port (not skipped, no
  default port); so does this router (as `--prefill URL none`), and it says so in one log line
  per pod.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_KEY = re.compile(rf"({_PREFIX}/)?{_NAME}")
_VALUE = re.compile(rf"({_NAME})?")


def parse_selector(items: list[str] | None, flag: str) -> dict[str, str]:
    """`key=value` words (smg's format: --prefill-selector app=sglang role=prefill) as a dict;
    ValueError saying which word is wrong. Kubernetes label syntax: a key is an optional DNS
    prefix and '/', then a name of at most 63 characters; a value at most 63, may be empty."""
    out: dict[str, str] = {}
    for word in items or []:
        for part in word.split(","):  # 'a=b,c=d' too, as kubectl writes a selector
            key, eq, value = part.strip().partition("=")
            if not eq or not key:
                raise ValueError(f"{flag}: expected key=value, got {part!r}")
            if value.startswith("="):  # kubectl's 'key==value'
                value = value[1:]
            if not _KEY.fullmatch(key) or len(key.partition("/")[0]) > 253:
                raise ValueError(f"{flag}: {key!r} is not a Kubernetes label key")
            if not _VALUE.fullmatch(value):
                raise ValueError(f"{flag}: {value!r} (for {key}) is not a Kubernetes label value")
            if key in out and out[key] != value:
                raise ValueError(f"{flag}: {key} is given twice with different values")
            out[key] = value
    return out


def selector_text(sel: dict[str, str]) -> str:
    """The API server's labelSelector parameter: k1=v1,k2=v2."""
    return ",".join(f"{k}={v}" for k, v in sorted(sel.items()))


def matches(labels: dict[str, str], sel: dict[str, str]) -> bool:
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


@dataclass(frozen=True)
class Pod:
    """What discovery reads of one pod object."""
    namespace: str
    name: str
    ip: str | None
    phase: str | None
    ready: bool
    deleting: bool
    labels: dict = field(default_factory=dict, compare=False, hash=False)
    bootstrap: str | None = None  # the annotation's text, as given

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def counts(self) -> bool:
        """Ready, Running, with an IP and not being deleted."""
        return self.ready and self.phase == "Running" and bool(self.ip) and not self.deleting

    def url(self, port: int) -> str:
        host = f"[{self.ip}]" if self.ip and ":" in self.ip else self.ip
        return f"http://{host}:{port}"

    def bootstrap_port(self) -> int | None:
        """The annotation as a port, or None (missing or not a port 1-65535)."""
        text = (self.bootstrap or "").strip()
        if not text.isdigit():
            return None
        port = int(text)
        return port if 0 < port < 65536 else None


def _str_dict(v: object) -> dict[str, str]:
    return {k: x for k, x in v.items() if isinstance(k, str) and isinstance(x, str)} if isinstance(v, dict) else {}


def pod_from(obj: object) -> Pod | None:
    """A pod object of the API (v1 Pod) as a Pod; None when it is not one (no metadata.name)."""
    if not isinstance(obj, dict):
        return None
    md = obj.get("metadata")
    if not isinstance(md, dict) or not isinstance(md.get("name"), str) or not md["name"]:
        return None
    status = obj.get("status") if isinstance(obj.get("status"), dict) else {}
    conds = status.get("conditions") if isinstance(status.get("conditions"), list) else []
    ready = any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
    ip, phase = status.get("podIP"), status.get("phase")
    ns = md.get("namespace")
    return Pod(
        namespace=ns if isinstance(ns, str) else "", name=md["name"],
        ip=ip if isinstance(ip, str) and ip else None, phase=phase if isinstance(phase, str) else None,
        ready=ready, deleting=md.get("deletionTimestamp") is not None, labels=_str_dict(md.get("labels")),
        bootstrap=_str_dict(md.get("annotations")).get(BOOTSTRAP_ANNOTATION),
    )
