"""A node as the planner sees it: RAM, GPU memory and the measured ceilings that set the step time.

Defaults describe the project's GPU box, as measured on it: one H200, 16 Sapphire Rapids
cores, 125.9 GiB of host RAM. Every rate is a measurement on that box, not a datasheet number, except
where a field says otherwise. A node's own measurements (`horizon-ray probe`) replace them; docs/ceilings.md
has the measurements, the probe and the calibration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from horizon_ray.errors import BadInput

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": KiB, "kib": KiB, "mi": MiB, "mib": MiB, "gi": GiB, "gib": GiB, "ti": TiB, "tib": TiB,
}


def parse_bytes(text: str | int | float, *, unit_required: bool = False) -> int:
    """``"125GiB"`` -> 134217728000. IEC suffixes (KiB, MiB, GiB, TiB, or Kubernetes' Ki, Mi, Gi, Ti) are
    powers of 1024; SI ones (KB, MB, GB, TB, K, M, G, T) powers of 1000, so "1.5TB" is 1.5e12 bytes, 9 %
    less than the 1.5 TiB a server with 1536 GiB of DIMMs has. A bare number is bytes; with
    ``unit_required`` (what a person types on a command line: "--node-ram 16" means 16 GiB to them, not 16
    bytes) a string without a unit is refused."""
    if isinstance(text, bool):
        raise BadInput(f"not a byte size: {text!r}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise BadInput(f"a byte size cannot be negative: {text!r}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise BadInput(f"not a byte size: {text!r}; write e.g. 125GiB, 1.5TiB, 512Gi or 141GB")
    if unit_required and unit in ("", "b"):
        raise BadInput(f"{text!r} has no unit and would mean {m.group(1)} bytes; write it with one, e.g. "
                       f"{m.group(1)}GiB (or {m.group(1)}GB, {m.group(1)}MiB)")
    return int(round(float(m.group(1)) * _UNITS[unit]))


def format_bytes(n: float) -> str:
    """Bytes in GiB (or MiB below 1 GiB), the unit the reasons and tables speak."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB"


@dataclass(frozen=True)
class Ceilings:
    """The rates that set a step's time. The defaults are the project's GPU box as measured on it (2026-11-29,
    one run each: take them as +-5 %), except where a field says "assumed"; a node's own measurements
    (``horizon-ray probe``, which its agent runs at start and caches) replace the fields they measure, named in
    ``measured``. Everything else stays an assumption, and the plan says which."""

    matmul_flops: float = 786.5e12  # bf16 dense matmul, FLOP/s: the rate MFU is against
    datasheet_matmul_flops: float = 989.5e12  # the GPU's datasheet bf16 dense rate (MFU is printed against it too)
    # Share of matmul_flops a streamed layer sustains (see timing), calibrated against the engine on the H200
    # box (commit cea6a8e, Qwen2.5-7B, seq 1024, bf16, 12 GiB GPU budget, Liger kernels): 0.72 puts the plan at
    # 3.14 s and 6.88 s per step for 16,384 and 65,536 tokens, against 3.15 s and 6.64 s measured. Never
    # measured by the probe (it takes a whole model), so always an assumption.
    compute_efficiency: float = 0.72
    # GPU seconds a mixture-of-experts layer spends per routed token copy (one token's one expert) beyond its
    # FLOPs, at hidden size 2048 (scaled by hidden / 2048): gathering the copies by expert, grouped GEMMs of a few
    # hundred to a thousand rows an expert, the routing-weight product, the scatter back to token order and the
    # sum over k, each pass of the step. Fitted to profiled steps on the H200 box (commit df74309 and 1a3d920,
    # olmoe-1b-7b at 65,536 tokens: GPU compute 1.87 s LoRA / 1.97 s full against 0.84 / 1.10 s of FLOPs, over
    # 8.4 M routed copies: 123 / 104 ns); with it qwen3-30b-a3b LoRA at 65,536 plans 5.2 s against 6.11 s
    # measured (without it 2.7 s; 5.40 s since adapter_bytes_per_s counts the attention adapters' passes, which
    # this fit already held). Never measured by the probe, so always an assumption.
    moe_copy_s: float = 1.15e-7
    # Bytes a second the LoRA adapters' passes over activations run at beyond their frozen projections (the
    # [tokens, r] GEMMs that read a projection's input or its output gradient, and the adds into its output and
    # input gradient: timing.adapter_passes), which FLOPs do not count. Fitted on the H200 box (2026-12-05, commit
    # 01f6968): qwen3-4b LoRA r16 on all seven projections at 65,536 tokens took 3.59 s a step against 2.89 s
    # planned without this term, 0.70 s for the 1.50 TB those passes moved then: 2.1 TB/s. One adapted projection
    # alone at qwen3-4b's widths ran them at 1.9-2.6 TB/s (q, o, gate, up, down; k and v, 1,024 wide, at 0.5-0.9:
    # benchmarks/probes/lora_addmm.py). Since the adapters of one input read it once (layers._LoraLinears) that
    # step moves 1.32 TB, which the plan counts at the same rate. Never measured by the probe, so always an
    # assumption.
    adapter_bytes_per_s: float = 2.1e12
    h2d_bytes_per_s: float = 55.4e9  # pinned host -> device
    d2h_bytes_per_s: float = 55.3e9  # pinned device -> host
    duplex_bytes_per_s: float = 101.7e9  # both directions at once, in total
    adam_params_per_s: float = 4.33e9  # torch fused CPU AdamW, fp32, 16 threads, no copies running
    adam_params_per_s_with_copies: float = 2.70e9  # the same while full-duplex pinned copies run
    adam_bytes_per_param: float = 28.0  # bytes the measured AdamW moved per parameter (fp32 g, p, m, v)
    # Host-memory side of the pinned copies of all the node's GPUs together. Each GPU has its own PCIe link,
    # but every link's DMA reads and writes the same DRAM. Not measured beyond one GPU: taken as the one-GPU
    # duplex rate, so N engines on one host get 1/N of it each (a run of two engines side by side measures it).
    host_copy_bytes_per_s: float = 101.7e9
    # device="cpu" only: FLOP/s (the planner's count, timing.step_time) the engine sustains on the host's cores,
    # as the probe measures it on a small reference model; assumed for the GPU box (its CPU never ran a job)
    cpu_flops: float = 2.0e11
    cpu_matmul_flops: float = 0.0  # fp32 GEMM rate of the host's cores (the probe's; shown, not planned with)
    measured: tuple[str, ...] = ()  # the fields measured on the node these ceilings describe
    source: str = "assumed: the H200 box's rates (the node was not probed)"  # where the values come from

    MEASURABLE: ClassVar[tuple[str, ...]] = (
        "matmul_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "duplex_bytes_per_s", "adam_params_per_s",
        "adam_params_per_s_with_copies", "host_copy_bytes_per_s", "cpu_flops", "cpu_matmul_flops")

    @classmethod
    def from_measured(cls, values: Mapping[str, float], source: str) -> Ceilings:
        """These defaults with the measured `values` (fields of MEASURABLE) in their place."""
        unknown = sorted(set(values) - set(cls.MEASURABLE))
        if unknown:
            raise BadInput(f"not a measured ceiling: {', '.join(unknown)}; measured ones are "
                           f"{', '.join(cls.MEASURABLE)}")
        kept = {k: float(v) for k, v in values.items() if v and v > 0}
        return cls(**kept, measured=tuple(k for k in cls.MEASURABLE if k in kept), source=source)

    @staticmethod
    def used(device: str, moe: bool = False, adapters: bool = False) -> tuple[str, ...]:
        """The fields a step time on `device` depends on (``moe``: of a model with mixture-of-experts layers;
        ``adapters``: with LoRA adapters on dense projections)."""
        if device == "cpu":
            return ("cpu_flops", "adam_params_per_s")
        return ("matmul_flops", "compute_efficiency", *(("moe_copy_s",) if moe else ()),
                *(("adapter_bytes_per_s",) if adapters else ()), "h2d_bytes_per_s", "d2h_bytes_per_s",
                "duplex_bytes_per_s", "adam_params_per_s", "adam_params_per_s_with_copies", "host_copy_bytes_per_s")

    def assumed(self, device: str, moe: bool = False, adapters: bool = False) -> list[str]:
        """The fields a plan on `device` uses that were not measured on the node."""
        return [k for k in self.used(device, moe, adapters) if k not in self.measured]


# The box the defaults describe: these were measured on it (the rest are calibrated or taken as described).
H200_CEILINGS = Ceilings(
    measured=("matmul_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "duplex_bytes_per_s", "adam_params_per_s",
              "adam_params_per_s_with_copies"),
    source="the project's H200 box, measured 2026-11-29")


@dataclass(frozen=True)
class NodeSpec:
    ram_bytes: int = int(125.9 * GiB)  # host RAM (125.9 GiB on the H200 box)
    gpu_mem_bytes: int = 143771 * MiB  # memory of one GPU (nvidia-smi on the H200 box: 143771 MiB)
    gpus: int = 1  # GPUs on the node; one job (one engine) uses one GPU, so up to `gpus` engines share the host
    reserve_fraction: float = 0.05  # share of RAM kept free for the OS, page cache and other processes
    ceilings: Ceilings = field(default_factory=lambda: H200_CEILINGS)
    name: str = "h200"

    def __post_init__(self):
        if self.ram_bytes <= 0:
            raise BadInput(f"node RAM must be > 0 bytes, got {self.ram_bytes}")
        if self.gpu_mem_bytes < 0 or self.gpus < 0:
            raise BadInput("GPU memory and GPU count must be >= 0")
        if not 0 <= self.reserve_fraction < 1:
            raise BadInput(f"reserve_fraction must lie in [0, 1), got {self.reserve_fraction}")

    @property
    def usable_ram_bytes(self) -> int:
        """RAM a job may plan to use: the node's RAM less the reserve."""
        return int(self.ram_bytes * (1 - self.reserve_fraction))

    def ram_needed_for(self, host_bytes: int) -> int:
        """The smallest node RAM whose usable share holds host_bytes."""
        return int(host_bytes / (1 - self.reserve_fraction)) + 1

    @classmethod
    def from_node_info(cls, info, **overrides) -> NodeSpec:
        # a node its agent has not probed (yet) is planned with the H200 box's rates, labelled assumed
        """From anything with the cluster's NodeInfo fields (ram_bytes, gpu_count, gpu_memory_bytes and, once its
        agent probed the node, ceilings: {"values": {field: rate}, "source": str})."""
        gpus = int(getattr(info, "gpu_count", 0) or 0)
        kw: dict[str, Any] = {"ram_bytes": int(info.ram_bytes), "gpus": gpus,
              "gpu_mem_bytes": int(getattr(info, "gpu_memory_bytes", 0) or 0) if gpus else 0,
              "name": str(getattr(info, "node_id", "node"))}
        probed = getattr(info, "ceilings", None)
        kw["ceilings"] = Ceilings.from_measured(probed["values"], probed["source"]) if probed else Ceilings()
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


H200_NODE = NodeSpec()
