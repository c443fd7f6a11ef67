"""The parameter layout of a model the engine trains: its units, and the tables the job spec, the planner and
the engine share.

A model is described by its family module (``horizon_ray.models``: an HF config.json read into a
``ModelConfig``, each decoder layer composed of attention, MLP and mixture-of-experts blocks). Parameters are
grouped into *units*, the pieces that stream through the device one at a time: ``embed`` (the token embedding),
one unit per decoder layer, and ``head`` (final norm, plus the LM head unless it is tied to the embedding). Each
unit is one flat buffer; ``UnitLayout`` says where each HF tensor lives in it. Tensors keep their HF names and
shapes (what is read from disk is written back), so a family whose checkpoint stores q, k and v as one
``qkv_proj`` (Phi-3) keeps it fused in its unit, and a mixture-of-experts layer holds its router and every
expert, each expert under its own HF names. Layers may differ (dense and MoE, sliding and global): each unit is
laid out from its own layer's blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from horizon_ray.errors import BadInput
from horizon_ray.models import ARCHITECTURES
from horizon_ray.models.blocks import EXPERT_TARGETS, LAYER_TYPES, Entry
from horizon_ray.models.config import ModelConfig

__all__ = ["ARCHITECTURES", "EXPERT_TARGETS", "LAYER_TYPES", "ModelConfig"]

# Weights a layer unit may run as one GEMM: fused key -> member keys, in buffer order (rows stacked).
FUSED = {"qkv": ("q", "k", "v"), "qkv_b": ("q_b", "k_b", "v_b"), "gate_up": ("gate", "up")}
# Keys of a layer unit that are not projections: their gradients come back from autograd as leaves, where
# every projection's weight gradient (the router's and the experts' included) is added into its accumulator
# by the backward itself.
LEAF_KEYS = ("ln1", "ln2", "ln1_post", "ln2_post", "q_norm", "k_norm")
# Keys of norm weights (a layer's and the final norm), which from_config initialises like HF.
NORM_KEYS = (*LEAF_KEYS, "norm")
# The experts of a MoE layer as the layer template reads them: one [E, 2 x width, H] tensor (each expert's
# gate rows, then its up rows) and one [E, H, width], views of the unit's per-expert tensors.
EXPERT_STACKS = ("experts.gate_up", "experts.down")
# Each stack's members, one expert's rows in this order ("experts.3.gate", then "experts.3.up")
EXPERT_STACK_MEMBERS = {"experts.gate_up": ("gate", "up"), "experts.down": ("down",)}


@dataclass(frozen=True)
class TensorSlot:
    name: str  # HF tensor name, e.g. "model.layers.3.mlp.up_proj.weight"
    key: str  # name inside the unit, e.g. "up" (what the layer template reads)
    shape: tuple[int, ...]
    offset: int  # first element inside the unit's flat buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def view_of(self, flat):
        """This tensor in a flat buffer of its unit (one expert's, too, which ``UnitLayout.views`` stacks)."""
        return flat[self.offset:self.offset + self.numel].view(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    name: str  # "embed", "layer.{i}", "head"
    tensors: tuple[TensorSlot, ...]
    # EXPERT_STACKS of a MoE layer: (key, offset, shape) of each stack, whose members sit back to back
    stacks: tuple[tuple[str, int, tuple[int, ...]], ...] = ()

    @property
    def numel(self) -> int:
        last = self.tensors[-1]
        return last.offset + last.numel

    @cached_property
    def _unstacked(self) -> tuple[TensorSlot, ...]:
        return tuple(t for t in self.tensors if not _is_expert_key(t.key))

    def stack_members(self, stack: str) -> tuple[TensorSlot, ...]:
        """The per-expert tensors of an EXPERT_STACKS stack, in its row order (expert by expert)."""
        return tuple(t for t in self.tensors
                     if _is_expert_key(t.key) and t.key.split(".")[-1] in EXPERT_STACK_MEMBERS[stack])

    def views(self, flat, fused: bool = False):
        """Tensor views into a flat buffer of this unit, by key. With ``fused``, the members of each group of
        FUSED that sit next to each other in the buffer are replaced by one view of all their rows (the
        layer template then runs one GEMM for q, k and v, and one for gate and up). The experts of a MoE
        layer always come as their EXPERT_STACKS."""
        out = {t.key: flat[t.offset:t.offset + t.numel].view(t.shape) for t in self._unstacked}
        for key, offset, shape in self.stacks:
            out[key] = flat[offset:offset + math.prod(shape)].view(shape)
        if not fused:
            return out
        by_key = {t.key: t for t in self._unstacked}
        for name, members in FUSED.items():
            if any(m not in by_key for m in members):
                continue
            ts = [by_key[m] for m in members]
            if any(a.offset + a.numel != b.offset or a.shape[1:] != b.shape[1:] for a, b in zip(ts, ts[1:])):
                continue
            rows = sum(t.shape[0] for t in ts)
            out[name] = flat[ts[0].offset:ts[-1].offset + ts[-1].numel].view(rows, *ts[0].shape[1:])
            for m in members:
                del out[m]
        return out


def _is_expert_key(key: str) -> bool:
    """One expert's tensor ("experts.3.gate"), which the unit's views show only within its stack."""
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "experts" and parts[1].isdigit()


def _unit(name: str, entries: list[tuple[str, str, tuple[int, ...]]]) -> UnitLayout:
    slots, offset = [], 0
    for hf_name, key, shape in entries:
        slots.append(TensorSlot(hf_name, key, shape, offset))
        offset += math.prod(shape)
    stacks = []
    unstacked = UnitLayout(name, tuple(slots))
    for stack in EXPERT_STACKS:
        members = unstacked.stack_members(stack)
        if members:
            n = len(members) // len(EXPERT_STACK_MEMBERS[stack])
            first, last = members[0], members[-1]
            assert last.offset + last.numel - first.offset == sum(t.numel for t in members), "experts not adjacent"
            rows = sum(t.shape[0] for t in members) // n
            stacks.append((stack, first.offset, (n, rows, first.shape[1])))
    return UnitLayout(name, tuple(slots), tuple(stacks))


def layer_entries(cfg: ModelConfig, i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, key, shape) of every tensor of decoder layer i, in the unit's order (its blocks' entries)."""
    return cfg.layers[i].entries(i, cfg.hidden_size)


def unit_layouts(cfg: ModelConfig) -> list[UnitLayout]:
    """embed, layer.0 .. layer.{L-1}, head: the streaming order of the forward pass."""
    H, V = cfg.hidden_size, cfg.vocab_size
    units = [_unit("embed", [("model.embed_tokens.weight", "embed", (V, H))])]
    units += [_unit(f"layer.{i}", layer_entries(cfg, i)) for i in range(cfg.num_layers)]
    head: list[Entry] = [("model.norm.weight", "norm", (H,))]
    if not cfg.tie_word_embeddings:
        head.append(("lm_head.weight", "lm_head", (V, H)))
    units.append(_unit("head", head))
    return units


# ---- tables the job spec, the planner and the engine share (plain Python: the planner and the API read them) ----

# The projections of a Llama-style decoder layer, in the layer's order, by the name LoRA targets them with
# (PEFT's target_modules) -> (key of the weight in a layer unit, HF module path inside the layer).
PROJECTIONS = {
    "q_proj": ("q", "self_attn.q_proj"),
    "k_proj": ("k", "self_attn.k_proj"),
    "v_proj": ("v", "self_attn.v_proj"),
    "o_proj": ("o", "self_attn.o_proj"),
    "gate_proj": ("gate", "mlp.gate_proj"),
    "up_proj": ("up", "mlp.up_proj"),
    "down_proj": ("down", "mlp.down_proj"),
}
# Every projection LoRA can target on some family, in a layer's order: PROJECTIONS, Phi-3's fused qkv_proj and
# gate_up_proj, and the experts of a MoE layer (PEFT's target_parameters, named without the "mlp."). Each
# family has its subset (family_projections).
LORA_TARGETS = {
    "q_proj": PROJECTIONS["q_proj"],
    "k_proj": PROJECTIONS["k_proj"],
    "v_proj": PROJECTIONS["v_proj"],
    "qkv_proj": ("qkv", "self_attn.qkv_proj"),
    "o_proj": PROJECTIONS["o_proj"],
    "gate_proj": PROJECTIONS["gate_proj"],
    "up_proj": PROJECTIONS["up_proj"],
    "gate_up_proj": ("gate_up", "mlp.gate_up_proj"),
    "down_proj": PROJECTIONS["down_proj"],
    "experts.gate_up_proj": ("experts.gate_up", "mlp.experts"),
    "experts.down_proj": ("experts.down", "mlp.experts"),
}
# Targets whose projections read one input, the members of a fused GEMM (FUSED's "qkv" and "gate_up", the keys
# the layer template groups): their adapters run together without dropout (layers._LoraLinears), reading that
# input once a pass.
LORA_SHARED_INPUTS = tuple(tuple(name for key in FUSED[fused] for name, (k, _) in PROJECTIONS.items() if k == key)
                           for fused in ("qkv", "gate_up"))
# The norms of a Llama-style decoder layer (HF module name -> key in a layer unit). With the final norm (HF
# module "model.norm"), the norms LoRA may train beside its adapters (PEFT's modules_to_save); each family's
# own table: layer_norms.
LAYER_NORMS = {"input_layernorm": "ln1", "post_attention_layernorm": "ln2"}
# Compute dtypes of the layer template and the weights streamed to the device, with their bytes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

# Bytes a logit's torch cross-entropy (the kernel set without Liger's) keeps beside the logits while it runs: the
# float32 copy, its log-softmax and its gradient (4 each) and the gradient in the compute dtype.
TORCH_CE_BYTES_PER_LOGIT = 12


def torch_ce_rows(rows: int, compute_bytes: int) -> int:
    """Rows of a loss chunk the torch cross-entropy takes at once (kernels.Kernels.cross_entropy_): as many as keep
    its temporaries within the chunk's own logits (rows x vocab x the compute dtype's bytes), so a loss chunk takes
    at most twice its logits whichever kernels run (Liger's works in place on the logits)."""
    return max(1, rows * compute_bytes // (TORCH_CE_BYTES_PER_LOGIT + 2 * compute_bytes))


# Precision modes of full fine-tuning: "exact" (fp32 master, fp32 AdamW moments: torch.optim.AdamW
# semantics); "bf16-state" (bf16 master and moments, half the host RAM, updates below bf16 resolution lost).
PRECISIONS = ("exact", "bf16-state")
# When the host AdamW of step n runs: "exact" (after the step's global grad norm is known, overlapping step
# n+1's forward); "delayed" (overlapping all of step n+1's GPU work, which so trains on the weights after
# step n-1: not exact); "speculative" (each unit as soon as its gradient is final, assuming clipping will not
# trigger; validated at the end of the backward and redone if it did: exact whenever clipping is inactive).
UPDATES = ("exact", "delayed", "speculative")
# The layer template's kernels: "torch" ops, "liger" (Liger-Kernel's fused kernels, CUDA only), or "auto":
# liger on CUDA when the package is installed, torch elsewhere.
KERNELS = ("auto", "torch", "liger")


def _shared_targets(cfg: ModelConfig) -> set[str]:
    """The targets a shared expert's projections also answer to (PEFT would adapt them; the engine does not)."""
    return {name for layer in cfg.layers if layer.moe and layer.moe.shared for name in layer.moe.shared.targets(0)}


def layer_targets(cfg: ModelConfig, i: int) -> dict[str, tuple[str, str, tuple[int, int], int]]:
    """The projections LoRA can target in decoder layer i: name -> (key, HF module path, (in, out), copies)."""
    excluded = _shared_targets(cfg)
    return {name: t for name, t in cfg.layers[i].targets(cfg.hidden_size).items() if name not in excluded}


def family_projections(cfg: ModelConfig) -> dict[str, tuple[str, str]]:
    """The projections LoRA can target on some layer of `cfg`, in the layer's order: name -> (key, HF module
    path)."""
    have = {name for i in range(cfg.num_layers) for name in layer_targets(cfg, i)}
    return {name: LORA_TARGETS[name] for name in LORA_TARGETS if name in have}


def default_lora_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """PEFT's default target_modules for the family (its table of defaults): q_proj and v_proj, Phi-3's
    qkv_proj. The job spec's, the planner's and the engine's default targets."""
    return ("qkv_proj",) if cfg.fused_qkv else ("q_proj", "v_proj")


def layer_norms(cfg: ModelConfig) -> dict[str, str]:
    """The norms of a decoder layer of `cfg`'s family, HF module name inside the layer -> key in the unit."""
    return cfg.layer_norms


def check_targets(cfg: ModelConfig, targets) -> None:
    """Refuse LoRA targets that `cfg`'s family does not have, naming the ones it has."""
    have = family_projections(cfg)
    bad = [t for t in targets if t not in have]
    if bad:
        why = ""
        if any(t in _shared_targets(cfg) for t in bad):
            why = (" (its shared expert's projections answer to the same names and are not adapted: target the "
                   "attention or experts.gate_up_proj and experts.down_proj)")
        elif cfg.num_experts and any(t in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") for t in bad):
            why = " (its MLP is a mixture of experts: target experts.gate_up_proj and experts.down_proj)"
        elif cfg.fused_qkv and any(t in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") for t in bad):
            why = " (its checkpoint fuses them: target qkv_proj and gate_up_proj)"
        raise BadInput(f"lora targets {bad} are not projections of this {cfg.arch} model{why}; choose among "
                       f"{', '.join(have)}", field="lora.targets")


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection LoRA can target on `cfg`; an expert target's are those of
    one expert."""
    shapes = {name: t[2] for i in range(cfg.num_layers) for name, t in layer_targets(cfg, i).items()}
    return {name: shapes[name] for name in family_projections(cfg)}


def adapter_params_of(cfg: ModelConfig, target: str, r: int, i: int = 0) -> int:
    """Parameters of layer i's LoRA adapter on `target`: A [r, in] + B [out, r], per expert for the experts; 0
    where the layer lacks the target (a dense layer's experts)."""
    t = layer_targets(cfg, i).get(target)
    return 0 if t is None else r * sum(t[2]) * t[3]


def modules_to_save_norms(cfg, entries) -> tuple[list[tuple[str, ...]], bool]:
    """Which norms PEFT's ``modules_to_save`` entries select on a decoder-only HF model of `cfg`'s family, by
    PEFT's rule (a module is selected when its dotted name ends with an entry, so "norm" selects every norm,
    Qwen3's q_norm and k_norm included): per layer, the selected names among the family's layer norms, and
    whether the final norm is selected. Refuses an entry that selects nothing, or a module other than a norm,
    naming it and the fix."""
    num_layers = cfg.num_layers
    per_layer: list[tuple[str, ...]] = [() for _ in range(num_layers)]
    final = False
    if not entries:
        return per_layer, final
    others = ["model", "model.embed_tokens", "model.layers", "model.rotary_emb", "lm_head"]
    for i in range(num_layers):
        others.append(f"model.layers.{i}")
        others += [f"model.layers.{i}.{c}" for c in dict.fromkeys(cfg.layers[i].children())]
    norms = ", ".join(n.split(".")[-1] for n in cfg.layer_norms)
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise BadInput(f"lora modules_to_save entry {entry!r} is not a module name; name norms, e.g. "
                           f"{norms}, or norm (every norm)")
        hit = [o for o in others if o.endswith(entry)]
        if hit:
            what = "the embeddings or the LM head" if hit[0] in ("model.embed_tokens", "lm_head") else "it"
            raise BadInput(f"lora modules_to_save entry {entry!r} selects {hit[0]}: only norms train beside "
                           f"the adapters ({norms}, norm); to train {what}, use method full")
        found = "model.norm".endswith(entry)
        final = final or found
        for i in range(num_layers):
            table = cfg.layers[i].norms()
            chosen = [n for n in table if f"model.layers.{i}.{n}".endswith(entry)]
            if chosen:
                found = True
                per_layer[i] = tuple(n for n in table if n in chosen or n in per_layer[i])
        if not found:
            raise BadInput(f"lora modules_to_save entry {entry!r} selects no module of this model; name norms: "
                           f"{norms}, norm (every norm), or one layer's as 'layers.3.input_layernorm'")
    return per_layer, final


# ---- a quantized frozen base (LoRA's quantize; engine/quant.py packs and unpacks it) ----------------------

# How LoRA keeps the frozen base's projections: "none" in the compute dtype; "nf4" / "fp4" bitsandbytes'
# 4-bit blocks of QUANT_BLOCK weights with double-quantized block scales (QLoRA's defaults, what
# BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=..., bnb_4bit_use_double_quant=True) gives);
# "int8": LLM.int8's weights, int8 rows with one fp32 scale a row (BitsAndBytesConfig(load_in_8bit=True)).
QUANTIZE = ("none", "nf4", "fp4", "int8")
QUANT_BLOCK = 64  # weights per 4-bit block (one absmax each)
QUANT_NESTED_BLOCK = 256  # block scales per block of the double quantization (one fp32 absmax each)
# Keys of a layer unit that are quantized: the nn.Linear weights bitsandbytes' HF integration replaces, and
# each expert's (checkpoints keep one matrix per expert). Norms, biases, the router, the embedding and the LM
# head stay in the compute dtype, as they do in transformers + bitsandbytes.
QUANTIZED_KEYS = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")
_PACK_ALIGN = 16  # every part of a packed tensor starts 16-byte aligned, so each is a view of its dtype


def is_quantized(key: str, quantize: str) -> bool:
    """Whether a layer unit's tensor ``key`` is packed under ``quantize``."""
    return quantize != "none" and (key in QUANTIZED_KEYS or _is_expert_key(key))


def packed_parts(quantize: str, shape: tuple[int, ...], c: int, nested: bool = True) -> list[tuple[str, int]]:
    """(part, bytes) of one tensor as the store packs it: "w" in the compute dtype (c bytes) when it is not
    quantized; 4-bit: the codes (two a byte), one uint8 scale per block, one fp32 absmax per block of block
    scales and their fp32 offset (their mean); without ``nested`` (a checkpoint saved without double
    quantization) one fp32 scale per block instead; int8: the int8 weights and one fp32 scale a row (SCB)."""
    n = math.prod(shape)
    if quantize in ("nf4", "fp4"):
        blocks = -(-n // QUANT_BLOCK)
        if not nested:
            return [("codes", -(-n // 2)), ("absmax", 4 * blocks)]
        return [("codes", -(-n // 2)), ("absmax", blocks), ("absmax2", 4 * -(-blocks // QUANT_NESTED_BLOCK)),
                ("offset", 4)]
    if quantize == "int8":
        return [("cb", n), ("scb", 4 * shape[0])]
    return [("w", n * c)]


def packed_nbytes(quantize: str, shape: tuple[int, ...], c: int, nested: bool = True) -> int:
    """Host bytes of one tensor packed (its parts, each rounded up to the alignment)."""
    return sum(-(-b // _PACK_ALIGN) * _PACK_ALIGN for _, b in packed_parts(quantize, shape, c, nested))


def packed_layer_bytes(entries, quantize: str, c: int, nested: bool = True) -> int:
    """Host bytes of a layer unit with ``quantize`` (entries: layer_entries' (name, key, shape))."""
    return sum(packed_nbytes(quantize if is_quantized(key, quantize) else "none", shape, c, nested)
               for _, key, shape in entries)


# ---- a pre-quantized checkpoint (transformers + bitsandbytes' serialization) -------------------------------


@dataclass(frozen=True)
class StoredQuant:
    """How a model directory saved by transformers with a bitsandbytes ``quantization_config`` keeps its
    nn.Linear weights (its config.json says; each tensor's own quant state says the rest, quant.py)."""

    quantize: str  # "nf4" | "fp4" (load_in_4bit, bnb_4bit_quant_type) | "int8" (load_in_8bit)
    nested: bool  # 4-bit: the block scales double-quantized (bnb_4bit_use_double_quant); int8: False


def stored_quant(hf: dict) -> StoredQuant | None:
    """The checkpoint's quantization (config.json's ``quantization_config``); None: it holds floats."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method", "bitsandbytes")
    if method != "bitsandbytes":
        raise BadInput(f"the checkpoint is quantized by {method!r} (its config.json's quantization_config); the "
                       "engine loads bitsandbytes' 4-bit and 8-bit checkpoints only: give the model's bf16 "
                       "checkpoint (lora.quantize then quantizes it while loading)")
    if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        kind = qc.get("bnb_4bit_quant_type", "fp4")
        if kind not in ("nf4", "fp4"):
            raise BadInput(f"the checkpoint's bnb_4bit_quant_type is {kind!r}; the engine knows nf4 and fp4")
        return StoredQuant(kind, bool(qc.get("bnb_4bit_use_double_quant", False)))
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        return StoredQuant("int8", False)
    raise BadInput("the checkpoint's quantization_config is bitsandbytes' but sets neither load_in_4bit nor "
                   "load_in_8bit; fix its config.json or give the bf16 checkpoint")


def quantize_for(hf: dict, requested: str | None) -> str:
    """The ``lora.quantize`` a job trains with on this checkpoint (``requested`` None: full fine-tuning, which
    a quantized checkpoint refuses): a pre-quantized checkpoint's own, which ``requested`` must name or leave
    at its default ("none"); else ``requested``. The one rule the engine and the planner apply."""
    stored = stored_quant(hf)
    if stored is None:
        return "none" if requested is None else requested
    if requested is None:
        raise BadInput(f"the model is a pre-quantized {stored.quantize} checkpoint (bitsandbytes): its frozen "
                       "4/8-bit weights cannot be fine-tuned in full; use method: lora (QLoRA on this base), or "
                       "fine-tune the model's bf16 checkpoint", field="method")
    if requested not in ("none", stored.quantize):
        raise BadInput(f"lora.quantize is {requested} but the model is a pre-quantized {stored.quantize} checkpoint "
                       f"(bitsandbytes); set lora.quantize to {stored.quantize} or leave it out (it is taken from "
                       f"the checkpoint), or give the bf16 checkpoint to quantize it as {requested}",
                       field="lora.quantize")
    return stored.quantize


def stored_nested(hf: dict) -> bool:
    """Whether a quantized base's 4-bit scales are double-quantized: a checkpoint's own choice, else QLoRA's."""
    stored = stored_quant(hf)
    return True if stored is None else stored.nested
