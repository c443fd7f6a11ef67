"""The plan of one job on one node: host and GPU bytes, step time, and whether it fits (and why not).

A job comes as its ``Workload`` (``horizon_ray.workload``): the job spec's view, with the spec's defaults and
the one rule that resolves "auto", so a spec is planned the way the runner will run it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from dataclasses import dataclass, field, replace
from typing import Any

from horizon_ray.engine.model import DTYPE_BYTES, default_lora_targets, quantize_for
from horizon_ray.errors import BadInput
from horizon_ray.planner.memory import PINNED_POW2_ROUNDING, device_items, host_breakdown
from horizon_ray.planner.modes import FIDELITY_ORDER, MODES, PrecisionMode, get_mode
from horizon_ray.planner.node import H200_NODE, Ceilings, GiB, NodeSpec, format_bytes
from horizon_ray.planner.shapes import (
    FAMILIES,
    PRESETS,
    ModelShape,
    adapter_params,
    adapter_unit_params,
    human_params,
    load_model_shape,
)
from horizon_ray.planner.timing import step_time
from horizon_ray.workload import Adapters, Workload


@dataclass
class Plan:
    """Everything the planner predicts for one job on one node (plain data, JSON-ready via to_dict)."""

    model: str  # preset name or config path
    params: int  # parameters of the model
    trainable_params: int  # parameters the optimizer updates (adapters only with LoRA)
    method: str  # "full" | "lora"
    mode: str  # precision mode (see modes.MODES)
    compute_dtype: str  # "bfloat16" | "float32"
    device: str  # "cuda" | "cpu"
    seq_len: int
    micro_batch_size: int
    grad_accum: int
    checkpoint_every: int
    tokens_per_step: int  # seq_len x micro_batch_size x grad_accum x gpus: the whole optimizer step
    host_bytes: int  # host RAM the job needs at its peak, process baseline included
    gpu_bytes: int  # GPU memory the job needs at its peak (0 on device cpu)
    pinned_bytes: int  # part of host_bytes that is page-locked (CUDA)
    host_limit_bytes: int  # usable RAM of the node (RAM less the reserve)
    gpu_limit_bytes: int  # GPU memory of the node, or the budget given when it is smaller
    fits: bool  # host_bytes <= host_limit_bytes and gpu_bytes <= gpu_limit_bytes
    short_of: list[str]  # the binding limits when it does not fit: "host RAM", "GPU memory", "a GPU"; [] when it fits
    reason: str  # one paragraph: the verdict with numbers, and what would fit when it does not
    breakdown: dict[str, dict[str, int]]  # {"host": {item: bytes}, "gpu": {item: bytes}}; items sum up
    bytes_per_param: float  # host bytes per parameter of the mode's state (weights, master, m, v, grads)
    step_time_s: float  # predicted seconds per optimizer step (of one engine while concurrent_engines run)
    tokens_per_s: float  # tokens_per_step / step_time_s
    mfu: float  # model FLOPs (house convention, timing.model_flops_per_token) per second / measured matmul_flops
    mfu_datasheet: float  # the same against the datasheet rate (ceilings.datasheet_matmul_flops)
    bound: str  # what sets the step time: gpu compute, pcie, cpu optimizer
    # the ceilings the step time used that no probe of the node measured (the defaults, the H200 box's; see
    # node.Ceilings); [] when every one was measured on the node
    assumed_ceilings: list[str]
    timing: dict[str, Any]  # the terms of the roofline, seconds and FLOPs
    gives_up: str  # what the mode costs against exact AdamW
    engine_supported: bool  # the engine implements this mode today
    alternatives: list[dict[str, Any]] = field(default_factory=list)  # other modes on this node
    lora: dict[str, Any] | None = None  # r, targets and modules_to_save, for method lora
    node: dict[str, Any] = field(default_factory=dict)  # the NodeSpec planned against
    pinned_pow2: bool = PINNED_POW2_ROUNDING  # pinned buffers rounded up to powers of two (torch's allocator)
    concurrent_engines: int = 1  # engines sharing the host's DRAM bandwidth and cores (one per GPU) in the timing
    update: str = "exact"  # training.update: when the host AdamW runs (delayed is not exact AdamW)
    gpus: int = 1  # resources.gpus: ranks of the job, one per GPU, over one host copy (host bytes are once)
    # speculative: how many units (head first, then layers from the top) the engine may update during the
    # backward, as many as the node's RAM holds their own gradient buffers for (EngineConfig.speculate_units)
    speculate_units: int | None = None
    objective: str = "sft"  # sft | dpo (pairs: rows 2i and 2i+1 of every micro-batch)
    # objective dpo: seconds the reference pass spends on one step's rows (a streamed forward with the starting
    # weights, once per job: the whole pass is this x the steps of one epoch), not in step_time_s
    reference_step_s: float | None = None
    # tokens a row group may hold (engine.layer_chunk_tokens; auto decided for this node: workload.LAYER_CHUNK_CHOICES)
    layer_chunk_tokens: int = 0

    @property
    def node_tokens_per_s(self) -> float:
        """Tokens/s of the node when concurrent_engines engines run jobs like this one side by side."""
        return self.tokens_per_s * self.concurrent_engines

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan(model, *, method: str | None = None, mode: str | None = None, seq_len: int | None = None,
         micro_batch_size: int | None = None, grad_accum: int | None = None, checkpoint_every: int | None = None,
         compute_dtype: str = "auto", device: str = "cuda", node: NodeSpec | None = None,
         gpu_budget_bytes: int | None = None, lora: Adapters | dict | None = None,
         loss_chunk_tokens: int | None = None, packed: bool = False, suggest: bool = True,
         pinned_pow2: bool = PINNED_POW2_ROUNDING, layer_chunk_tokens: int | str | None = None,
         offload_checkpoints: bool | str | None = None, concurrent_engines: int = 1, update: str | None = None,
         gpus: int | None = None) -> Plan:
    """Plan one job on one node.

    ``model``: a preset name, a config.json path or model directory, an HF config dict, a ModelShape, or a
    job-spec-like dict ({"model": {"path": ...}, "training": {...}, "engine": {...}}; see plan_for_spec).
    The other keywords are the job's ``Workload`` (the job spec's fields: checkpoint_every is
    engine.activation_checkpoint_every, packed is training.packing); None: the spec's default. "auto"
    resolves as for a job (``workload.resolve``): device cuda when the node has a GPU, compute_dtype bfloat16
    on cuda or for a mode with bf16 weights. ``mode``: a precision mode of ``modes.MODES`` (the spec's
    engine.precision, lora, or bf16-weights, which is planned only); ``method``: full or lora (None: lora when
    ``mode`` is lora, else full). ``lora``: the spec's lora section (``Adapters``, a LoraSpec or a dict);
    absent, its defaults. ``packed``: rows pack several documents (a mask per micro-batch). ``pinned_pow2``:
    how the engine pins host buffers (see memory.PINNED_POW2_ROUNDING). ``concurrent_engines``: how many
    engines (one per GPU) run at once on the node and share its DRAM bandwidth and cores; the step time is that
    of one of them (see ``timing``). On CUDA it cannot exceed the node's GPUs.
    """
    node = node or H200_NODE
    if isinstance(model, dict) and "model" in model:
        return plan_for_spec(model, node, gpu_budget_bytes=gpu_budget_bytes, suggest=suggest,
                             concurrent_engines=concurrent_engines)
    shape = load_model_shape(model)
    method = method or ("lora" if mode == "lora" else "full")
    given: dict[str, Any] = {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "grad_accum": grad_accum,
             "checkpoint_every": checkpoint_every, "loss_chunk_tokens": loss_chunk_tokens,
             "layer_chunk_tokens": layer_chunk_tokens, "offload_checkpoints": offload_checkpoints, "update": update,
             "gpus": gpus}
    job = Workload(packed=bool(packed), device=device, compute_dtype=compute_dtype,
                   **{k: v for k, v in given.items() if v is not None})
    return _plan_job(shape, method, mode, job, Adapters.of(lora) if method == "lora" else None, node,
                     gpu_budget_bytes, suggest, pinned_pow2, concurrent_engines)


def plan_for_spec(spec, node: NodeSpec | None = None, *, gpu_budget_bytes: int | None = None,
                  suggest: bool = True, concurrent_engines: int = 1) -> Plan:
    """Plan a job spec (``horizon_ray.jobspec.JobSpec``, or its dict form, which may lack what planning does
    not need: it is parsed, not checked) on a node, through its ``Workload``.

    The model is read from ``model.path``: a model directory or config.json when this machine sees it, else
    a preset name (the coordinator may not see the node's disks).
    """
    from horizon_ray.jobspec import JobSpec  # pydantic: not where a plan of keywords runs

    node = node or H200_NODE
    if not isinstance(spec, JobSpec):
        spec = JobSpec.parse(spec)
    if not spec.model.path:
        raise BadInput("the job spec has no model.path; set it to an HF model directory or a preset name",
                       field="model.path")
    lora = spec.lora.adapters() if spec.method == "lora" else None
    mode = spec.engine.precision if spec.method == "full" else "lora"
    shape = load_model_shape(spec.model.path)
    p = _plan_job(shape, spec.method, mode, spec.workload(), lora, node, gpu_budget_bytes, suggest,
                  PINNED_POW2_ROUNDING, concurrent_engines)
    return _with_preference(p, shape) if getattr(spec, "objective", "sft") == "dpo" else p


def _with_preference(p: Plan, shape: ModelShape) -> Plan:
    """A DPO job's plan: its step adds a second pass of the LM head's forward (the first sums each row's
    log-probs, the second sends their gradient down), and a reference pass, one forward over the data, comes
    before the first step. Its host bytes are those of SFT (the reference's log-probs: 4 bytes a row)."""
    t = p.timing
    head_flops = 2 * p.tokens_per_step * shape.hidden_size * shape.vocab_size
    extra = t["forward_s"] * head_flops / t["fwd_flops"]  # at the rate the plan runs the forward at
    p.objective = "dpo"
    p.reference_step_s = round(max(t.get("forward_s", 0.0), t.get("pcie_forward_s", 0.0)), 4)
    p.step_time_s += extra
    p.tokens_per_s = p.tokens_per_step / p.step_time_s
    t["preference_head_s"] = extra
    p.reason += (f" Objective dpo: {p.micro_batch_size // 2} pairs a micro-batch (chosen and rejected rows side "
                 f"by side), {extra:.3g} s a step for the second pass of the LM head, and a reference pass of "
                 f"~{p.reference_step_s:.3g} s a step's rows before the first step.")
    return p


def _plan_job(shape: ModelShape, method: str, mode: str | None, job: Workload, lora: Adapters | None,
              node: NodeSpec, gpu_budget_bytes: int | None, suggest: bool, pinned_pow2: bool,
              concurrent_engines: int) -> Plan:
    if method not in ("full", "lora"):
        raise BadInput(f"method must be 'full' or 'lora', got {method!r}")
    pm = get_mode(mode or ("lora" if method == "lora" else "exact"))
    if pm.method != method:
        raise BadInput(f"mode {pm.name!r} goes with method {pm.method!r}; for LoRA use method='lora' (mode "
                       "'lora'), for full fine-tuning one of "
                       f"{', '.join(n for n, m in MODES.items() if m.method == 'full')}")
    # LoRA keeps fp32 adapters on a frozen base (precision exact); every other mode but exact keeps bf16 weights
    job = job.resolved(gpu=node.gpus > 0, precision=pm.name if pm.method == "full" else "exact")
    if pm.needs_bf16 and job.compute_dtype != "bfloat16":
        raise BadInput(f"mode {pm.name!r} keeps its weights in bf16 and computes in bfloat16; set "
                       "compute_dtype='bfloat16' or use mode 'exact'")
    _concurrent(concurrent_engines, job.device, node)
    if lora is None:
        quantize_for(shape.hf, None)  # a pre-quantized checkpoint is refused for full fine-tuning
    else:
        lora = lora.for_shape(shape)  # a pre-quantized checkpoint's quantize among the rest
        lora.check()
        adapter_unit_params(lora, shape)  # refuses modules_to_save entries that select no norm
    if job.layer_chunk_tokens == "auto":
        job = _auto_row_groups(shape, pm, job, node, gpu_budget_bytes, lora, pinned_pow2, concurrent_engines)
    p = _plan(shape, pm, job, node, gpu_budget_bytes, lora, suggest, pinned_pow2, concurrent_engines)
    if job.update != "exact":
        p.update = job.update
        p.reason += _UPDATE_NOTES[job.update]
    return p


# What a non-default training.update changes in a verdict.
_UPDATE_NOTES = {
    "delayed": " Update delayed: NOT exact AdamW (step n+1 trains on the weights after step n-1); it keeps a "
               "second wire of the model in the compute dtype.",
    "speculative": " Update speculative: bit-identical to exact while clipping does not trigger; a step that "
                   "clips rolls its speculated units back by inverting their update (fp32 state within a few "
                   "ulps, not bit for bit) and redoes them.",
}


def _update_buffers(shape: ModelShape, pm: PrecisionMode, job: Workload, host: dict[str, int],
                    usable: int) -> tuple[int | None, int]:
    """Add the host buffers the update mode keeps beyond exact's to ``host["update_buffers"]`` (store.py):
    delayed, a second wire of every parameter; speculative, an own gradient buffer for each speculated unit
    whose gradient would otherwise share its wire (bf16 exact), as many units as the RAM left by the rest of
    the plan holds. Returns (EngineConfig.speculate_units, parameters speculated)."""
    host["update_buffers"] = 0
    if pm.method != "full" or job.update == "exact":
        return None, 0
    c = DTYPE_BYTES[job.compute_dtype]
    if job.update == "delayed":
        host["update_buffers"] = shape.num_params * c
        return None, 0
    units = [n for _, n in shape.units()][1:][::-1]  # backward order: head, layers from the top; no embedding
    shares = pm.base(job.compute_dtype).grads == 0  # the gradient lands in the wire
    room = usable - sum(host.values())
    taken, extra, params = 0, 0, 0
    for n in units:
        cost = n * c if shares else 0
        if extra + cost > room:
            break
        taken, extra, params = taken + 1, extra + cost, params + n
    host["update_buffers"] = extra
    return (None if taken == len(units) else taken), params


def _auto_row_groups(shape: ModelShape, pm: PrecisionMode, job: Workload, node: NodeSpec,
                     gpu_budget_bytes: int | None, lora: Adapters | None, pinned_pow2: bool,
                     concurrent_engines: int) -> Workload:
    """engine.layer_chunk_tokens auto on CUDA: the job at the largest row group of LAYER_CHUNK_CHOICES whose
    plan fits the GPU's memory (or budget); at the smallest when none does (the plan then says what else to
    change)."""
    choices = job.layer_chunk_choices()
    for j in choices:
        q = _plan(shape, pm, j, node, gpu_budget_bytes, lora, False, pinned_pow2, concurrent_engines)
        if q.gpu_bytes <= q.gpu_limit_bytes:
            return j
    return choices[-1]


def _concurrent(n: int, device: str, node: NodeSpec) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadInput(f"concurrent_engines must be an integer >= 1, got {n!r}")
    if device == "cuda" and node.gpus and n > node.gpus:
        raise BadInput(f"concurrent_engines is {n} but node {node.name} has {node.gpus} GPU(s) and runs one "
                       f"engine per GPU; give at most {node.gpus}, or a node with more GPUs")


def _plan(shape: ModelShape, pm: PrecisionMode, job: Workload, node: NodeSpec, gpu_budget_bytes: int | None,
          lora: Adapters | None, suggest: bool, pinned_pow2: bool, concurrent_engines: int = 1) -> Plan:
    assert (lora is None) == (pm.method == "full"), "adapters go with method lora, and only with it"
    host, pinned = host_breakdown(shape, pm, job, lora, pinned_pow2)
    cuda = job.device == "cuda"
    spec_units, spec_params = _update_buffers(shape, pm, job, host, node.usable_ram_bytes)
    if cuda:
        pinned += host["update_buffers"]
    gpu = device_items(shape, pm, job, lora) if cuda else {}
    host_bytes, gpu_bytes = sum(host.values()), sum(gpu.values())
    t = step_time(shape, pm, job, lora, node.ceilings, concurrent_engines, speculated_params=spec_params)
    trainable = shape.num_params if lora is None else adapter_params(lora, shape)
    state = host["weights"] + host["master"] + host["moments"] + host["grads"]
    # a budget caps what the job may take of the GPU; it cannot add memory the GPU does not have
    gpu_limit = node.gpu_mem_bytes if gpu_budget_bytes is None else min(gpu_budget_bytes, node.gpu_mem_bytes)
    host_ok = host_bytes <= node.usable_ram_bytes
    gpu_ok = not cuda or (node.gpus >= job.gpus and gpu_bytes <= gpu_limit)
    chunk = job.layer_chunk_tokens
    assert isinstance(chunk, int), "auto is decided before a plan (Workload.resolved, _auto_row_groups)"
    p = Plan(
        model=shape.name, params=shape.num_params, trainable_params=trainable, method=pm.method, mode=pm.name,
        compute_dtype=job.compute_dtype, device=job.device, seq_len=job.seq_len,
        micro_batch_size=job.micro_batch_size, grad_accum=job.grad_accum, checkpoint_every=job.checkpoint_every,
        tokens_per_step=job.step_tokens, layer_chunk_tokens=chunk, host_bytes=host_bytes,
        gpu_bytes=gpu_bytes, pinned_bytes=pinned,
        host_limit_bytes=node.usable_ram_bytes, gpu_limit_bytes=gpu_limit if cuda else 0,
        fits=host_ok and gpu_ok, short_of=_short_of(cuda, node, job.gpus, host_ok, gpu_ok), reason="",
        breakdown={"host": host, "gpu": gpu},
        bytes_per_param=state / shape.num_params, step_time_s=t["step_s"],
        tokens_per_s=job.step_tokens / t["step_s"],
        mfu=t["model_flops"] / t["step_s"] / node.ceilings.matmul_flops,
        mfu_datasheet=t["model_flops"] / t["step_s"] / node.ceilings.datasheet_matmul_flops, bound=t["bound"],
        assumed_ceilings=node.ceilings.assumed(job.device, moe=t["routed_copies"] > 0,
                                                  adapters=t["adapter_bytes"] > 0),
        timing=t, gives_up=pm.gives_up, engine_supported=pm.engine_supported,
        lora=dataclasses.asdict(lora) if lora else None, node=node.to_dict(), pinned_pow2=pinned_pow2,
        concurrent_engines=concurrent_engines, speculate_units=spec_units, gpus=job.gpus,
    )
    if suggest and not p.fits:
        p.alternatives = _alternatives(shape, p, job, node, gpu_budget_bytes, lora)
    p.reason = _reason(p, node, shape, job, gpu_budget_bytes, lora, host_ok, gpu_ok, suggest)
    return p


def _short_of(cuda: bool, node: NodeSpec, gpus: int, host_ok: bool, gpu_ok: bool) -> list[str]:
    """What the node lacks for the job, in the words the verdicts use."""
    out = [] if host_ok else ["host RAM"]
    if cuda and not gpu_ok:
        out.append("a GPU" if node.gpus == 0 else "GPUs" if node.gpus < gpus else "GPU memory")
    return out


def _alternatives(shape, p: Plan, job: Workload, node, gpu_budget_bytes, lora) -> list[dict[str, Any]]:
    """The other modes on this node, in order of fidelity to exact AdamW."""
    out = []
    for name in FIDELITY_ORDER:
        if name == p.mode:
            continue
        pm = MODES[name]
        dtype = "bfloat16" if pm.needs_bf16 else p.compute_dtype
        # LoRA where the job is not: PEFT's default targets for the family
        adapters = (lora or Adapters(targets=default_lora_targets(shape))) if pm.method == "lora" else None
        other = _plan(shape, pm, replace(job, compute_dtype=dtype), node, gpu_budget_bytes, adapters, False,
                      p.pinned_pow2, p.concurrent_engines)
        out.append({"mode": name, "compute_dtype": dtype, "host_bytes": other.host_bytes,
                    "gpu_bytes": other.gpu_bytes, "fits": other.fits, "engine_supported": pm.engine_supported,
                    "bytes_per_param": round(other.bytes_per_param, 3), "gives_up": pm.gives_up,
                    "short": pm.short,
                    "ram_needed_bytes": node.ram_needed_for(other.host_bytes)})
    return out


def _gib_up(n: int) -> str:
    return f"{math.ceil(n / GiB)} GiB"


def _reason(p: Plan, node: NodeSpec, shape, job, gpu_budget_bytes, lora, host_ok: bool, gpu_ok: bool,
            suggest: bool) -> str:
    ram_txt = (f"{format_bytes(p.host_limit_bytes)} usable ({format_bytes(node.ram_bytes)} less the "
               f"{node.reserve_fraction:.0%} reserve)")
    gpu_txt = f"GPU {format_bytes(p.gpu_bytes)} of {format_bytes(p.gpu_limit_bytes)}" if p.device == "cuda" else ""
    mode_txt = f"mode {p.mode} ({p.bytes_per_param:.1f} B/param)"
    caveat = "" if p.engine_supported else f" Mode {p.mode} is planned only: the engine does not implement it yet."
    if p.fits:
        gives = "" if MODES[p.mode].exact_adamw else f" It gives up {p.gives_up}."
        shared = f" with {p.concurrent_engines} engines sharing the host" if p.concurrent_engines > 1 else ""
        return (f"fits: host {format_bytes(p.host_bytes)} of {ram_txt}" + (f", {gpu_txt}" if gpu_txt else "")
                + f"; {mode_txt}; ~{p.step_time_s:.2f} s/step{shared} ({p.bound} bound).{gives}{caveat}")
    parts = []
    if not host_ok:
        missing = p.host_bytes - p.host_limit_bytes
        parts.append(f"host RAM needs {format_bytes(p.host_bytes)} in {mode_txt} but "
                     f"{ram_txt}: {format_bytes(missing)} missing. In mode {p.mode} a node needs at least "
                     f"{_gib_up(node.ram_needed_for(p.host_bytes))} of RAM.")
        pad = p.breakdown["host"]["pinned_padding"]
        if pad >= GiB:
            verdict = ("would fit" if pad >= missing else
                       f"would still miss {format_bytes(missing - pad)}")
            parts.append(f"{format_bytes(pad)} of the need is torch's rounding of each pinned buffer up to a "
                         f"power of two; pinning with cudaHostRegister instead {verdict}.")
        fitting = [a for a in p.alternatives if a["fits"]]
        if fitting:
            lines = []
            for a in fitting:
                note = "" if a["engine_supported"] else "; not in the engine yet"
                lines.append(f"{a['mode']} ({a['bytes_per_param']:.1f} B/param, {format_bytes(a['host_bytes'])}: "
                             f"{a['short']}{note})")
            parts.append("Modes that fit this node: " + "; ".join(lines) + ".")
            first = next((a for a in fitting if a["engine_supported"]), None)
            if first and not MODES[first["mode"]].exact_adamw:
                parts.append(f"The engine's {first['mode']} gives up {first['gives_up']}.")
        else:
            smallest = min(p.alternatives, key=lambda a: a["host_bytes"], default=None)
            if smallest:
                parts.append(f"No mode fits this node; the smallest, {smallest['mode']}, needs a node with "
                             f"{_gib_up(smallest['ram_needed_bytes'])} of RAM.")
    if p.device == "cuda" and not gpu_ok:
        if node.gpus == 0:
            parts.append("the node has no GPU; plan with device='cpu' or pick a GPU node.")
        elif node.gpus < job.gpus:
            parts.append(f"the job asks for {job.gpus} GPUs (resources.gpus) and node {node.name} has "
                         f"{node.gpus}; lower resources.gpus or pick a node with more GPUs.")
        else:
            missing = p.gpu_bytes - p.gpu_limit_bytes
            acts = sum(p.breakdown["gpu"][k] for k in ("checkpoints", "recompute_inputs", "hidden_states"))
            parts.append(f"GPU memory needs {format_bytes(p.gpu_bytes)} but "
                         f"{format_bytes(p.gpu_limit_bytes)} are available: {format_bytes(missing)} missing "
                         f"(activations of the {p.tokens_per_step}-token step: {format_bytes(acts)}).")
            if gpu_budget_bytes is not None and gpu_budget_bytes > node.gpu_mem_bytes:
                parts.append(f"The GPU budget of {format_bytes(gpu_budget_bytes)} is more than the GPU has "
                             f"({format_bytes(node.gpu_mem_bytes)}): the GPU's memory is the limit.")
            fix = _gpu_fix(shape, p, job, node, gpu_budget_bytes, lora) if suggest else ""
            if fix:
                parts.append(fix)
    return "does not fit: " + " ".join(parts) + caveat


def _row_group_fix(job: Workload, j: Workload) -> str:
    changed = []
    if j.rows_per_group != job.rows_per_group:
        rows = j.rows_per_group
        changed.append((f"engine.layer_chunk_tokens={j.layer_chunk_tokens}",
                        f"{rows} row{'s' * (rows > 1)} at a time through each layer instead of {job.rows_per_group}"))
    if j.loss_chunk_tokens != job.loss_chunk_tokens:
        changed.append((f"engine.loss_chunk_tokens={j.loss_chunk_tokens}",
                        f"logits of {j.loss_chunk_tokens} tokens at a time instead of {job.loss_chunk_tokens}"))
    return (f"It fits with {' and '.join(c for c, _ in changed)} (the same batches and step, "
            f"{'; '.join(w for _, w in changed)}).")


def _gpu_fix(shape, p: Plan, job: Workload, node, gpu_budget_bytes, lora) -> str:
    """The first of a few job changes that fits the GPU: smaller row groups and loss chunks down to 1,024
    tokens (the same batches and step), smaller micro-batches at the same tokens per step, loss chunks below
    1,024 tokens, another checkpoint interval, then fewer tokens per step."""
    def fits(j: Workload) -> bool:
        q = _plan(shape, MODES[p.mode], j, node, gpu_budget_bytes, lora, False, p.pinned_pow2, p.concurrent_engines)
        return q.gpu_bytes <= p.gpu_limit_bytes

    # Row groups first, and loss chunks down to 1,024 tokens with them: neither changes the batches or the
    # step, and both keep their GEMMs large; the largest row group that fits wins, then the largest loss chunk.
    losses = [job.loss_chunk_tokens]
    while losses[-1] // 2 >= 1024:
        losses.append(losses[-1] // 2)
    rows = job.rows_per_group
    while rows >= 1:
        for loss in losses:
            j = replace(job, layer_chunk_tokens=rows * job.seq_len, loss_chunk_tokens=loss)
            if j != job and fits(j):
                return _row_group_fix(job, j)
        rows //= 2
    mb, ga = job.micro_batch_size, job.grad_accum
    # only divisors of the micro-batch keep micro x accum, i.e. the tokens of a step, the same
    divisors = {d for i in range(1, math.isqrt(mb) + 1) if mb % i == 0 for d in (i, mb // i)}
    for smaller in sorted(divisors - {mb}, reverse=True):
        j = replace(job, micro_batch_size=smaller, grad_accum=ga * (mb // smaller))
        if fits(j):
            return (f"It fits with micro_batch_size={smaller} and grad_accum={j.grad_accum} (same tokens per step, "
                    "fewer at once through a layer).")
    chunk = losses[-1]  # the larger chunks were tried with the row groups
    while chunk > 256:
        chunk //= 2
        if fits(replace(job, loss_chunk_tokens=chunk)):
            return f"It fits with loss_chunk_tokens={chunk} (smaller chunks of [tokens x vocab] logits)."
    for k in (1, 2, 4, 8, 16):
        j = replace(job, checkpoint_every=k)
        if k != job.checkpoint_every and fits(j):
            return f"It fits with checkpoint_every={k}."
    chunk = min(job.loss_chunk_tokens, 1024)
    j = replace(job, micro_batch_size=1, loss_chunk_tokens=chunk)
    for ga in range(job.grad_accum * job.micro_batch_size, 0, -1):
        j = replace(j, grad_accum=ga)
        if fits(j):
            return (f"It fits with at most {ga * job.seq_len} tokens per step (micro_batch_size=1, "
                    f"grad_accum={ga}, loss_chunk_tokens={chunk}).")
    return "Even one sequence per step does not fit: shorten seq_len."


# ---- the largest model of a family --------------------------------------------------------------------------


@dataclass
class MaxModel:
    """The largest shape of a family that fits a node in a mode."""

    family: str
    mode: str
    shape: ModelShape | None  # None when nothing fits
    plan: Plan | None  # its plan
    tried: list[dict[str, Any]]  # every shape planned: name, params, host_bytes, gpu_bytes, fits

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "mode": self.mode, "engine_supported": MODES[self.mode].engine_supported,
                "model": self.shape.name if self.shape else None,
                "params": self.shape.num_params if self.shape else None, "tried": self.tried,
                "plan": self.plan.to_dict() if self.plan else None}


def max_model(family: str | list = "qwen2.5", node: NodeSpec | None = None, mode: str = "exact", *,
              scan_depth: bool = False, **job) -> MaxModel:
    """The largest model of ``family`` that a node can fine-tune in ``mode``.

    ``family``: a name of ``FAMILIES`` (qwen2.5, llama-3, dense, all) or a list of models. With
    ``scan_depth``, also the deepest stack of the next larger preset's layer that fits (a finer answer
    between two presets). ``job``: plan()'s training keywords.
    """
    node = node or H200_NODE
    if isinstance(family, str):
        if family.lower() not in FAMILIES:
            raise BadInput(f"unknown family {family!r}; known families: {', '.join(FAMILIES)}")
        shapes = [PRESETS[n] for n in FAMILIES[family.lower()]]
        label = family.lower()
    else:
        shapes = [load_model_shape(m) for m in family]
        label = "custom"
    shapes.sort(key=lambda s: s.num_params)
    method = "lora" if mode == "lora" else "full"
    tried, best, best_plan = [], None, None

    def attempt(shape: ModelShape) -> Plan | None:
        try:
            q = plan(shape, method=method, mode=mode, node=node, suggest=False, **job)
        except BadInput as exc:  # e.g. LoRA targets the family lacks (Phi-3 fuses q, k and v)
            if isinstance(family, list):
                raise
            tried.append({"model": shape.name, "params": shape.num_params, "fits": False, "refused": exc.message})
            return None
        tried.append({"model": shape.name, "params": shape.num_params, "host_bytes": q.host_bytes,
                      "gpu_bytes": q.gpu_bytes, "fits": q.fits})
        return q

    bigger = None
    for shape in shapes:
        q = attempt(shape)
        if q is None:
            continue
        if q.fits:
            best, best_plan = shape, q
        elif bigger is None and (best is None or shape.num_params > best.num_params):
            bigger = shape
    if scan_depth and bigger is not None:
        lo, hi = 1, bigger.num_layers - 1  # deepest fitting stack of `bigger`'s layer, by bisection
        found = None
        while lo <= hi:
            mid = (lo + hi) // 2
            q = attempt(bigger.with_layers(mid))
            if q is not None and q.fits:
                found, lo = (bigger.with_layers(mid), q), mid + 1
            else:
                hi = mid - 1
        if found and (best is None or found[0].num_params > best.num_params):
            best, best_plan = found
    return MaxModel(family=label, mode=mode, shape=best, plan=best_plan, tried=tried)


# ---- text ---------------------------------------------------------------------------------------------------


def recomputation(every: int) -> str:
    """engine.activation_checkpoint_every in words: the backward recomputes each block from the input kept every
    `every` layers (not a job checkpoint)."""
    return f"activation recomputation every {every} layer{'s' if every != 1 else ''}"


def format_plan(p: Plan) -> str:
    """The plan as a readable table."""
    rows = [f"model        {p.model}: {human_params(p.params)} params"
            + (f", {human_params(p.trainable_params)} trainable" if p.trainable_params != p.params else ""),
            f"job          {p.method}, mode {p.mode}"
            + (f", base {p.lora['quantize']}" if p.lora and p.lora.get("quantize", "none") != "none" else "")
            + f", {p.compute_dtype} on {p.device}; seq {p.seq_len} x micro "
            f"{p.micro_batch_size} x accum {p.grad_accum} = {p.tokens_per_step} tokens/step; "
            f"{recomputation(p.checkpoint_every)}; row groups of at most {p.layer_chunk_tokens:,} tokens",
            f"node         {format_bytes(p.node.get('ram_bytes', 0))} RAM, "
            f"{p.node.get('gpus', 0)} GPU x {format_bytes(p.node.get('gpu_mem_bytes', 0))}", ""]
    for side, total, limit in (("host", p.host_bytes, p.host_limit_bytes), ("gpu", p.gpu_bytes, p.gpu_limit_bytes)):
        items = p.breakdown[side]
        if not items:
            continue
        rows.append(f"{side.upper():<22}{'bytes':>14}{'GiB':>11}")
        for k, v in items.items():
            if v:
                rows.append(f"  {k:<20}{v:>14,}{v / GiB:>11.2f}")
        rows.append(f"  {'total':<20}{total:>14,}{total / GiB:>11.2f}   (limit {limit / GiB:.1f} GiB)")
        rows.append("")
    if p.device == "cuda":
        t = p.timing
        c = p.node.get("ceilings", {})
        rows.append(f"STEP         {p.step_time_s:.2f} s, {p.tokens_per_s:,.0f} tokens/s ({p.bound} bound)")
        rows.append(f"  MFU {p.mfu:.1%} of {c.get('matmul_flops', 0) / 1e12:.1f} TFLOP/s measured, "
                    f"{p.mfu_datasheet:.1%} of {c.get('datasheet_matmul_flops', 0) / 1e12:.1f} datasheet "
                    "(model FLOPs: 6 N + 6 L heads head_dim seq per token)")
        rows.append(f"  compute {t['compute_s']:.2f} s (fwd {t['forward_s']:.2f}, bwd {t['backward_s']:.2f}); "
                    f"pcie {t['pcie_s']:.2f} s; cpu optimizer {t['optimizer_s']:.2f} s; exposed "
                    f"{t['exposed_s']:.2f} s")
    else:
        rows.append(f"STEP         {p.step_time_s:.2f} s, {p.tokens_per_s:,.0f} tokens/s (CPU, {p.bound} bound)")
    c = p.node.get("ceilings", {})
    measured = [k for k in Ceilings.used(p.device) if k in c.get("measured", ())]
    line = (f"ceilings: {c.get('source', '?')}" + (f"; measured there: {', '.join(measured)}" if measured else "")
            + (f"; assumed: {', '.join(p.assumed_ceilings)}" if p.assumed_ceilings else ""))
    rows += textwrap.wrap(line, width=110, initial_indent="  ", subsequent_indent="    ")
    if p.concurrent_engines > 1:
        rows.append(f"  per engine, with {p.concurrent_engines} engines sharing the host's DRAM bandwidth and "
                    f"cores; the node: {p.node_tokens_per_s:,.0f} tokens/s")
    if p.fits:
        head, body = "FITS", p.reason.removeprefix("fits: ")
    else:
        head, body = f"DOES NOT FIT ({' and '.join(p.short_of)})", p.reason.removeprefix("does not fit: ")
    # a number and its unit stay on one line
    text = re.sub(r"(\d) (GiB|MiB|B/param|s\b)", "\\1\u00a0\\2", f"{head}: {body}")
    rows += ["", *(line.replace("\u00a0", " ") for line in textwrap.wrap(text, width=110, subsequent_indent="  "))]
    return "\n".join(rows)
