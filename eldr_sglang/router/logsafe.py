"""Log hygiene for text that comes from clients or workers: escaped, bounded, rate-limited."""

from __future__ import annotations

import json
import logging
import time


def safe(value: object, limit: int = 200) -> str:
    """One printable line: control characters, newlines and non-ASCII escaped (so a client
    cannot forge log lines), cut to `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    out = json.dumps(text, ensure_ascii=True)[1:-1]
    return out if len(out) <= limit else out[:limit] + "...(cut)"


class RateLimitedLog:
    """At most one line per key every `every_s` seconds; the next line says how many were held back."""

    def __init__(self, logger: logging.Logger, every_s: float = 30.0):
        self.logger, self.every_s = logger, every_s
        self._last: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def warning(self, key: object, msg: str, *args) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        if held:
            msg += f" ({held} more like it in the last {self.every_s:.0f} s)"
        self.logger.warning(msg, *args)
