"""Build the test-only libcuda.so.1 stand-in (libcuda_stub.c) with gcc."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("libcuda_stub.c")


class HarnessError(RuntimeError):
    """A prerequisite of the CPU harness is missing; the message says which and how to get it."""


def build_libcuda_stub(cache_dir: Path) -> Path:
    """Directory holding libcuda.so.1 built from SOURCE (rebuilt when the source changes);
    put it on LD_LIBRARY_PATH."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise HarnessError("gcc is needed to build the libcuda test stub (apt-get install gcc)")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out_dir = Path(cache_dir) / f"libcuda-stub-{digest}"
    lib = out_dir / "libcuda.so.1"
    if not lib.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".libcuda.so.1.{digest}.tmp"
        p = subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(SOURCE)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise HarnessError(f"building the libcuda stub failed:\n{p.stderr}")
        tmp.replace(lib)
    return out_dir
