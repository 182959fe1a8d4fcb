"""What real SGLang on a CPU needs beyond `pip install sglang==0.5.23`, checked in a subprocess."""

from __future__ import annotations

import subprocess
import sys

from .overlay import installed_sglang
from .stub import HarnessError

INSTALL_HINT = (
    "apt-get install -y libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 && "
    "pip install mooncake-transfer-engine==0.3.13.post1 nvidia-cuda-runtime-cu12"
)

# sgl_kernel's common_ops (needs libcuda.so.1: the stub) and mooncake's engine.so (needs
# libcudart.so.12, libibverbs/libmlx5, and cuMemCreate & co. from the stub)
PROBE = "import sgl_kernel\nfrom mooncake.engine import TransferEngine\nprint('OK')"


def check_prerequisites(env: dict) -> None:
    """Raise HarnessError naming what is missing, with the import error verbatim."""
    installed_sglang()
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0 or "OK" not in p.stdout:
        err = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise HarnessError(f"sgl_kernel/mooncake do not load on this machine: {err}\n(install: {INSTALL_HINT})")
