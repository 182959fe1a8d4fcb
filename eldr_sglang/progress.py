"""Progress output for every long loop in eldr: one rule, one place.

- On a terminal: a tqdm bar (or, for `status_line`, a one-line text that each message replaces).
- Not a terminal (stderr piped to a file or a CI log): tqdm would write every redrawn frame,
  joined by carriage returns, into the file. Instead a few plain lines: one as each quarter of a
  known total is crossed (25/50/75/100 %), at most one every ``interval_s`` seconds; with no known
  total, one every ``interval_s``. A bar that finishes before its first line is due prints
  nothing if it is transient (``leave=False``, as it vanishes on a terminal too), else one closing
  line. A bar that printed anything always prints its closing line.
- Disabled (``enabled=False``, the CLIs' --no-progress / --quiet): nothing at all.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

# Seconds between two plain lines of one bar when output is not a terminal.
PLAIN_INTERVAL_S = 10.0
_clock = time.monotonic  # tests swap in a fake clock


def is_terminal(file: TextIO) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """What every site calls: ``update(n)``, ``status(text)``, ``close()``; a context manager."""

    def update(self, n: int = 1) -> None:
        pass

    def status(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Bar(Progress):
    def __init__(self, bar: tqdm):
        self._bar = bar

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def status(self, text: str) -> None:
        self._bar.set_description_str(text, refresh=True)

    def close(self) -> None:
        self._bar.close()


class _Lines(Progress):
    """Plain, newline-terminated progress lines for a file or a pipe."""

    def __init__(self, file: TextIO, desc: str, total: int | None, unit: str, unit_scale: bool, initial: int,
                 leave: bool, interval_s: float):
        self._file, self._desc, self._total, self._unit = file, desc, total, unit
        self._unit_scale, self._leave, self._interval = unit_scale, leave, interval_s
        self._n = initial
        self._t0 = self._last = _clock()
        self._quarter = self._quarter_of(initial)
        self._text: str | None = None  # the latest status text
        self._said: str | None = None  # the last line written
        self._closed = False

    def _quarter_of(self, n: int) -> int:
        return 4 * n // self._total if self._total else 0

    def _num(self, n: float) -> str:
        return tqdm.format_sizeof(n) if self._unit_scale else f"{n:g}"

    def _line(self) -> str:
        if self._text is not None:
            return f"{self._desc}: {self._text}" if self._desc else self._text
        done = self._num(self._n)
        if self._total:
            done = f"{done}/{self._num(self._total)} {self._unit} ({100 * self._n // self._total}%)"
        else:
            done = f"{done} {self._unit}"
        return f"{self._desc}: {done} in {_clock() - self._t0:.1f} s"

    def _say(self) -> None:
        line = self._line()
        if line != self._said:
            print(line, file=self._file, flush=True)
            self._said = line
        self._last = _clock()

    def _due(self) -> bool:
        return _clock() - self._last >= self._interval

    def update(self, n: int = 1) -> None:
        self._n += n
        if self._total:
            q = self._quarter_of(self._n)
            if q > self._quarter and self._due():
                self._quarter = q
                self._say()
        elif self._due():
            self._say()

    def status(self, text: str) -> None:
        self._text = text
        if self._due():
            self._say()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._leave or self._said is not None:
            self._say()


def progress(total: int | None = None, *, desc: str = "", unit: str = "it", enabled: bool = True, initial: int = 0,
             leave: bool = True, unit_scale: bool = False, file: TextIO | None = None,
             interval_s: float = PLAIN_INTERVAL_S) -> Progress:
    """A progress bar over ``total`` items (None: unknown), drawn as the module docstring says."""
    file = sys.stderr if file is None else file
    if not enabled:
        return Progress()
    if is_terminal(file):
        return _Bar(tqdm(total=total, desc=desc, unit=unit, initial=initial, leave=leave, unit_scale=unit_scale,
                         file=file, mininterval=0.5))
    return _Lines(file, desc, total, unit, unit_scale, initial, leave, interval_s)


def status_line(*, desc: str = "", enabled: bool = True, leave: bool = False, file: TextIO | None = None,
                interval_s: float = PLAIN_INTERVAL_S) -> Progress:
    """A line of text that each ``status(text)`` replaces (e.g. k-means iterations), same rules."""
    file = sys.stderr if file is None else file
    if not enabled:
        return Progress()
    if is_terminal(file):
        return _Bar(tqdm(total=0, bar_format="{desc}", desc=desc, leave=leave, file=file))
    return _Lines(file, desc, None, "", False, 0, leave, interval_s)
