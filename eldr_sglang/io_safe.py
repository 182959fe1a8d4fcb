"""Output files that never destroy what stands at their path: the one writer every eldr
command uses (the Rust twin, `eldr_core::write_atomic`, follows the same rules).

* A destination that exists and is not a regular file (a symlink, a directory, a FIFO, a
  device node such as /dev/full, a socket) is refused, not replaced.
* An output that is the same file as one of the run's inputs (or as another of its outputs)
  is refused before any work is done: `fit T --out T` must not destroy T.
* Data goes to a uniquely named temporary file in the destination's directory, is fsynced,
  then renamed over the destination (and the directory fsynced). Readers see the old file or
  the complete new one; on any failure (a full disk, Ctrl-C) the temporary file is removed
  and the destination is untouched.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import stat
from pathlib import Path
from typing import IO, Iterable, Iterator

import numpy as np

__all__ = [
    "UnsafeOutputError",
    "Staged",
    "StagedDir",
    "atomic_output",
    "check_output",
    "check_outputs",
    "json_ready",
    "keep_previous",
    "non_regular_kind",
    "same_file",
    "write_bytes",
    "write_json",
    "write_text",
]


class UnsafeOutputError(ValueError):
    """An output path that a writer refuses to replace or that would destroy an input."""


def non_regular_kind(mode: int) -> str | None:
    """What a non-regular file is, for messages; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    for test, kind in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISCHR, "a character device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same file: the same inode when both exist (hard links,
    symlinks, `./x` vs `x`), else the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def _refuse_non_regular(p: Path, what: str) -> None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    kind = non_regular_kind(st.st_mode)
    if kind is not None:
        raise UnsafeOutputError(f"{what} {p}: refusing to write over {kind}; give a new path or a regular file")


def check_output(
    path: str | os.PathLike,
    *,
    what: str = "output",
    inputs: Iterable[tuple[str, str | os.PathLike | None]] = (),
    create_parent: bool = False,
) -> Path:
    """Check an output path before any work: not a non-regular file, its directory exists
    (or is created, with `create_parent`) and is writable, and it is not the same file as any
    of `inputs` ((label, path) pairs; None paths are skipped). Returns it as a Path; raises
    UnsafeOutputError."""
    p = Path(path)
    if not p.name or p.name in (".", ".."):
        raise UnsafeOutputError(f"{what} {path!s}: not a file name")
    _refuse_non_regular(p, what)
    parent = p.parent
    if create_parent:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UnsafeOutputError(f"{what} {p}: cannot create directory {parent}: {exc.strerror or exc}") from None
    if not parent.is_dir():
        raise UnsafeOutputError(f"{what} {p}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UnsafeOutputError(f"{what} {p}: directory {parent} is not writable")
    for label, other in inputs:
        if other is not None and same_file(p, other):
            raise UnsafeOutputError(f"{what} {p} is the same file as {label} {other}; writing it would destroy it")
    return p


def check_outputs(outputs: Iterable[tuple[str, str | os.PathLike | None]], inputs: Iterable[tuple[str, str | os.PathLike | None]] = ()) -> list[Path | None]:
    """check_output for several outputs of one run: each against every input and against the
    other outputs. (label, None) entries are skipped and give None."""
    outputs, inputs = list(outputs), list(inputs)
    checked: list[Path | None] = []
    for i, (label, path) in enumerate(outputs):
        if path is None:
            checked.append(None)
            continue
        others = inputs + [o for j, o in enumerate(outputs) if j != i]
        checked.append(check_output(path, what=label, inputs=others))
    return checked


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Staged:
    """A temporary file beside `path`; `commit()` renames it over `path`, `discard()` removes
    it. Use as a context manager: it is discarded unless committed."""

    def __init__(self, path: str | os.PathLike, *, what: str = "output", inputs: Iterable[tuple[str, str | os.PathLike | None]] = ()):
        self.path = check_output(path, what=what, inputs=inputs)
        self.what = what
        while True:
            tmp = self.path.parent / f".{self.path.name}.{secrets.token_hex(6)}.tmp"
            try:
                # 0o666 less the umask, like a plain open(); mkstemp would force 0o600
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                break
            except FileExistsError:  # pragma: no cover - 48 random bits
                continue
        self.tmp = tmp
        self.done = False

    def commit(self) -> Path:
        with open(self.tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        _refuse_non_regular(self.path, self.what)  # something may have appeared meanwhile
        os.replace(self.tmp, self.path)
        self.done = True
        _fsync_dir(self.path.parent)
        return self.path

    def discard(self) -> None:
        if not self.done:
            self.tmp.unlink(missing_ok=True)
            self.done = True

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "wb", *, what: str = "output", inputs=(), encoding: str | None = None) -> Iterator[IO]:
    """Open a staged temporary file for writing; on a clean exit it replaces `path`."""
    with Staged(path, what=what, inputs=inputs) as st:
        with open(st.tmp, mode, encoding=encoding if "b" not in mode else None) as fh:
            yield fh
        st.commit()


def keep_previous(path: str | os.PathLike, suffix: str = ".prev") -> Path | None:
    """Before `path` is replaced, keep its current version as `path + suffix` (a hard link,
    else a copy; an older `.prev` is replaced atomically). None when there is nothing to keep."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    prev = p.with_name(p.name + suffix)
    with Staged(prev, what="backup") as staged:
        staged.tmp.unlink()
        try:
            os.link(p, staged.tmp)
        except OSError:
            import shutil

            shutil.copy2(p, staged.tmp)
        staged.commit()
    return prev


class StagedDir:
    """A directory's new contents, built in a fresh directory beside it; `commit()` swaps it in
    with two renames, so `path` is always wholly the old run, briefly absent, or wholly the
    new one: an interrupted re-run never mixes two runs. An existing `path` must be a real
    directory holding only `owned` names (what this command writes), so that nobody else's
    files are swept away with the old run."""

    def __init__(self, path: str | os.PathLike, *, what: str = "output directory", owned: Iterable[str] = ()):
        self.path = p = Path(path)
        self.what = what
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafeOutputError(f"{what} {p}: refusing to replace {non_regular_kind(st.st_mode) or 'a file'} with a directory")
            foreign = sorted(set(os.listdir(p)) - set(owned))
            if foreign:
                shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
                raise UnsafeOutputError(f"{what} {p} holds files this command does not write ({shown}); "
                                        "choose another directory or remove them")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UnsafeOutputError(f"{what} {p}: cannot create directory {p.parent}: {exc.strerror or exc}") from None
        while True:
            tmp = p.parent / f".{p.name}.{secrets.token_hex(6)}.tmp"
            try:
                os.mkdir(tmp, 0o777)  # less the umask
                break
            except FileExistsError:  # pragma: no cover
                continue
        self.tmp = tmp
        self.done = False

    def commit(self) -> Path:
        old = None
        if os.path.lexists(self.path):
            old = self.path.parent / f".{self.path.name}.{secrets.token_hex(6)}.old"
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        self.done = True
        _fsync_dir(self.path.parent)
        if old is not None:
            import shutil

            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def discard(self) -> None:
        if not self.done:
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)
            self.done = True

    def __enter__(self) -> StagedDir:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


def write_bytes(path: str | os.PathLike, data: bytes, *, what: str = "output", inputs=()) -> Path:
    with atomic_output(path, "wb", what=what, inputs=inputs) as fh:
        fh.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, *, what: str = "output", inputs=()) -> Path:
    return write_bytes(path, text.encode("utf-8"), what=what, inputs=inputs)


def json_ready(o):
    """A copy of `o` that json can write as strict JSON: numpy scalars and arrays become
    Python values, tuples lists, and NaN or infinite floats null."""
    if isinstance(o, dict):
        return {str(k) if not isinstance(k, str) else k: json_ready(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_ready(v) for v in o]
    if isinstance(o, np.ndarray):
        return json_ready(o.tolist())
    if isinstance(o, np.generic):
        return json_ready(o.item())
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if o is None or isinstance(o, (str, int, float, bool)):
        return o
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_json(obj, path: str | os.PathLike, *, what: str = "--json", inputs=(), indent: int | None = 2) -> Path:
    """Serialize first (an unserializable value fails before any file exists), then write
    atomically."""
    text = json.dumps(json_ready(obj), indent=indent, allow_nan=False) + "\n"
    return write_text(path, text, what=what, inputs=inputs)
