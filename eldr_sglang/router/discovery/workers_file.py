"""--workers-file PATH: a JSON file of workers, polled every --workers-file-interval.

    {"prefill": [{"url": "http://p0:30000", "bootstrap_port": 8998}],
     "decode": [{"url": "http://d0:30001"}]}

Each poll reads the file in a worker thread (stat, then a non-blocking open of a regular file
of at most MAX_BYTES), so a slow or stuck file system never stalls the event loop; a read still
running is never stacked on. A version whose bytes differ from the last one is parsed and
checked (membership.from_json). A half-written, unparsable or invalid version is refused with
one logged line (once per version) and the last good membership stays; so does a file that
disappears. The bytes are compared, not the mtime, so a rewrite within one mtime tick is seen.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import time
from typing import Callable

from eldr_sglang.router.discovery.membership import Membership, MembershipError, from_json

logger = logging.getLogger("eldr.router.discovery")

MAX_BYTES = 4 * 1024 * 1024  # a workers file of 10,000 workers is well under 1 MiB
DEFAULT_INTERVAL_S = 1.0


class WorkersFileError(MembershipError):
    pass


def read_bytes(path: str) -> bytes:
    """The file's bytes: a regular file of at most MAX_BYTES, opened without blocking (a FIFO
    or a device is refused, never waited on). Blocking: call it off the event loop."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise WorkersFileError(f"workers file {path}: not found") from None
    except OSError as exc:
        raise WorkersFileError(f"workers file {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise WorkersFileError(f"workers file {path}: not a regular file")
    if st.st_size > MAX_BYTES:
        raise WorkersFileError(f"workers file {path}: {st.st_size} bytes, more than the {MAX_BYTES} allowed")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise WorkersFileError(f"workers file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise WorkersFileError(f"workers file {path}: more than {MAX_BYTES} bytes")
    return data


def parse(data: bytes, path: str, need_prefill: bool = True) -> Membership:
    """One version of the file as a checked Membership, or WorkersFileError in one line."""
    source = f"workers file {path}"
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise WorkersFileError(f"{source}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        what = "ends early (half-written?)" if _unclosed(data) else "is not valid JSON"
        raise WorkersFileError(f"{source}: {what}: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise WorkersFileError(f"{source}: nested too deeply") from None
    try:
        return from_json(obj, source, need_prefill=need_prefill)
    except MembershipError as exc:
        raise WorkersFileError(str(exc)) from None


def _unclosed(data: bytes) -> bool:
    """Whether the text ends inside a string or an open [ or { (or is empty): a file cut short."""
    depth, in_str, esc = 0, False, False
    for c in data.decode("utf-8", "replace"):
        if in_str:
            esc, in_str = (False, True) if esc else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
    return in_str or depth > 0 or not data.strip()


class WorkersFile:
    """Polls one workers file; calls `on_change(membership)` with each new good version
    (the first included). `state()` is what /eldr/status shows of it."""

    name = "workers_file"

    def __init__(self, path: str, on_change: Callable[[Membership], None], interval_s: float = DEFAULT_INTERVAL_S,
                 need_prefill: bool = True):
        self.path = path
        self.interval_s = interval_s
        self.need_prefill = need_prefill
        self.on_change = on_change
        self.membership: Membership | None = None  # the last good version
        self.last_error: str | None = None
        self.refused = 0  # versions refused so far
        self.changed_at: float | None = None  # wall time of the last good change
        self._bytes: bytes | None = None  # the last version read, good or not

    def state(self) -> dict:
        return {"path": self.path, "interval_s": self.interval_s, "ok": self.last_error is None,
                "last_error": self.last_error, "refused": self.refused, "changed_at": self.changed_at,
                "workers": self.membership.to_json() if self.membership is not None else None}

    def _refuse(self, msg: str) -> None:
        self.refused += 1
        if self.membership is not None:
            msg += " (keeping the last good membership)"
        logger.warning("%s", msg)
        self.last_error = msg

    async def poll_once(self) -> bool:
        """One poll: True when a new good membership was handed on."""
        try:
            # a read stuck in its thread holds up this source's next poll (run awaits each in
            # turn), never the event loop, and reads are never stacked
            data = await asyncio.to_thread(read_bytes, self.path)
        except WorkersFileError as exc:
            if self._bytes is not None or self.last_error != str(exc):  # once per version
                self._bytes = None
                self._refuse(str(exc))
            return False
        if data == self._bytes:
            return False
        self._bytes = data
        try:
            m = parse(data, self.path, self.need_prefill)
        except WorkersFileError as exc:
            self._refuse(str(exc))
            return False
        self.last_error = None
        if self.membership == m:
            return False
        self.membership = m
        self.changed_at = time.time()
        self.on_change(m)
        return True

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a callback's bug must not end the watch
                logger.exception("workers file %s: poll failed: %s", self.path, exc)
            await asyncio.sleep(self.interval_s)
