"""A private, patchable copy of the installed sglang package.

The overlay root holds `sglang/`, a tree of symlinks into the installed package in which
every file a patch touches is a real copy, so patching it never changes the install. Put the
root first on PYTHONPATH to import (or serve) the patched copy.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path

from eldr_sglang import patching

from .stub import HarnessError

CPU_SHIM = Path(__file__).with_name("cpu_shim")


def installed_sglang() -> Path:
    """The installed sglang package directory; HarnessError when absent or not 0.5.23."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise HarnessError(f"sglang is not installed (pip install 'sglang=={patching.SUPPORTED_SGLANG}')")
    version = importlib.metadata.version("sglang")
    if version != patching.SUPPORTED_SGLANG:
        raise HarnessError(f"sglang {version} is installed, the series is for {patching.SUPPORTED_SGLANG}")
    return Path(list(spec.submodule_search_locations)[0])


def _series(series_dirs) -> list[Path]:
    return [p for d in series_dirs for p in patching.read_series(Path(d))]


def build_overlay(root: Path, cpu_shim: bool = False, eldr: bool = False) -> Path:
    """Mirror the installed sglang under root/sglang, copy the files the CPU shim and the ELDR
    series touch, and apply the shim, then the ELDR series (each only when asked). Returns root.

    If the installed sglang is patched already, the copies are reverted to pristine first."""
    src = installed_sglang()
    root = Path(root)
    dst = root / "sglang"
    if dst.exists():
        raise HarnessError(f"{dst} exists already; build the overlay in a fresh directory")
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            os.symlink(Path(dirpath) / f, dst / rel / f)
    eldr_dir = patching.default_series_dir()
    for patch in _series([CPU_SHIM, eldr_dir]):
        for f in patching.touched_files(patch):
            link = root / f
            if link.is_symlink():
                real = link.resolve()
                link.unlink()
                shutil.copy(real, link)
    _, states = patching.check(root)
    if all(s.state == "applied" for s in states):
        patching.revert(root)
    if cpu_shim:
        patching.apply(root, CPU_SHIM)
    if eldr:
        patching.apply(root, eldr_dir)
    return root
