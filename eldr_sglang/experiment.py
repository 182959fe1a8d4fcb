"""Switchback analysis: is one decode policy's TPOT lower than another's on the same cluster?

Two policies sharing a cluster at the same time share its decode batches, so splitting the
traffic between them contaminates both. A switchback runs the whole cluster on one arm per
time block, in a seeded random order, and compares blocks. Within a block the requests are
not independent (they share batches), so the unit of analysis is the block:

1. each block's requests that started in its warm-up (flagged `warmup`, or within
   `warmup_s` of the block's start: the previous arm's requests are still decoding) are
   dropped;
2. each block gives one statistic per arm-level question: its TPOT p50 and its TPOT mean;
3. the arms are compared on the log of those block statistics (Welch's t over blocks), so
   the answer is a ratio: `diff` = (arm 1 / arm 2) - 1, with its confidence interval
   (negative: arm 1 has the lower TPOT).

How long a run needs: with s the standard deviation of log block statistics within an arm,
detecting a relative change d with a two-sided test at level alpha and power 1 - beta needs
about n = 2 (z_{1-alpha/2} + z_{1-beta})^2 s^2 / log(1 + d)^2 blocks per arm
(`blocks_needed`).

Input (`load_records`): JSON Lines, or one JSON object with a "requests" or "blocks" list
(the router's GET /eldr/experiment is such an object: `fetch_records` reads it).
A request record: {"block": int, "arm": str, "tpot_s": seconds or null, "t_s": seconds since
its block started (optional), "warmup": bool (optional)}. A block record: {"block": int,
"arm": str, "tpot_p50_s": s or null, "tpot_mean_s": s or null, "n": requests (optional),
"warmup_n": warm-up requests left out (optional; "dropped" is read too), "complete": false
while the block or one of its requests is still running (optional)}.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STATS = ("p50", "mean")


@dataclass
class Block:
    block: int
    arm: str
    n: int
    p50: float
    mean: float
    dropped: int = 0  # warm-up requests left out


def _num(rec: dict, key: str, where: str, *, positive: bool = True, required: bool = True):
    v = rec.get(key)
    if v is None:
        if required:
            raise ValueError(f"{where}: {key!r} is missing")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{where}: {key!r} must be a {'positive ' if positive else ''}finite number, got {_shown(v)}")
    return float(v)


def _count(rec: dict, key: str, where: str) -> None:
    """`rec[key]`, when present, is a count: an integer >= 0 (an integral float is read too)."""
    v = rec.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())) or v < 0:
        raise ValueError(f"{where}: {key!r} must be an integer >= 0, got {_shown(v)}")


def _shown(v) -> str:
    """A value for a one-line message: its JSON, cut short."""
    try:
        text = json.dumps(v)
    except (ValueError, RecursionError):
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _block_key(rec: dict, where: str) -> tuple[int, str]:
    b, arm = rec.get("block"), rec.get("arm")
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
        raise ValueError(f"{where}: 'block' must be an integer >= 0, got {_shown(b)}")
    if not isinstance(arm, str) or not arm:
        raise ValueError(f"{where}: 'arm' must be a non-empty string, got {_shown(arm)}")
    return b, arm


def load_records(path: str | Path) -> tuple[str, list[dict]]:
    """("requests" | "blocks", records) from a JSON Lines file or a JSON object. Raises
    ValueError naming the line or field."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    return parse_records(text, str(path))


# GET /eldr/experiment answers at once; a router that does not is down or not this router.
FETCH_TIMEOUT_S = 10.0  # each connect or read
FETCH_DEADLINE_S = 60.0  # the whole answer, however slowly it arrives
# the router keeps at most 100 000 blocks (MAX_BLOCKS in rust/dataplane/src/experiment.rs),
# about 30 MB of JSON; an answer larger than this is not the router's
FETCH_MAX_BYTES = 64 << 20


def fetch_records(url: str, timeout: float = FETCH_TIMEOUT_S, deadline_s: float = FETCH_DEADLINE_S,
                  max_bytes: int = FETCH_MAX_BYTES) -> tuple[str, list[dict]]:
    """The block records of a running router's experiment (GET URL/eldr/experiment): each
    connect or read within `timeout`, the whole answer within `deadline_s` and at most
    `max_bytes` long (ValueError otherwise). Connects directly (no proxy)."""
    import http.client
    import time
    import urllib.parse

    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--url {url!r}: expected the router's base URL, like http://127.0.0.1:30000")
    try:
        urllib.parse.urlsplit(base).port
    except ValueError as exc:
        raise ValueError(f"--url {url!r}: {exc}") from None
    where = f"{base}/eldr/experiment"
    deadline = time.monotonic() + deadline_s
    try:
        status, body = _http_get(where, timeout, deadline, max_bytes)
    except TimeoutError:
        if time.monotonic() >= deadline:
            raise ValueError(f"{where}: no complete answer within {deadline_s:g} s") from None
        raise ValueError(f"{where}: timed out (nothing for {timeout:g} s)") from None
    except _TooLarge:
        raise ValueError(f"{where}: the answer is larger than {max_bytes / 1e6:.3g} MB: not the router's "
                         "experiment") from None
    except http.client.HTTPException as exc:
        raise ValueError(f"{where}: not an HTTP answer ({type(exc).__name__})") from None
    except OSError as exc:
        raise ValueError(f"{where}: {getattr(exc, 'strerror', None) or exc}") from None
    if status != 200:
        hint = " (is the router running with --experiment?)" if status == 404 else ""
        raise ValueError(f"{where}: HTTP {status}{hint}")
    return parse_records(body.decode("utf-8", "replace"), where)


class _TooLarge(Exception):
    pass


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each given at most `timeout` and what is left before `deadline`
    (time.monotonic()): a server that drips bytes cannot hold the reader past it."""

    def __init__(self, sock, timeout: float, deadline: float):
        self.sock, self.timeout, self.deadline = sock, timeout, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        import time

        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("past the deadline")
        self.sock.settimeout(min(self.timeout, left))
        return self.sock.recv_into(b)


class _DeadlineSocket:
    """A connected socket whose `makefile` (what http.client reads the answer through) is a
    _DeadlineReader. http.client closes the connection as soon as the head says it will close,
    before the body is read: `close` is left to _http_get."""

    def __init__(self, sock, timeout: float, deadline: float):
        self._sock, self._timeout, self._deadline = sock, timeout, deadline

    def makefile(self, mode: str, *args, **kwargs):
        return io.BufferedReader(_DeadlineReader(self._sock, self._timeout, self._deadline))

    def close(self) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def _http_get(url: str, timeout: float, deadline: float, max_bytes: int) -> tuple[int, bytes]:
    """(status, body) of GET url; the body only on 200, never more than `max_bytes` read."""
    import http.client
    import time
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = kind(u.hostname or "", u.port, timeout=max(0.001, min(timeout, deadline - time.monotonic())))
    sock = None
    try:
        conn.connect()
        sock = conn.sock
        conn.sock = _DeadlineSocket(sock, timeout, deadline)
        conn.request("GET", u.path or "/", headers={"Accept": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, b""
        length = r.getheader("Content-Length", "")
        if length.strip().isdigit() and int(length) > max_bytes:
            raise _TooLarge()
        chunks, got = [], 0
        while chunk := r.read1(1 << 16):
            got += len(chunk)
            if got > max_bytes:
                raise _TooLarge()
            chunks.append(chunk)
        if r.length:  # the server closed before its Content-Length
            raise http.client.IncompleteRead(b"".join(chunks), r.length)
        return r.status, b"".join(chunks)
    finally:
        conn.close()
        if sock is not None:
            sock.close()


def parse_records(text: str, path: str) -> tuple[str, list[dict]]:
    """`load_records` on text read from `path` (a file name or URL, for messages)."""
    records: list = []
    stripped = text.lstrip()
    whole = None
    if stripped.startswith("{"):
        try:
            whole = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            whole = None  # JSON Lines (or nested too deeply: said per line below)
    if isinstance(whole, dict) and ("requests" in whole or "blocks" in whole):
        key = "requests" if "requests" in whole else "blocks"
        records = whole[key]
        if not isinstance(records, list):
            raise ValueError(f"{path}: {key!r} must be a list")
        where = lambda i: f"{path}: {key}[{i}]"  # noqa: E731
    else:
        for no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {no} is not JSON ({exc.msg})") from None
            except RecursionError:
                raise ValueError(f"{path}: line {no} is nested too deeply") from None
        where = lambda i: f"{path}: record {i + 1}"  # noqa: E731
    if not records:
        raise ValueError(f"{path}: no records")
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"{where(i)}: expected a JSON object")
    kind = "blocks" if "tpot_p50_s" in records[0] else "requests"
    for i, r in enumerate(records):
        _block_key(r, where(i))
        if kind == "blocks":
            # null: a block without a TPOT yet (left out by blocks_from_records)
            _num(r, "tpot_p50_s", where(i), required=False)
            _num(r, "tpot_mean_s", where(i), required=False)
            for field in ("n", "warmup_n", "dropped"):
                _count(r, field, where(i))
        else:
            _num(r, "tpot_s", where(i), required=False)
            _num(r, "t_s", where(i), positive=False, required=False)
    return kind, records


def blocks_from_requests(records: list[dict], warmup_s: float = 0.0, min_requests: int = 1) -> tuple[list[Block], list[int]]:
    """Per-block statistics from request records: warm-up requests dropped, requests without a
    TPOT (one output token) skipped. Returns (blocks, blocks left out for having fewer than
    `min_requests` requests after the warm-up)."""
    by: dict[int, dict] = {}
    for r in records:
        b, arm = r["block"], r["arm"]
        e = by.setdefault(b, {"arm": arm, "tpot": [], "dropped": 0})
        if e["arm"] != arm:
            raise ValueError(f"block {b} holds requests of two arms ({e['arm']!r} and {arm!r}): a block runs one arm")
        warm = bool(r.get("warmup")) or (r.get("t_s") is not None and float(r["t_s"]) < warmup_s)
        if warm:
            e["dropped"] += 1
        elif r.get("tpot_s") is not None:
            e["tpot"].append(float(r["tpot_s"]))
    blocks, short = [], []
    for b in sorted(by):
        e = by[b]
        t = np.asarray(e["tpot"], dtype=np.float64)
        if t.size < max(1, min_requests):
            short.append(b)
            continue
        blocks.append(Block(b, e["arm"], int(t.size), float(np.median(t)), float(t.mean()), e["dropped"]))
    return blocks, short


def blocks_from_records(records: list[dict], min_requests: int = 1) -> tuple[list[Block], list[int]]:
    """Blocks from block records. Returns (blocks, blocks left out): those still running
    (`"complete": false`: a block's figures are final only once it and its last request have
    ended), without a TPOT, or with fewer than `min_requests` requests (when `n` is given)."""
    seen: dict[int, Block] = {}
    short: list[int] = []
    for r in records:
        if r["block"] in seen or r["block"] in short:
            raise ValueError(f"block {r['block']} is listed twice")
        n = r.get("n")
        if (r.get("complete") is False or r.get("tpot_p50_s") is None or r.get("tpot_mean_s") is None
                or (n is not None and int(n) < max(1, min_requests))):
            short.append(r["block"])
            continue
        warm = r.get("warmup_n", r.get("dropped"))
        seen[r["block"]] = Block(r["block"], r["arm"], int(n or 0), float(r["tpot_p50_s"]), float(r["tpot_mean_s"]),
                                 int(warm or 0))
    return [seen[k] for k in sorted(seen)], sorted(short)


def check_tpot(kind: str, records: list[dict]) -> None:
    """ValueError naming the cause when block records served requests but none holds a TPOT:
    the router measures TPOT on streamed requests only (a non-streamed answer arrives whole)."""
    if kind != "blocks" or any(r.get("tpot_p50_s") is not None for r in records):
        return
    served = sum(int(r.get("requests") or 0) for r in records if isinstance(r.get("requests"), int))
    if served:
        raise ValueError(f"no block holds a TPOT although the blocks served {served} requests: TPOT is measured on "
                         "streamed requests only (\"stream\": true), so compare streamed traffic")


def _t_ppf(q: float, df: float) -> float:
    from scipy import stats

    return float(stats.t.ppf(q, df))


def compare(blocks: list[Block], arms: tuple[str, str], stat: str = "p50", confidence: float = 0.95) -> dict:
    """Arm 1 vs arm 2 on a block statistic: the ratio of their geometric means over blocks,
    minus 1, with a Welch t confidence interval on the log scale."""
    if stat not in STATS:
        raise ValueError(f"stat must be one of {STATS}")
    a, b = arms
    xa = np.log([getattr(k, stat) for k in blocks if k.arm == a])
    xb = np.log([getattr(k, stat) for k in blocks if k.arm == b])
    for name, x in ((a, xa), (b, xb)):
        if x.size < 2:
            raise ValueError(f"arm {name!r} has {x.size} usable block(s): a confidence interval needs at least 2 per arm")
    va, vb = xa.var(ddof=1) / xa.size, xb.var(ddof=1) / xb.size
    d = float(xa.mean() - xb.mean())
    se = math.sqrt(va + vb)
    if se == 0:
        lo = hi = d
        df = float(xa.size + xb.size - 2)
    else:
        df = (va + vb) ** 2 / (va**2 / (xa.size - 1) + vb**2 / (xb.size - 1))
        h = _t_ppf(0.5 + confidence / 2, df) * se
        lo, hi = d - h, d + h
    sd = math.sqrt(((xa.size - 1) * xa.var(ddof=1) + (xb.size - 1) * xb.var(ddof=1)) / (xa.size + xb.size - 2))
    return {"stat": stat, "diff": math.expm1(d), "ci_low": math.expm1(lo), "ci_high": math.expm1(hi),
            "confidence": confidence, "df": df, "blocks": [int(xa.size), int(xb.size)],
            "geo_mean_s": [float(np.exp(xa.mean())), float(np.exp(xb.mean()))], "log_sd": sd}


def blocks_needed(log_sd: float, effect: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Blocks per arm for a two-sided test at level `alpha` to detect a relative change
    `effect` (0.05: 5 %) with probability `power`, given the s.d. of log block statistics."""
    from scipy import stats

    if not (effect > 0 and 0 < alpha < 1 and 0 < power < 1):
        raise ValueError("need effect > 0, 0 < alpha < 1, 0 < power < 1")
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return max(2, math.ceil(2 * (z * log_sd / math.log1p(effect)) ** 2))


def report(blocks: list[Block], arms: tuple[str, str] | None = None, confidence: float = 0.95,
           effects: tuple[float, ...] = (0.02, 0.05, 0.10)) -> dict:
    """The comparison on p50 and mean, and the blocks a run needs for each effect size."""
    present = list(dict.fromkeys(k.arm for k in blocks))
    if arms is None:
        if len(present) != 2:
            raise ValueError(f"the run has {len(present)} arms ({', '.join(present)}): name the two to compare with --arms A,B")
        arms = (present[0], present[1])
    for a in arms:
        if a not in present:
            raise ValueError(f"arm {a!r} is not in the run (arms: {', '.join(present)})")
    out: dict = {"arms": list(arms), "blocks": len([k for k in blocks if k.arm in arms])}
    for stat in STATS:
        out[stat] = compare(blocks, arms, stat, confidence)
    p = out["p50"]
    out.update(diff_p50=p["diff"], ci_low=p["ci_low"], ci_high=p["ci_high"])
    out["blocks_needed"] = {f"{e:g}": {s: blocks_needed(out[s]["log_sd"], e) for s in STATS} for e in effects}
    out["per_block"] = [k.__dict__ for k in blocks]
    return out


def plot(blocks: list[Block], result: dict, path: str | Path) -> None:
    """Each block's TPOT p50 in run order, by arm, with the result in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for arm, marker in zip(result["arms"], "os"):
        ks = [k for k in blocks if k.arm == arm]
        ax.plot([k.block for k in ks], [k.p50 * 1e3 for k in ks], marker, label=arm)
        ax.axhline(result["p50"]["geo_mean_s"][result["arms"].index(arm)] * 1e3, ls="--", lw=0.8,
                   color=ax.lines[-1].get_color())
    p = result["p50"]
    ax.set_title(f"{result['arms'][0]} vs {result['arms'][1]}: TPOT p50 {p['diff']:+.1%} "
                 f"({p['confidence']:.0%} CI {p['ci_low']:+.1%} .. {p['ci_high']:+.1%})", fontsize=10)
    ax.set_xlabel("block")
    ax.set_ylabel("block TPOT p50 (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
