"""The planner: before anything runs, how much host RAM and GPU memory a job needs on a node, how long a
step should take, and whether it fits. The coordinator places jobs with it, the API shows it, and
``horizon-ray plan`` prints it. Pure Python (no torch import), so it is cheap to call anywhere.

    from horizon_ray.planner import plan, NodeSpec, parse_bytes
    p = plan("qwen2.5-7b", seq_len=1024, micro_batch_size=16, grad_accum=4, checkpoint_every=4,
             node=NodeSpec(ram_bytes=parse_bytes("512GiB")))
    p.host_bytes, p.gpu_bytes, p.fits, p.reason, p.breakdown, p.step_time_s

Modules: ``shapes`` (presets, config.json parsing, units), ``modes`` (bytes per parameter of each
precision mode), ``memory`` (host and GPU items), ``timing`` (step-time roofline), ``node`` (NodeSpec,
ceilings, byte sizes), ``planning`` (plan, verdict, max_model, job specs). What a job runs comes as a
``horizon_ray.workload.Workload`` (and ``Adapters`` for LoRA), the plain view of a job spec: the planner
needs neither pydantic nor torch.
"""

from horizon_ray.planner.memory import (
    CUDA_CONTEXT_BYTES,
    PINNED_POW2_ROUNDING,
    PROCESS_BASELINE_BYTES,
)
from horizon_ray.planner.modes import MODES, PrecisionMode, get_mode
from horizon_ray.planner.node import H200_NODE, Ceilings, NodeSpec, format_bytes, parse_bytes
from horizon_ray.planner.planning import MaxModel, Plan, format_plan, max_model, plan, plan_for_spec
from horizon_ray.planner.shapes import FAMILIES, PRESETS, ModelShape, human_params, load_model_shape
from horizon_ray.workload import Adapters, Workload

__all__ = [
    "Adapters", "CUDA_CONTEXT_BYTES", "FAMILIES", "H200_NODE", "MODES", "PINNED_POW2_ROUNDING", "PRESETS",
    "PROCESS_BASELINE_BYTES", "Ceilings", "MaxModel", "ModelShape", "NodeSpec", "Plan",
    "PrecisionMode", "Workload", "format_bytes", "format_plan", "get_mode", "human_params", "load_model_shape",
    "max_model", "parse_bytes", "plan", "plan_for_spec",
]
