"""Host and GPU bytes of one job, item by item, as the engine allocates them.

Host (``horizon_ray.engine.store``, ``stash``, ``slots``): the per-unit buffers of the mode (see ``modes``), the
activation checkpoints (offloaded to pinned host buffers on CUDA, the engine's default), the rounding of
pinned buffers, the optimizer's scratch chunk, the process baseline, and the load's transient: loading
materialises one tensor at a time before copying it into its unit (the safetensors read, or
from_config's random init), at most an fp32 tensor of the model's largest shape. The load ends before
the first step allocates the checkpoint buffers and the scratch chunk, so ``load_staging`` counts only
what the load needs beyond those (the host peak is the larger of the two phases). On device "cpu" the
engine's device-side working set (checkpoints, a layer's autograd workspace, the loss chunk) lives in
host RAM and is counted there.

GPU (``slots``, ``grads``, ``stash`` and ``engine``), c = bytes of the compute dtype, T = tokens of the
optimizer step (all micro-batches), m = tokens of one row group (a micro-batch split at layer_chunk_tokens),
K = checkpoint interval, L = layers:

    weight_slots       2 x min(K, L) x layer x c     two groups of K layer slots (a block + the next one)
    embed_slot         V x H x c, tied only          (untied: rows are gathered on the host, T x H crosses)
    head_slot          (H [+ V x H untied]) x c
    grad_accumulators  fp32: layers 1 (bf16: cast at once into staging) or 2 (fp32) x layer, plus
                       V x H + H if tied, else one V x H shared by embed and head
    grad_staging       2 x layer x c                 a layer's gradient cast before D2H (bf16 only)
    adapter_slots      (2 min(K, L) + 1 [+ 1 tied]) x adapter unit x 4   LoRA: an fp32 adapter slot beside each
                                                     weight slot: a layer's adapters travel with its base
    adapter_grads      2 x adapter unit x 4          LoRA: two pooled fp32 gradient buffers (no base accumulators)
    checkpoints        offloaded: 2 x T x H x c      the block's checkpoint back on the device and the next
                                                     one returning; not offloaded: ceil(L/K) x T x H x c
    recompute_inputs   (min(K, L) - 1) x T x H x c   the block's other inputs, recomputed in backward
    hidden_states      2 x T x H x c                 a layer's input and output lists (dL/dy and dL/dx)
    layer_workspace    one row group through one layer under autograd (LAYER_* coefficients below)
                       (+ on the CPU the layer's weight gradients, each through a product tensor; on CUDA
                       they accumulate inside the GEMMs); with LoRA
                       + an adapter backward's [tokens, in + out] of the widest target; with a quantized
                       base + the layer dequantized (layer x c) while it is read
    (quantized base: weight_slots hold the largest packed layer, model.packed_layer_bytes, not layer x c)
    loss_workspace     chunk x V x c + r x V x (12 + 2c)   a loss chunk's logits (their gradient overwrites
                       them) and torch's cross-entropy temporaries (fp32 copy, log-softmax, gradients) of the
                       r = model.torch_ce_rows rows it takes at once, at most the logits' bytes (Liger's
                       kernel has none); on the CPU + V x H x c, the LM head's dL/dW product; counted beyond
                       layer_workspace only, as the two are never live together
    rope_and_masks     cos/sin tables 2 x T x head_dim x c, ids/targets 16 x T, packing masks T x seq
    allocator_slack    ALLOCATOR_SLACK x the items above: caching-allocator rounding and fragmentation
    cuda_context       CUDA_CONTEXT_BYTES: context, cuBLAS and SDPA workspaces (outside torch's allocator)

The activation coefficients are a model of what ``layers.Template.layer`` keeps for its backward. On the
H200 box (2026-11-29, seq 1024, micro-batch 16, bf16) torch's peak reserved memory was 95 % (Qwen2.5-1.5B,
32k tokens, K=1), 93 % (same, K=4) and 85 % (Qwen2.5-7B, 64k tokens, K=4) of the plan without the CUDA
context; the host's pinned bytes (torch.cuda.host_memory_stats) equalled the plan's pinned bytes exactly.
Checked again on 2026-12-05 against the 63 newest H200 rows of benchmarks/results (Liger kernels, 12-24 GiB
budgets): the engine's own device buffers (``device_bytes`` in each row: slots, accumulators, staging) equal
the plan's items to the byte; the rest of the peak (max_memory_allocated) was 0.26-0.92x of what the plan then
counted beside them. Two items were a model of code that had changed: the loss chunk's 16 bytes a logit (the
torch cross-entropy over the whole chunk at once) and a layer-sized weight gradient that CUDA accumulates inside
the GEMM; without them the plan is 1.13-1.66x the peak allocated (was 1.15-2.62x), never below it, and no longer refuses
qwen2.5-7b or gemma-3-4b at 12 GiB (which peaked at 8.1-9.7 and 8.0 GiB). What remains above the peak is
the saved activations' coefficients (LAYER_*, unchanged: a model of the torch ops, which keep more than Liger's)
and of the mixture-of-experts' routed copies (1.2-1.5x on olmoe-1b-7b and qwen3-30b-a3b).
Profiled on 2026-12-05 (the allocator's history replayed to the step's peak, benchmarks/README.md): the peaks of
qwen3-4b and qwen2.5-7b held 3.5 GiB of layer outputs that the engine had freed while the GPU lagged the host
(their blocks marked used by the copy stream) and two loss chunks' logits where one was needed; both are fixed
in the engine. Profiled again after the fixes (c6536ed, H100, 16,384-token row groups, Liger kernels): the peak
moved into the backward and torch's reserved memory fell from 11.4 to 7.2 GiB (qwen3-4b) and from 11.8 to 7.0 GiB
(llama-3.2-3b), while the allocated peak stayed (6.8 and 6.7 GiB). The plan is now 1.25x, 1.26x and 1.24x
(qwen2.5-7b, exact) of reserved memory plus the CUDA context; before the fixes it was below them on the first two.
The whole excess is in the activations (checkpoints, hidden_states, layer_workspace: 1.53-1.58x of what the
step held beyond the engine's buffers). The coefficients stay: they model the torch ops that a job without
Liger-Kernel runs, and there (same call, Liger's wheel left out) the activations' items were 1.11x (qwen3-4b) and
1.06x (qwen2.5-7b, 8,192-token row groups) of what the step held, the whole plan 1.05x and 1.002x of reserved
memory plus the context.
"""

from __future__ import annotations

import math

from horizon_ray.engine.model import (
    DTYPE_BYTES,
    EXPERT_TARGETS,
    TORCH_CE_BYTES_PER_LOGIT,
    layer_entries,
    packed_layer_bytes,
    projection_shapes,
    stored_nested,
    torch_ce_rows,
)
from horizon_ray.models.blocks import MoE
from horizon_ray.planner.modes import ParamBytes, PrecisionMode
from horizon_ray.planner.node import MiB
from horizon_ray.planner.shapes import ModelShape, adapter_unit_params, ceil_div
from horizon_ray.workload import Adapters, Workload

# RSS of a process that imported torch and built an engine, beyond the engine's own buffers.
# Measured: CPU build on the dev machine: 277 MiB after `import torch`, 326 MiB after a first matmul
# (thread pools). CUDA build on the H200 box: 492 MiB after `import torch`, 615 MiB with a CUDA context,
# 825 MiB after cuBLAS and SDPA ran; with the engine training (Qwen2.5-1.5B K=1 / K=4, Qwen2.5-7B K=4,
# bf16, 2026-11-29) the RSS exceeded the planned buffers by 1.23 / 0.99 / 1.18 GiB. Rounded up.
PROCESS_BASELINE_BYTES = {"cpu": 512 * MiB, "cuda": 1536 * MiB}

# GPU memory the CUDA context and library workspaces take outside torch's caching allocator.
CUDA_CONTEXT_BYTES = 512 * MiB

# Share added to the torch-allocated GPU items for the caching allocator's rounding and fragmentation.
ALLOCATOR_SLACK = 0.05

# Engine defaults the plan depends on (EngineConfig; a unit test keeps them equal).
OPTIMIZER_SCRATCH_ELEMENTS = 1 << 22  # optimizer._CHUNK: the scratch chunk that widens gradients

# torch's CachingHostAllocator (pin_memory=True) rounds every allocation up to the next power of two
# (measured on the H200 box: pinning 600 MiB adds 1 GiB of RSS, 1.5 GiB adds 2 GiB). The engine page-locks
# its buffers of 1 MiB and more with cudaHostRegister at their exact size (engine/pinned.py), so the plan
# counts no rounding; pinned_pow2=True plans the old allocator's cost.
PINNED_POW2_ROUNDING = False

# What decoder_layer keeps for backward for one row group, in elements per token (times c bytes):
# hidden-sized: norm1 out, o_proj out, residual, norm2 out, down out, output; q-sized: q, q after RoPE,
# SDPA out, its reshape, k and v repeated to every head; kv-sized: k, v, k after RoPE; MLP: gate,
# silu(gate), up, their product.
LAYER_SAVED_H, LAYER_SAVED_Q, LAYER_SAVED_KV, LAYER_SAVED_I = 6, 6, 3, 4
# fp32 bytes per token per hidden unit: the two RMSNorms' float32 copies of their input.
LAYER_SAVED_FP32_H = 2
# With LoRA the frozen projections keep no input for a weight gradient, and each adapter keeps its input
# instead (the same tensor, compute dtype) plus a [tokens, r] intermediate (layers._LoraLinear): these
# coefficients bound it.
# Gradients alive at the peak of the layer's backward, elements per token: MLP and attention.
LAYER_BACKWARD_I, LAYER_BACKWARD_Q = 3, 3
# A MoE layer's, per token and chosen expert: hidden-sized (sorted input, expert output, weighted, back in
# token order) and expert-width-sized (gate/up, their product)
LAYER_SAVED_MOE_H, LAYER_SAVED_MOE_W = 4, 3
# kernels._SOFTCAP_BLOCK_ELEMENTS: one block of soft-capped attention scores (a unit test keeps them equal)
SOFTCAP_BLOCK_ELEMENTS = 1 << 26


def largest_tensor(shape: ModelShape) -> int:
    """Elements of the model's largest single tensor (as the checkpoint stores it: one expert at a time)."""
    return max(shape.embed_params,
               *(math.prod(s) for i in range(shape.num_layers) for _, _, s in layer_entries(shape, i)))


def _mlp_workspace(mlp, H: int) -> tuple[int, int]:
    """(saved, transient) elements per token of a layer's MLP in the backward."""
    if not isinstance(mlp, MoE):
        return LAYER_SAVED_I * mlp.width, LAYER_BACKWARD_I * mlp.width
    # a MoE layer keeps, per token and chosen expert, its sorted input, gate/up, their product and the
    # expert's output, and per token the router's logits and fp32 probabilities; a shared expert as a dense MLP
    k, W, E = mlp.top_k, mlp.width, mlp.num_experts
    saved, transient = k * (LAYER_SAVED_MOE_H * H + LAYER_SAVED_MOE_W * W) + 3 * E, k * (3 * W + H)
    if mlp.shared:
        dense = _mlp_workspace(mlp.shared, H)
        saved, transient = saved + dense[0] + 2, transient + dense[1]
    return saved, transient


def pow2ceil(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# engine/pinned.py: buffers from 1 MiB up are registered at their exact size, smaller ones use torch's
# rounding allocator.
REGISTER_MIN_BYTES = 1 << 20


def pinned_padding(nbytes: int, pow2: bool) -> int:
    return pow2ceil(nbytes) - nbytes if pow2 or nbytes < REGISTER_MIN_BYTES else 0


def host_breakdown(shape: ModelShape, mode: PrecisionMode, job: Workload, lora: Adapters | None,
                   pinned_pow2: bool = PINNED_POW2_ROUNDING) -> tuple[dict[str, int], int]:
    """(host bytes by item, of which pinned). Items sum to the host bytes. ``pinned_pow2``: each pinned
    buffer takes the next power of two (torch's caching host allocator)."""
    device, compute_dtype = job.device, job.compute_dtype
    cuda = device == "cuda"
    c = DTYPE_BYTES[compute_dtype]
    out = {"weights": 0, "master": 0, "moments": 0, "grads": 0, "checkpoints": 0, "embed_rows": 0,
           "pinned_padding": 0, "optimizer_scratch": 0, "load_staging": 0, "workspace": 0,
           "baseline": PROCESS_BASELINE_BYTES[device]}
    pinned = 0

    def pin(nbytes: int) -> None:
        nonlocal pinned
        if cuda and nbytes:
            pinned += nbytes
            out["pinned_padding"] += pinned_padding(nbytes, pinned_pow2)

    def add(n: int, pb: ParamBytes) -> None:
        out["master"] += n * pb.master
        out["moments"] += n * pb.moments
        out["grads"] += n * pb.grads
        out["weights"] += n * pb.wire
        for nbytes in (n * pb.master if pb.master_is_wire else 0, n * pb.wire, n * pb.grads):
            pin(nbytes)

    kinds = [mode.base(compute_dtype)]
    packed = packed_layers(shape, lora, mode, c)
    for name, n in shape.units():
        if packed and name.startswith("layer."):
            nbytes = packed[int(name.removeprefix("layer."))]
            out["weights"] += nbytes  # a quantized layer: its packed bytes are its wire (engine/quant.py)
            pin(nbytes)
        else:
            add(n, kinds[0])
    if lora is not None:
        for n in adapter_unit_params(lora, shape):
            add(n, mode.adapter())
            kinds.append(mode.adapter())
    widening = [pb for pb in kinds if pb.widens]
    if widening:
        out["optimizer_scratch"] = OPTIMIZER_SCRATCH_ELEMENTS * max(pb.master for pb in widening)

    n_checkpoints = ceil_div(shape.num_layers, min(job.checkpoint_every, max(shape.num_layers, 1)))
    if job.offload_checkpoints:
        # one pinned buffer per checkpoint and row group, [rows, seq, H] in the compute dtype
        for rows in job.row_groups():
            nbytes = rows * job.seq_len * shape.hidden_size * c
            out["checkpoints"] += n_checkpoints * nbytes
            for _ in range(n_checkpoints):
                pin(nbytes)
    if cuda and not shape.tie_word_embeddings:
        # untied embeddings are gathered on the host into one pinned [rows, seq, H] buffer per row group
        for rows in job.row_groups():
            nbytes = rows * job.seq_len * shape.hidden_size * c
            out["embed_rows"] += nbytes
            pin(nbytes)
    pinned += out["pinned_padding"]
    if not cuda:
        dev = device_items(shape, mode, job, lora)
        out["checkpoints"] = dev.pop("checkpoints") + dev.pop("recompute_inputs")
        out["workspace"] = sum(dev.values())
    if job.gpus > 1:
        # several ranks share the store; each has its own process, checkpoints, gathered rows, workspace and
        # optimizer scratch (and pins its own checkpoint and row buffers)
        pinned += (job.gpus - 1) * (out["checkpoints"] + out["embed_rows"] if cuda else 0)
        for key in ("checkpoints", "embed_rows", "baseline", "workspace", "optimizer_scratch", "pinned_padding"):
            out[key] *= job.gpus
    step_transient = out["checkpoints"] + out["optimizer_scratch"] + out["workspace"]
    # quantizing while loading adds bitsandbytes' fp32 temporaries of one chunk (quant._CHUNK weights)
    chunk = QUANT_BYTES_PER_WEIGHT * min(QUANT_CHUNK, largest_tensor(shape)) if packed else 0
    out["load_staging"] = max(0, 4 * largest_tensor(shape) + chunk - step_transient)
    return out, pinned


# A quantization chunk's temporaries (quant._CHUNK weights, a unit test keeps them equal): the fp32 copy, the
# scaled values, the int32 codes and the packed bytes of bitsandbytes' quantize_4bit, ~20 B a weight, rounded up.
QUANT_CHUNK, QUANT_BYTES_PER_WEIGHT = 1 << 22, 24


def unit_wire_bytes(shape: ModelShape, lora: Adapters | None, mode: PrecisionMode, c: int) -> dict[str, int]:
    """Bytes each unit streams to the GPU: a quantized layer's packed bytes, any other unit its parameters in the
    compute dtype: what the step's PCIe copies move (timing.step_time), as host_breakdown counts the host's wire."""
    packed = packed_layers(shape, lora, mode, c)
    return {name: packed[int(name.removeprefix("layer."))] if packed and name.startswith("layer.") else n * c
            for name, n in shape.units()}


def packed_layers(shape: ModelShape, lora: Adapters | None, mode: PrecisionMode, c: int) -> list[int]:
    """Bytes of each decoder layer's packed wire under LoRA's quantize; empty when the base is not quantized."""
    if mode.method != "lora" or lora is None or lora.quantize == "none":
        return []
    nested = stored_nested(shape.hf)  # a pre-quantized checkpoint's 4-bit scales are packed as it keeps them
    return [packed_layer_bytes(layer_entries(shape, i), lora.quantize, c, nested) for i in range(shape.num_layers)]


def device_items(shape: ModelShape, mode: PrecisionMode, job: Workload, lora: Adapters | None) -> dict[str, int]:
    """The engine's device-side working set, by item (on CPU the same work runs in host RAM)."""
    cuda = job.device == "cuda"
    c = DTYPE_BYTES[job.compute_dtype]
    H, V, L = shape.hidden_size, shape.vocab_size, shape.num_layers
    K = min(job.checkpoint_every, max(L, 1))
    T, m = job.tokens_per_step, job.group_tokens
    layer = shape.layer_params
    full = mode.method == "full"
    trained_layer = layer if lora is None else max(adapter_unit_params(lora, shape))
    out: dict[str, int] = {}
    packed = max(packed_layers(shape, lora, mode, c), default=0)
    if cuda:
        # a quantized base's slots hold a layer packed; reading it dequantizes the layer (layer_workspace)
        out["weight_slots"] = 2 * K * (packed or layer * c)
        out["embed_slot"] = shape.embed_params * c if shape.tie_word_embeddings else 0
        out["head_slot"] = shape.head_params * c
        if full:
            ends = (shape.embed_params + shape.head_params if shape.tie_word_embeddings
                    else max(shape.embed_params, shape.head_params))
            out["grad_accumulators"] = 4 * ((1 if c != 4 else 2) * layer + ends)
            if c != 4:
                out["grad_staging"] = 2 * layer * c
        else:
            # the frozen base has no gradient; each weight slot has an fp32 adapter slot beside it (engine
            # slots.py), and a layer's adapter gradients accumulate in one of two pooled fp32 buffers (grads.py)
            assert lora is not None, "method lora has adapters"
            per_unit = max(adapter_unit_params(lora, shape))
            slots = 2 * K + 1 + (1 if shape.tie_word_embeddings else 0)
            out["adapter_slots"] = 4 * per_unit * slots
            out["adapter_grads"] = 4 * per_unit * 2
    elif full and c != 4:
        # on the CPU an fp32 gradient is accumulated in its host buffer; a bf16 layer's in a temporary
        # fp32 buffer, one at a time
        out["grad_accumulators"] = 4 * layer
    resident = 2 if job.offload_checkpoints else ceil_div(L, K)
    out["checkpoints"] = min(resident, ceil_div(L, K)) * T * H * c
    out["recompute_inputs"] = (K - 1) * T * H * c
    out["hidden_states"] = 2 * T * H * c
    # the widest MLP of any layer (layers may differ: dense and MoE)
    mlp_saved, mlp_transient = (max(kind) for kind in zip(*(_mlp_workspace(layer.mlp, H) for layer in shape.layers)))
    norms = LAYER_SAVED_FP32_H + (2 if shape.sandwich_norms else 0)
    saved = m * (c * (LAYER_SAVED_H * H + LAYER_SAVED_Q * shape.q_dim + LAYER_SAVED_KV * shape.kv_dim
                      + mlp_saved) + 4 * norms * H)
    transient = m * c * (mlp_transient + LAYER_BACKWARD_Q * shape.q_dim)
    if shape.attn_softcap:
        # the soft-capped attention's blocks of fp32 scores: scores, tanh, probabilities and two gradients
        transient += 5 * 4 * SOFTCAP_BLOCK_ELEMENTS
    # the weight gradients go into their fp32 accumulators inside the GEMMs on CUDA (kernels.accumulate_mm); on the
    # CPU each passes through a product tensor, counted as the whole trained layer's
    weight_grads = 0 if cuda else trained_layer * (c if full else 4)
    out["layer_workspace"] = saved + transient + weight_grads + (layer * c if packed else 0)
    if lora is not None:
        # an adapter's backward (layers._LoraLinear) rebuilds its dropped-out input and returns dL/dx, each
        # [tokens, in] in the compute dtype, beside the incoming [tokens, out]: the widest target, transient (an
        # expert target's rows are the k copies of each token)
        dims = projection_shapes(shape)
        out["layer_workspace"] += m * c * max(sum(dims[t]) * (shape.experts_per_token if t in EXPERT_TARGETS else 1)
                                              for t in lora.targets)
    # a loss chunk's logits, whose gradient overwrites them, and the torch cross-entropy's float32 temporaries of
    # the rows it takes at once (none with Liger's kernel, which works in place); the LM head's weight gradient
    # passes through a [V, H] product on the CPU only (accumulate_mm)
    chunk = min(job.loss_chunk_tokens, m)
    loss = chunk * V * c + torch_ce_rows(chunk, c) * V * (TORCH_CE_BYTES_PER_LOGIT + 2 * c)
    loss += shape.embed_params * c if full and not cuda else 0
    # the loss runs after the last layer's forward and before the first layer's backward: its workspace and
    # a layer's are never live together, so only what the loss needs beyond a layer's counts
    out["loss_workspace"] = max(0, loss - out["layer_workspace"])
    masks = T * job.seq_len if job.packed else 0
    if job.packed and not cuda:
        # the CPU's SDPA takes its math path under a mask: scores, softmax and its grad per head
        masks += 3 * m * shape.num_heads * job.seq_len * c
    out["rope_and_masks"] = 2 * T * shape.head_dim * c + 16 * T + masks
    if cuda:
        out["allocator_slack"] = int(ALLOCATOR_SLACK * sum(out.values()))
        out["cuda_context"] = CUDA_CONTEXT_BYTES
    return out
