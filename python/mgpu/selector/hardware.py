"""The GPU catalog the selector and the cost sheet price with: published figures of each
GPU kind (memory, bandwidths, latencies, dense rates where no GEMM table is fitted), each
with its source, and which kind a visible GPU's name is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GpuSpec:
    """Published figures of one GPU; each field says where its value comes from."""

    name: str
    gemm_type: str  # gemm_fit's GPU type: GEMMs at the curve fitted to its published tables
    hbm_bytes_per_s: float  # what a streaming kernel reaches
    h2d_bytes_per_s: float  # a host -> device copy from pinned memory
    launch_s: float  # host time to enqueue one kernel (or graph) launch
    graph_node_s: float  # device time per node of a replayed graph, a short kernel's run included
    stream_gap_s: float  # device time between two dependent kernels of a stream
    sync_s: float  # a host synchronisation: the queue drains, then refills
    min_kernel_s: float  # the shortest a kernel launched on its own takes
    sources: tuple = ()

    @property
    def stream_kernel_s(self) -> float:
        """What a short kernel costs in a stream of them, launched one by one: the host's
        enqueue or the device's shortest kernel and gap, whichever is longer. The
        selector's launch overhead for GPUs of named profiles (topo measures the same on a
        GPU: a stream of one-element kernels)."""
        return max(self.launch_s, self.min_kernel_s + self.stream_gap_s)


# A replayed straight-line CUDA graph's device time per node, the one published figure
# found: chains of N no-op kernels replayed at about 15 us + 0.58 us a node, where the
# same kernels launched one by one took 6.3-7.5 us each (the selector prices captured
# steps with it too).
GRAPH_NODE_S = 0.58e-6
GRAPH_NODE_SOURCE = "https://github.com/ahrefs/ocannl/issues/488"


# mgpu's own host work in a step beyond the backend's calls (Python, the bindings, the
# trainer's bookkeeping), the same code on every backend: `topo`'s step overhead on the
# CPU backend, a step of [8, 8, 8] at 8 rows less the model's price of its math
# (docs/cost-sheet.md). On a GPU the backend's own host costs (launches, copies, the
# verdict's synchronisation) are priced apart.
HOST_LOOP_S = 5e-6


H100_SXM = GpuSpec(
    name="H100 SXM (80 GB HBM3)",
    # GEMMs: the curve data/gemm_published.json's H100 tables fit (gemm_fit), as the selector prices them
    gemm_type="h100-sxm",
    hbm_bytes_per_s=2.90e12,  # HBM copy measured on Azure ND H100 v5 (the selector's figure)
    h2d_bytes_per_s=50e9,  # host -> device, 51 GB/s measured there
    launch_s=2.7e-6,  # async enqueue per launch, 2.62-2.81 us (ahrefs/ocannl#488, RTX 5070 Ti)
    graph_node_s=GRAPH_NODE_S,  # per node of a replayed straight-line graph (same source)
    stream_gap_s=1.0e-6,  # assumed
    sync_s=12e-6,  # graph launch + sync intercept 14.8 us less one launch (same source)
    min_kernel_s=2.0e-6,  # assumed
    sources=(
        "GEMM rates: the curve fitted to data/gemm_published.json's H100 tables (docs/gemm-validation.md: "
        "github.com/zzc0721/torch-performance-test-data/issues/79 for FP32, XLA's sm_90 table for TF32 "
        "and BF16)",
        "HBM 2.90 TB/s and host-to-device 51 GB/s measured: github.com/Azure/AI-benchmarking-guide (ND H100 v5)",
        "launch, graph node and sync latencies: github.com/ahrefs/ocannl/issues/488 (RTX 5070 Ti, "
        "CUDA 13.3; no published H100 figure found; scripts/gpu_session.sh's sheet stage sets "
        "measured H100 steps beside the predictions)",
        f"mgpu's host loop, {HOST_LOOP_S * 1e6:.0f} us a step: measured on the CPU backend",
        "assumed: 1 us between dependent stream kernels, 2 us shortest kernel launched on its own",
    ),
)
GPUS = {"h100-sxm": H100_SXM}
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
NCCL_BUFFER_BYTES = 64e6  # NCCL's communication buffers per GPU (a profile's buffer_bytes)


# A GPU's per-step latencies, from the cost sheet's published figures (costsheet.py; one
# consumer GPU measured, used for every GPU until topo measures one): a short kernel in a
# stream of them, and the step's overhead, the host loop and the verdict's
# synchronisation that ends each step. So `recommend` and `bench --explain` price a
# step alike.
GPU_LAUNCH_S = H100_SXM.stream_kernel_s
GPU_STEP_OVERHEAD_S = HOST_LOOP_S + H100_SXM.sync_s


# Device figures. GEMM rates: fitted to published GEMM benchmarks per GPU and
# precision (gemm_fit, data/gemm_published.json) where a table has them; else the
# vendor's dense peak derated to about 0.7 with a guessed half-peak work (half), and
# a half precision absent from both falls back to fp32 (conservative). Memory
# bandwidth: about 0.85 of the spec unless a published measurement is named.
GPU_TYPES = {
    "rtx-4070-ti-super": dict(
        name="RTX 4070 Ti SUPER",
        fp32=30e12,
        tf32=40e12,
        bf16=80e12,
        fp16=80e12,
        half=3e8,
        memory=16e9,
        bandwidth=600e9,
        h2d=12e9,
        context=0.5e9,
    ),
    # NVIDIA RTX 5080 spec: 960 GB/s GDDR7, 16 GB
    "rtx-5080": dict(name="RTX 5080", memory=16e9, bandwidth=816e9, h2d=24e9, context=0.5e9),
    # NVIDIA RTX 4060 spec: 272 GB/s GDDR6, 8 GB (PCIe 4.0 x8)
    "rtx-4060": dict(name="RTX 4060", memory=8e9, bandwidth=230e9, h2d=12e9, context=0.5e9),
    # A100 SXM4 80GB: HBM copy 1.61 TB/s (Azure ND A100 v4 measurements)
    "a100-80gb": dict(name="A100 SXM4 80GB", memory=80e9, bandwidth=1.61e12, h2d=24e9, context=0.6e9),
    # A100 SXM4 40GB: the 80GB part's SMs and clocks (its GEMM tables), 1.56 TB/s HBM2 spec
    "a100-40gb": dict(name="A100 SXM4 40GB", memory=40e9, bandwidth=1.33e12, h2d=24e9, context=0.6e9),
    # H100 SXM 80GB: HBM copy 2.90 TB/s, host<->device 51 GB/s (Azure ND H100 v5)
    "h100-sxm": dict(
        name="H100 SXM 80GB",
        memory=80e9,
        bandwidth=H100_SXM.hbm_bytes_per_s,
        h2d=H100_SXM.h2d_bytes_per_s,
        context=0.6e9,
    ),
    # H100 PCIe 80GB spec: 2.0 TB/s
    "h100-pcie": dict(name="H100 PCIe 80GB", memory=80e9, bandwidth=1.7e12, h2d=25e9, context=0.6e9),
    # H200 SXM 141GB: HBM copy 4.01 TB/s, host-to-device 55 GB/s (Azure ND H200 v5). The H100
    # SXM's die, SM count and clocks (NVIDIA's spec: the same dense TFLOPS at every
    # precision), so its GEMMs are priced on the H100 SXM tables' curve.
    "h200": dict(name="H200 SXM 141GB", memory=141e9, bandwidth=4.01e12, h2d=55e9, context=0.6e9, gemm_like="h100-sxm"),
}


def gemm_curve(gpu: str) -> str:
    """The GPU type whose fitted GEMM curve prices `gpu`'s GEMMs (itself, or a sibling of the same die and clocks)."""
    return GPU_TYPES.get(gpu, {}).get("gemm_like", gpu)


_AZURE = "https://github.com/Azure/AI-benchmarking-guide/blob/main/Azure_Results/"
SPECS = {
    "h100-sxm-azure": {
        "url": _AZURE + "ND_H100_v5_results.md",
        "figure": "H100 HBM bandwidth 2.90 TB/s, host-device 51 GB/s",
    },
    "a100-azure": {"url": _AZURE + "ND_A100_v4_results.md", "figure": "A100 HBM 1.61 TB/s"},
    "h200-azure": {
        "url": _AZURE + "ND_H200_v5_results.md",
        "figure": "H200 HBM bandwidth 4.01 TB/s, host-device 55 GB/s",
    },
    "h200": {
        "url": "https://www.nvidia.com/en-us/data-center/h200/",
        "figure": "H200 SXM: 141 GB HBM3e at 4.8 TB/s; dense TFLOPS as the H100 SXM's",
    },
    "h100-pcie": {
        "url": "https://www.nvidia.com/en-us/data-center/h100/",
        "figure": "H100 PCIe memory bandwidth 2.0 TB/s",
    },
    "a100-40gb": {"url": "https://www.nvidia.com/en-us/data-center/a100/", "figure": "A100 40GB SXM: 1,555 GB/s HBM2"},
    "rtx-5080": {
        "url": "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5080/",
        "figure": "RTX 5080: 960 GB/s, 16 GB",
    },
    "rtx-4060": {
        "url": "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4060-4060ti/",
        "figure": "RTX 4060: 272 GB/s, 8 GB",
    },
    "graph-node": {
        "url": GRAPH_NODE_SOURCE,
        "figure": f"a replayed CUDA graph costs {GRAPH_NODE_S * 1e6:.2f} us per node beyond its kernels' "
        "work (RTX 5070 Ti, CUDA 13; the one published figure found, used for every GPU)",
    },
    "latencies": {
        "url": GRAPH_NODE_SOURCE,
        "figure": f"a short kernel in a stream {GPU_LAUNCH_S * 1e6:.1f} us (the larger of a "
        f"{H100_SXM.launch_s * 1e6:.1f} us enqueue, measured there, and an assumed 2 us kernel + "
        f"1 us gap; the same source timed 6.3-7.5 us a kernel launched one by one, on a WSL2 "
        f"laptop, which this assumes a Linux server's GPU does not pay: topo measures it); "
        f"a step's overhead {GPU_STEP_OVERHEAD_S * 1e6:.0f} us: the "
        f"{H100_SXM.sync_s * 1e6:.0f} us synchronisation measured there and mgpu's "
        f"{HOST_LOOP_S * 1e6:.0f} us host loop, measured on its CPU backend (as bench --explain)",
    },
}


def known_gpu_type(name: str) -> Optional[str]:
    """The GPU_TYPES entry a visible GPU's name is, or None."""
    n = name.upper()
    if "MIG" in n or "LAPTOP" in n or "NVL" in n:  # a slice, a mobile part, a 94 GB card of its own clocks
        return None
    if "H100" in n:  # "NVIDIA H100 80GB HBM3" is the SXM part
        return "h100-pcie" if "PCIE" in n else "h100-sxm"
    if "H200" in n and "GH200" not in n:  # "NVIDIA H200" is the SXM part (the NVL card is excluded above)
        return "h200"
    if "A100" in n and "SXM" in n:  # PCIe A100s run lower clocks
        return "a100-40gb" if "40GB" in n else "a100-80gb"
    if "RTX 5080" in n:
        return "rtx-5080"
    if "RTX 4060" in n and "TI" not in n.split("RTX 4060", 1)[1]:
        return "rtx-4060"
    return None
