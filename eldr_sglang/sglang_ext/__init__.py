"""The SGLang side of ELDR: logic the patch series (patches/sglang-0.5.23) calls into.

- `payload`: the compact expert-count payload (numpy only; the router decodes it too);
- `accumulator`: per-request counts accumulated on the device from the MoE top-k ids (torch);
- `runtime`: the functions the patched SGLang modules call.
"""
