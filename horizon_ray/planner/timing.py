"""Predicted step time: a roofline of GPU compute, PCIe copies and the CPU optimizer, with the overlap
the engine's schedule allows.

Work of one optimizer step (T tokens, L layers, K checkpoint interval, S sequence length):

    layer forward FLOPs per token   f = 2 x (projection weights) + 2 x heads x head_dim x S (causal)
    forward                         L x f                      (no autograd)
    backward                        (L - ceil(L/K)) x f        recompute of each block's other inputs
                                    + L x (f - d)              each layer's forward again, under autograd,
                                                               but for d = 2 x its last projection's weights
                                                               where nothing else reads its product (a dense
                                                               MLP's down projection without a norm after it
                                                               or an adapter on it: layers.Deferred)
                                    + L x 2f                   its backward (LoRA: dX only for the frozen
                                                               projections, so 1 x their share)
    loss                            6 x V x H per token        LM head forward + backward, fused in chunks
    GPU time = FLOPs / (matmul_flops x compute_efficiency)

    PCIe: every unit's streamed copy (compute dtype; a quantized base's layers packed) crosses once in the
    forward; layers cross again in the backward except the top two blocks, still resident (L - 2K layers);
    each unit's gradient leaves
    once (in the compute dtype; LoRA: the fp32 adapters only, which stay resident on the device and cross
    once a step, after their update); offloaded activation checkpoints leave in the forward and come back
    in the backward. Concurrent H2D and D2H share duplex_bytes_per_s.

    CPU optimizer: the bytes the update moves per parameter (modes.ParamBytes.optimizer_bytes: 28 B for
    exact in bf16), at the bandwidth the measured fused AdamW reached (adam_bytes_per_param x
    adam_params_per_s; x adam_params_per_s_with_copies while PCIe copies run at the same time).

Overlap model (the engine's schedule, ``engine.py`` / ``optimizer.py``): clipping needs the global norm,
so the update of step n starts when its backward ends and runs unit by unit in forward order, while the
forward of step n+1 streams each unit as soon as its update is written. Hence

    step = exposed + max(forward compute, forward copies, optimizer)          phase A
                   + max(backward + loss compute, backward copies)            phase B

where "exposed" is what nothing hides: the embedding's update and upload before the first lookup, and
its gradient's download after the last layer. Within a phase, copies and compute of different units
overlap fully (double buffering); the optimizer runs at the with-copies rate while phase A's copies run
and at its own rate once they are done (``update_seconds``). The delayed update (step n+1 trains on the
weights after step n-1) runs through the whole of the next step, so it shares DRAM with the copies of both
phases and then runs alone: the step is max(phase A + phase B, that update). The speculative update runs its
speculated units during the backward, beside phase B's copies, and the rest as exact does. (Until 2026-12-05
the delayed update was planned at the with-copies rate throughout: 2.57 s for olmoe-1b-7b's 1.44-1.61 s, and
qwen2.5-7b's 16,384-token step 2.86 s against 1.60 s measured.)
On device "cpu" nothing overlaps: step = compute at cpu_flops (the engine's sustained rate on the host, as
the probe measures it) + optimizer at its no-copies rate.

N engines on one host (``concurrent_engines``: one job per GPU, all drawing on the node's RAM): each GPU has
its own PCIe link and its own compute, but the host's DRAM and cores are shared. The CPU AdamW is bound by
DRAM bandwidth and the cores, which the agent splits evenly, so each engine's update runs at 1/N of the
measured rates (alone and with copies). Every link's DMA reads and writes the same DRAM, so each engine's
copies run at min(its link's rate, host_copy_bytes_per_s / N). GPU compute is not shared. On device
"cpu", the N engines split the cores: compute and optimizer both at 1/N. The step time and tokens/s are
those of one engine while N run; the node's throughput is N times that.

A mixture-of-experts layer also spends GPU time its FLOPs do not show: gathering each token's k copies by
expert, grouped GEMMs of a few hundred rows an expert, the routing weights, the scatter back and the sum over
k. That is ``Ceilings.moe_copy_s`` seconds per routed token copy (at hidden 2048, scaled by the hidden size)
over the whole step at K = 1, a quarter of it in the forward and the rest in the backward's passes.

A LoRA adapter on a dense projection also passes over activations its FLOPs do not show (``layers._LoraLinear``):
each forward pass reads the projection's input for the [tokens, r] product and adds the adapter's output into the
projection's (in + 2 out elements a token); the backward reads the output gradient twice and the input once for
the adapter's gradients and adds its input gradient into the projection's (3 in + 2 out). Adapters of projections
that share their input (q, k, v; gate, up) make the in passes once for all (``layers._LoraLinears``). Those
bytes, pass by pass as the FLOPs count them, run at ``Ceilings.adapter_bytes_per_s``. The experts' adapters are
not counted here: their passes are in the routing's ``moe_copy_s``, fitted on LoRA steps. Those steps' attention
adapters are in that fit too, so a MoE LoRA plan counts their passes twice (0.07 s of olmoe-1b-7b's 65,536-token
step, 0.22 s of qwen3-30b-a3b's), until a profiled step separates them. It assumes no dropout: with dropout each
adapter reads its input apart (the masks differ by projection), and the masks add passes of their own.

Calibration. ``Ceilings.compute_efficiency``, ``Ceilings.moe_copy_s`` and ``Ceilings.adapter_bytes_per_s`` are
the numbers fitted to the engine rather than measured (the second on profiled MoE steps, the third on a LoRA
step: see their fields). For the first: on the H200 box (commit cea6a8e, Qwen2.5-7B, seq 1024, bf16, 12 GiB GPU
budget, K=1, Liger kernels) exact AdamW measured 3.15 s a step at 16,384 tokens and 6.64 s at 65,536 (host update
of 7.6 G parameters 1.8-2.0 s); with 0.72 the plan says 3.14 s (-0.3 %) and 6.88 s (+3.6 %). With the earlier
0.55 it said 3.52 s and 8.69 s (+12 % and +31 %). On device "cpu" the rate is the node's own: ``horizon-ray
probe`` times the engine on a small reference model and divides this module's FLOP count by the seconds
(``horizon_ray.probe``); the demo's predicted and measured steps agree within 25 % (benchmarks/plan_vs_run.py).
Whatever a plan takes from the defaults rather than from its node's probe is listed as assumed
(``Ceilings.assumed``). The plan is what the ceilings allow; a slower engine shows as the measured step exceeding
it.
"""

from __future__ import annotations

from typing import Any

from horizon_ray.engine.model import DTYPE_BYTES, LORA_SHARED_INPUTS, layer_targets
from horizon_ray.errors import BadInput
from horizon_ray.models.blocks import EXPERT_TARGETS, DenseMLP
from horizon_ray.planner.memory import unit_wire_bytes
from horizon_ray.planner.modes import PrecisionMode
from horizon_ray.planner.node import Ceilings
from horizon_ray.planner.shapes import ModelShape, adapter_active_layer_params, adapter_layer_params, ceil_div
from horizon_ray.workload import Adapters, Workload


def flops_params(shape: ModelShape) -> int:
    """N of the house convention: the weights a token's matmuls multiply by, i.e. the projections of every
    layer (of a MoE layer: the router and the token's top-k experts) and the LM head. The embedding is a
    lookup, norms and biases are elementwise (no matmul)."""
    return shape.active_matmul_params + shape.vocab_size * shape.hidden_size


def model_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """The house convention: 6 N + 6 L heads head_dim S per token, forward and backward,
    causal attention, recompute not counted. The planner's MFU and the benchmark's both use it."""
    return 6 * flops_params(shape) + 6 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len


def model_flops(shape: ModelShape, seq_len: int, tokens: int) -> float:
    """Model FLOPs of a step of ``tokens`` tokens (house convention)."""
    return model_flops_per_token(shape, seq_len) * tokens


def host_share(ceil: Ceilings, concurrent_engines: int = 1) -> dict[str, float]:
    """The rates one engine sees while `concurrent_engines` engines share the host (bytes/s)."""
    n = concurrent_engines
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadInput(f"concurrent_engines must be an integer >= 1, got {n!r}")
    host_copy = ceil.host_copy_bytes_per_s / n
    return {"adam_bytes_per_s": ceil.adam_bytes_per_param * ceil.adam_params_per_s / n,
            "adam_bytes_per_s_with_copies": ceil.adam_bytes_per_param * ceil.adam_params_per_s_with_copies / n,
            "h2d_bytes_per_s": min(ceil.h2d_bytes_per_s, host_copy),
            "d2h_bytes_per_s": min(ceil.d2h_bytes_per_s, host_copy),
            "duplex_bytes_per_s": min(ceil.duplex_bytes_per_s, host_copy),
            "cpu_flops": ceil.cpu_flops / n}


def deferred_params(shape: ModelShape, lora: Adapters | None) -> int:
    """Weights of the projections the backward's recompute does not run (``layers.Deferred``): each dense layer's
    down projection, where no norm follows it and no adapter is on it."""
    if lora is not None and "down_proj" in lora.targets:
        return 0
    return sum(layer.mlp.width * shape.hidden_size for layer in shape.layers
               if isinstance(layer.mlp, DenseMLP) and not layer.sandwich_norms)


def adapter_passes(shape: ModelShape, lora: Adapters | None) -> tuple[int, int]:
    """Activation elements a token's dense-projection adapters read or write beyond their frozen projections,
    summed over the layers: (in one forward pass of every layer, in the backward's own passes). Each adapter
    reads its output gradient twice and adds into its output; adapters of one input (model.LORA_SHARED_INPUTS)
    read it once a forward pass, and once for their A gradients and once to add their input gradient in the
    backward."""
    forward = backward = 0
    if lora is None:
        return 0, 0
    group = {name: names for names in LORA_SHARED_INPUTS for name in names}
    for i in range(shape.num_layers):
        targets = layer_targets(shape, i)
        adapted = [name for name in lora.targets if name not in EXPERT_TARGETS and name in targets]
        for name in adapted:
            forward += 2 * targets[name][2][1]
            backward += 2 * targets[name][2][1]
        inputs = {group.get(name, (name,)): targets[name][2][0] for name in adapted}
        forward += sum(inputs.values())
        backward += 3 * sum(inputs.values())
    return forward, backward


def update_seconds(work: float, copies_s: float, bw_copies: float, bw_alone: float) -> float:
    """Seconds the host update of ``work`` bytes takes when PCIe copies run for the first ``copies_s`` of it: it
    moves bytes at the with-copies rate while they run (both draw on the host's DRAM) and at its own rate after."""
    if work <= copies_s * bw_copies:
        return work / bw_copies
    return copies_s + (work - copies_s * bw_copies) / bw_alone


def step_time(shape: ModelShape, mode: PrecisionMode, job: Workload, lora: Adapters | None, ceil: Ceilings,
              concurrent_engines: int = 1, speculated_params: int = 0) -> dict[str, Any]:
    """Seconds of each term and the predicted step of one engine while `concurrent_engines` engines share
    the host, plus the name of the bound. ``speculated_params``: parameters the speculative update may update
    during the backward (Plan.speculate_units' units)."""
    # several ranks of one job share the host like as many engines, and each moves its 1/N of the gradients
    # and of the update (ranks.py); each GPU runs its own tokens_per_step and streams every unit
    share = host_share(ceil, concurrent_engines * job.gpus)
    compute_dtype = job.compute_dtype
    c = DTYPE_BYTES[compute_dtype]
    L, H, V = shape.num_layers, shape.hidden_size, shape.vocab_size
    K = min(job.checkpoint_every, max(L, 1))
    tokens, seq_len = job.tokens_per_step, job.seq_len
    full = mode.method == "full"
    # the adapters of all layers (layers may differ: a dense layer has no expert adapter)
    adapters = 0 if lora is None else sum(adapter_layer_params(lora, shape, i) for i in range(L))

    # a token's matmuls, per layer on average: a MoE layer's router and top-k experts (and their adapters), not
    # every expert
    f_mm = 2.0 * shape.active_matmul_params / L
    f_attn = 2.0 * shape.q_dim * seq_len
    f_adapter = 0.0 if lora is None else 2.0 * sum(adapter_active_layer_params(lora, shape, i) for i in range(L)) / L
    f = f_mm + f_attn + f_adapter
    f_deferred = 2.0 * deferred_params(shape, lora) / L
    backward = (2 * f_mm if full else f_mm) + 2 * f_attn + 2 * f_adapter
    fwd_flops = tokens * L * f
    bwd_flops = tokens * ((L - ceil_div(L, K)) * f + L * (f - f_deferred) + L * backward + (6 if full else 4) * V * H)
    # the adapters' passes over activations: every forward pass of a layer (the forward, the recompute of the
    # blocks' other layers, each layer again under autograd) and the backward's own
    a_fwd, a_bwd = adapter_passes(shape, lora)
    adapter_fwd_bytes = tokens * a_fwd * c
    adapter_bwd_bytes = tokens * (a_fwd * (2 * L - ceil_div(L, K)) // max(L, 1) + a_bwd) * c
    # token copies the MoE layers route in one pass over the step's tokens (top-k of each MoE layer)
    routed = tokens * sum(layer.moe.top_k for layer in shape.layers if layer.moe is not None)

    # bytes over PCIe and through the optimizer, unit by unit
    pb = mode.base(compute_dtype)
    wire = unit_wire_bytes(shape, lora, mode, c)  # a quantized base's layers cross packed
    grads_down: float = shape.num_params * pb.grad_bytes
    opt_work: float = shape.num_params * pb.optimizer_bytes
    if not full:
        adapter = mode.adapter()
        grads_down += adapters * adapter.grad_bytes
        opt_work += adapters * adapter.optimizer_bytes
    adapter_wire = adapters * 4
    embed_opt_work: float = shape.embed_params * pb.optimizer_bytes
    embed_grad_down: float = shape.embed_params * pb.grad_bytes
    grads_down, opt_work = grads_down / job.gpus, opt_work / job.gpus
    embed_opt_work, embed_grad_down = embed_opt_work / job.gpus, embed_grad_down / job.gpus
    checkpoints = ceil_div(L, K) * tokens * H * c if job.offload_checkpoints else 0
    h2d_fwd = sum(wire.values()) + adapter_wire - wire["embed"]
    # the layers the backward streams again, at the mean layer's bytes (layers may differ: dense and MoE)
    layer_wire = sum(n for name, n in wire.items() if name.startswith("layer."))
    h2d_bwd = max(0, L - 2 * K) * layer_wire // max(L, 1) + checkpoints

    bw_alone, bw_copies = share["adam_bytes_per_s"], share["adam_bytes_per_s_with_copies"]
    h2d_bw, d2h_bw, duplex_bw = share["h2d_bytes_per_s"], share["d2h_bytes_per_s"], share["duplex_bytes_per_s"]
    out: dict[str, Any] = {
        "fwd_flops": fwd_flops, "bwd_flops": bwd_flops, "model_flops": model_flops(shape, seq_len, tokens),
        "h2d_bytes": h2d_fwd + wire["embed"] + h2d_bwd, "d2h_bytes": grads_down + checkpoints,
        "optimizer_bytes": opt_work, "concurrent_engines": concurrent_engines, "host_share": share,
        "routed_copies": routed, "adapter_bytes": adapter_fwd_bytes + adapter_bwd_bytes}
    if job.device == "cpu":
        cpu_flops = share["cpu_flops"]
        compute = (fwd_flops + bwd_flops) / cpu_flops
        opt = opt_work / bw_alone
        out.update(compute_s=compute, forward_s=fwd_flops / cpu_flops, backward_s=bwd_flops / cpu_flops,
                   pcie_s=0.0, optimizer_s=opt, exposed_s=0.0, step_s=compute + opt,
                   bound="cpu compute" if compute >= opt else "cpu optimizer")
        return out

    rate = ceil.matmul_flops * ceil.compute_efficiency
    # the routing's GPU work beyond FLOPs (Ceilings.moe_copy_s), pass by pass as the FLOPs count them: the
    # forward, the recompute of the blocks' other layers, each layer again under autograd and its backward (~2x)
    copy_s = ceil.moe_copy_s * H / 2048
    route_fwd_s = routed * copy_s / 4
    route_bwd_s = routed * copy_s / 4 * ((L - ceil_div(L, K)) / max(L, 1) + 1 + 2)
    adapter_bw = ceil.adapter_bytes_per_s
    fwd_s = fwd_flops / rate + route_fwd_s + adapter_fwd_bytes / adapter_bw
    bwd_s = bwd_flops / rate + route_bwd_s + adapter_bwd_bytes / adapter_bw
    # phase A: weights in, checkpoints out; phase B: the rest of the weights and checkpoints in, gradients out
    copies_fwd_s = max(h2d_fwd / h2d_bw, checkpoints / d2h_bw, (h2d_fwd + checkpoints) / duplex_bw)
    copies_bwd_s = max(h2d_bwd / h2d_bw, grads_down / d2h_bw, (h2d_bwd + grads_down) / duplex_bw)
    # speculative: the speculated units' update runs during the backward (with its copies), the rest as in exact
    spec_work = speculated_params * pb.optimizer_bytes if job.update == "speculative" and full else 0
    spec_s = update_seconds(spec_work, copies_bwd_s, bw_copies, bw_alone)
    opt_s = update_seconds(opt_work - embed_opt_work - spec_work, copies_fwd_s, bw_copies, bw_alone)
    exposed = embed_opt_work / bw_alone + wire["embed"] / h2d_bw + embed_grad_down / d2h_bw
    phase_a = max(fwd_s, copies_fwd_s, opt_s)
    phase_b = max(bwd_s, copies_bwd_s, spec_s)
    bound_a = max((fwd_s, "gpu compute"), (copies_fwd_s, "pcie"), (opt_s, "cpu optimizer"))[1]
    bound_b = max((bwd_s, "gpu compute"), (copies_bwd_s, "pcie"), (spec_s, "cpu optimizer"))[1]
    if job.update == "delayed" and full:
        # the whole update overlaps the next step: nothing of it is exposed, it bounds the step only if longer;
        # it shares DRAM with the step's copies, forward and backward, while they run
        opt_s = update_seconds(opt_work, copies_fwd_s + copies_bwd_s, bw_copies, bw_alone)
        exposed = wire["embed"] / h2d_bw + embed_grad_down / d2h_bw
        phase_a, phase_b = max(fwd_s, copies_fwd_s), max(bwd_s, copies_bwd_s)
        if opt_s > phase_a + phase_b:
            phase_a, bound_a, bound_b = opt_s - phase_b, "cpu optimizer", "cpu optimizer"
    # what a speculative rollback adds to its step: inverting the speculated units (about one update of them,
    # exposed after the backward) and updating them again, clipped
    rollback_s = 2 * spec_work / bw_alone
    bound = bound_a if bound_a == bound_b else f"{bound_a} (forward + update), {bound_b} (backward)"
    out.update(compute_s=fwd_s + bwd_s, forward_s=fwd_s, backward_s=bwd_s, pcie_s=copies_fwd_s + copies_bwd_s,
               pcie_forward_s=copies_fwd_s, pcie_backward_s=copies_bwd_s, optimizer_s=opt_s, exposed_s=exposed,
               phase_a_s=phase_a, phase_b_s=phase_b, step_s=exposed + phase_a + phase_b, bound=bound,
               speculated_update_s=spec_s, rollback_s=rollback_s)
    return out
