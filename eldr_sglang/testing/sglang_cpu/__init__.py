"""Real SGLang 0.5.23 on a CPU-only machine, for tests. TEST-ONLY: never used by the product.

What it takes (measured facts in docs/operations.md, "Trying the real integration without a GPU"):

- `stub`: a stand-in libcuda.so.1, built with gcc from libcuda_stub.c at test time, because
  sgl_kernel's common_ops and mooncake's engine.so link the NVIDIA driver library;
- `overlay`: a private copy of the installed sglang package (symlinks, with real copies of
  the files that get patched), with the CPU shim in cpu_shim/ applied and then, optionally,
  the ELDR series. The user's install is never modified;
- `model`: tiny Qwen3-MoE and DeepSeek-V3 model directories with seeded random weights and a
  tokenizer trained offline (nothing is downloaded);
- `cluster`: SGLang servers and the ELDR router as subprocesses, each in its own process
  group, ready when /health answers, always stopped by whoever started them.
"""
