"""Hardware profiles for the execution-time model (the model catalogue is `eldr_sglang.models`).

Every constant below is copied from the GPU vendor's datasheet, cited next to it. Nothing
here is tuned to any simulation result.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: str
    hbm_bytes: float  # capacity per GPU
    hbm_bw: float  # peak bytes/s per GPU
    bf16_flops: float  # dense (no sparsity) peak FLOP/s per GPU
    fp8_flops: float
    # host->device bytes/s (one direction) per GPU: what a paged-expert page-in crosses. PCIe
    # Gen5 x16: 32 GT/s x 16 lanes, 128b/130b -> 63 GB/s a direction, "128 GB/s" bidirectional
    # in the datasheets; Gen4 x16: half of that. Datasheet figures halved, not derated.
    host_link_bw: float
    scale_up_bw: float  # GPU<->GPU bytes/s per GPU within a node (NVLink / Infinity Fabric)
    network_bw: float  # bytes/s per GPU between nodes (KV transfer prefill -> decode)
    aliases: tuple[str, ...] = field(default_factory=tuple)
    # True: no roofline constants; only usable with a calibration that measured the whole decode
    # step (other_s), see the "cpu" profile
    calibrated_only: bool = False


G = 1e9
T = 1e12

HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100",
        # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s; BF16 1,979 and
        # FP8 3,958 TFLOPS *with sparsity* -> 989.5 / 1,979 dense; NVLink 900 GB/s; PCIe Gen5
        # 128 GB/s (64 GB/s each way). Network: ConnectX-7 400 Gb/s per GPU = 50 GB/s.
        source="NVIDIA H100 datasheet (SXM5)",
        hbm_bytes=80 * G,
        hbm_bw=3.35 * T,
        bf16_flops=989.5 * T,
        fp8_flops=1979 * T,
        host_link_bw=64 * G,
        scale_up_bw=900 * G,
        network_bw=50 * G,
        aliases=("h100-sxm", "h100-sxm5"),
    ),
    "h200": HardwareProfile(
        name="h200",
        # NVIDIA H200 Tensor Core GPU datasheet, SXM: 141 GB HBM3e, 4.8 TB/s; compute as H100
        # SXM (BF16 989.5, FP8 1,979 dense TFLOPS); NVLink 900 GB/s; PCIe Gen5 128 GB/s.
        source="NVIDIA H200 datasheet (SXM)",
        hbm_bytes=141 * G,
        hbm_bw=4.8 * T,
        bf16_flops=989.5 * T,
        fp8_flops=1979 * T,
        host_link_bw=64 * G,
        scale_up_bw=900 * G,
        network_bw=50 * G,
        aliases=("h200-sxm",),
    ),
    "mi300x": HardwareProfile(
        name="mi300x",
        # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s; FP16/BF16 1,307.4 and FP8
        # 2,614.9 dense TFLOPS; PCIe Gen5 x16 128 GB/s (64 GB/s each way); Infinity Fabric
        # 7 links x 128 GB/s = 896 GB/s peer bandwidth. Network: 400 Gb/s NIC per GPU.
        source="AMD Instinct MI300X datasheet",
        hbm_bytes=192 * G,
        hbm_bw=5.3 * T,
        bf16_flops=1307.4 * T,
        fp8_flops=2614.9 * T,
        host_link_bw=64 * G,
        scale_up_bw=896 * G,
        network_bw=50 * G,
        aliases=("mi300", "amd-mi300x"),
    ),
    "l40s": HardwareProfile(
        name="l40s",
        # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s; BF16 362.05 and FP8 733 dense TFLOPS
        # (733 / 1,466 with sparsity); PCIe Gen4 x16 64 GB/s bidirectional (32 GB/s each way);
        # no NVLink. ASSUMPTION: network 200 Gb/s per GPU = 25 GB/s (KV transfer only).
        source="NVIDIA L40S datasheet",
        hbm_bytes=48 * G,
        hbm_bw=864 * G,
        bf16_flops=362.05 * T,
        fp8_flops=733 * T,
        host_link_bw=32 * G,
        scale_up_bw=64 * G,
        network_bw=25 * G,
        aliases=("l40s-48gb",),
    ),
    "a10": HardwareProfile(
        name="a10",
        # NVIDIA A10 datasheet: 24 GB GDDR6, 600 GB/s; BF16 125 dense TFLOPS (250 with
        # sparsity); no FP8 tensor cores (FP8 weights would run at the BF16 rate, so the BF16
        # figure); PCIe Gen4 x16 64 GB/s bidirectional (32 GB/s each way); no NVLink.
        # ASSUMPTION: network 200 Gb/s per GPU = 25 GB/s (KV transfer only).
        source="NVIDIA A10 datasheet",
        hbm_bytes=24 * G,
        hbm_bw=600 * G,
        bf16_flops=125 * T,
        fp8_flops=125 * T,
        host_link_bw=32 * G,
        scale_up_bw=64 * G,
        network_bw=25 * G,
        aliases=("a10-24gb",),
    ),
    "cpu": HardwareProfile(
        name="cpu",
        # NOT a roofline profile. For the real-engine CPU benchmark (benchmarks/real_cpu_tpot.py):
        # every decode step and prefill time comes from a CPU calibration file
        # (benchmarks/gpu_calibrate.py --device cpu: other_s + a + b d, measured on one core), and
        # ExecutionModel refuses this profile without one. Bandwidths and FLOP/s are NaN: unused.
        # Memory: 24 GB, the benchmark machine's RAM, which only sizes the KV capacity (the 0.6 GB
        # constructed model never fills it). ASSUMPTION: network_bw is infinite, i.e. the
        # prefill -> decode KV transfer is free: it is a loopback TCP copy between processes on
        # one host of about 4 kB per token of the constructed model.
        source="calibrated CPU (benchmarks/gpu_calibrate.py --device cpu); no roofline constants",
        hbm_bytes=24 * G,
        hbm_bw=float("nan"),
        bf16_flops=float("nan"),
        fp8_flops=float("nan"),
        host_link_bw=float("nan"),
        scale_up_bw=float("nan"),
        network_bw=float("inf"),
        calibrated_only=True,
    ),
}


from eldr_sglang.models import norm_name as _norm  # noqa: E402  (the one name lookup, shared with models)


def get_hardware(name: str) -> HardwareProfile:
    n = _norm(name)
    for p in HARDWARE_PROFILES.values():
        if n == p.name or n in p.aliases:
            return p
    raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(HARDWARE_PROFILES)}")
