"""A node as the planner sees it: RAM, GPU memory and the measured ceilings that set the step time.

Defaults describe the project's GPU box, as measured on it: one H200, 16 Sapphire Rapids
cores, 125.9 GiB of host RAM. Every rate is a measurement on that box, not a datasheet number, except
where a field says otherwise.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

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
    """Measured rates of the box (2026-11-29, one run each: take them as +-5 %)."""

    matmul_flops: float = 786.5e12  # bf16 dense matmul, FLOP/s: the rate MFU is against
    datasheet_matmul_flops: float = 989.5e12  # the GPU's datasheet bf16 dense rate (MFU is printed against it too)
    compute_efficiency: float = 0.55  # assumed share of matmul_flops a streamed layer sustains (see timing)
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
    cpu_flops: float = 1.0e12  # device="cpu" only: sustained fp32 FLOP/s of the host (rough, not measured)


@dataclass(frozen=True)
class NodeSpec:
    ram_bytes: int = int(125.9 * GiB)  # host RAM (125.9 GiB on the H200 box)
    gpu_mem_bytes: int = 143771 * MiB  # memory of one GPU (nvidia-smi on the H200 box: 143771 MiB)
    gpus: int = 1  # GPUs on the node; one job (one engine) uses one GPU, so up to `gpus` engines share the host
    reserve_fraction: float = 0.05  # share of RAM kept free for the OS, page cache and other processes
    ceilings: Ceilings = field(default_factory=Ceilings)
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
        """From anything with the cluster's NodeInfo fields (ram_bytes, gpu_count, gpu_memory_bytes)."""
        gpus = int(getattr(info, "gpu_count", 0) or 0)
        kw = {"ram_bytes": int(info.ram_bytes), "gpus": gpus,
              "gpu_mem_bytes": int(getattr(info, "gpu_memory_bytes", 0) or 0) if gpus else 0,
              "name": str(getattr(info, "node_id", "node"))}
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


H200_NODE = NodeSpec()
