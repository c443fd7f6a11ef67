"""The model family the engine trains, described by an HF config.json, and its parameter layout.

Parameters are grouped into *units*, the pieces that stream through the device one at a time:
``embed`` (the token embedding), one unit per decoder layer, and ``head`` (final norm, plus the LM head
unless it is tied to the embedding). Each unit is one flat buffer; ``UnitLayout`` says where each HF
tensor lives in it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from horizon_ray.errors import BadInput

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
# Config keys that change the math in a way this engine does not implement, with the value it needs.
_REFUSED_IF = {
    "mlp_bias": (False, "MLP biases are not supported"),
    "use_sliding_window": (False, "Qwen2 sliding-window attention is not supported"),
    "hidden_act": ("silu", "only the SwiGLU MLP (hidden_act='silu') is supported"),
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # llama3 rope scaling parameters, or None for plain RoPE.
    rope_llama3: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2, or Llama with attention_bias)
    o_bias: bool  # the output projection carries a bias (Llama with attention_bias)
    sliding_window: int | None  # Mistral: attend to at most this many previous tokens
    initializer_range: float
    hf: dict = field(repr=False, compare=False, hash=False)  # the config.json it came from

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def load(source: str | Path | dict) -> ModelConfig:
        """From a config dict, a config.json path or a model directory holding config.json."""
        if isinstance(source, dict):
            return ModelConfig.from_hf(source)
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise BadInput(f"no config.json at {path}: point at an HF model directory or its config.json")
        with open(path) as f:
            return ModelConfig.from_hf(json.load(f))

    @staticmethod
    def from_hf(hf: dict) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise BadInput(
                f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)} "
                "(decoder-only Llama / Qwen2 / Mistral family)"
            )
        archs = hf.get("architectures") or [ARCHITECTURES[model_type]]
        if archs != [ARCHITECTURES[model_type]]:
            raise BadInput(f"architectures {archs} are not supported; expected [{ARCHITECTURES[model_type]!r}]")
        for key, (ok, why) in _REFUSED_IF.items():
            if key in hf and hf[key] not in (ok, None):
                raise BadInput(f"config field {key}={hf[key]!r}: {why}")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise BadInput(f"config field pretraining_tp={hf['pretraining_tp']}: only 1 is supported")
        layer_types = hf.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise BadInput(f"config field layer_types={sorted(set(layer_types))}: only full_attention is supported")
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling")
        if legacy:
            rope.update(legacy)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        llama3 = None
        if rope_type == "llama3":
            llama3 = {k: float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")}
        elif rope_type != "default":
            raise BadInput(f"rope type {rope_type!r} is not supported; supported: 'default', 'llama3'")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise BadInput("partial_rotary_factor != 1 is not supported")

        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise BadInput(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(hf.get("attention_bias", False))
        sliding = hf.get("sliding_window") if model_type == "mistral" else None
        return ModelConfig(
            arch=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_llama3=llama3,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            sliding_window=int(sliding) if sliding else None,
            initializer_range=float(hf.get("initializer_range", 0.02)),
            hf=dict(hf),
        )


# Weights a layer unit may run as one GEMM: fused key -> member keys, in buffer order (rows stacked).
FUSED = {"qkv": ("q", "k", "v"), "qkv_b": ("q_b", "k_b", "v_b"), "gate_up": ("gate", "up")}
# Keys of a layer unit that are not projections: their gradients come back from autograd as leaves, where
# every projection's weight gradient is added into its accumulator by the backward itself.
LEAF_KEYS = ("ln1", "ln2")


@dataclass(frozen=True)
class TensorSlot:
    name: str  # HF tensor name, e.g. "model.layers.3.mlp.up_proj.weight"
    key: str  # name inside the unit, e.g. "up" (what the layer template reads)
    shape: tuple[int, ...]
    offset: int  # first element inside the unit's flat buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    name: str  # "embed", "layer.{i}", "head"
    tensors: tuple[TensorSlot, ...]

    @property
    def numel(self) -> int:
        last = self.tensors[-1]
        return last.offset + last.numel

    def views(self, flat, fused: bool = False):
        """Tensor views into a flat buffer of this unit, by key. With ``fused``, the members of each group of
        FUSED that sit next to each other in the buffer are replaced by one view of all their rows (the
        layer template then runs one GEMM for q, k and v, and one for gate and up)."""
        out = {t.key: flat[t.offset:t.offset + t.numel].view(t.shape) for t in self.tensors}
        if not fused:
            return out
        by_key = {t.key: t for t in self.tensors}
        for name, members in FUSED.items():
            ts = [by_key.get(m) for m in members]
            if None in ts or any(a.offset + a.numel != b.offset or a.shape[1:] != b.shape[1:]
                                 for a, b in zip(ts, ts[1:])):
                continue
            rows = sum(t.shape[0] for t in ts)
            out[name] = flat[ts[0].offset:ts[-1].offset + ts[-1].numel].view(rows, *ts[0].shape[1:])
            for m in members:
                del out[m]
        return out


def _unit(name: str, entries: list[tuple[str, str, tuple[int, ...]]]) -> UnitLayout:
    slots, offset = [], 0
    for hf_name, key, shape in entries:
        slots.append(TensorSlot(hf_name, key, shape, offset))
        offset += math.prod(shape)
    return UnitLayout(name, tuple(slots))


def unit_layouts(cfg: ModelConfig) -> list[UnitLayout]:
    """embed, layer.0 .. layer.{L-1}, head: the streaming order of the forward pass."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    units = [_unit("embed", [("model.embed_tokens.weight", "embed", (V, H))])]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        entries = [
            (p + "input_layernorm.weight", "ln1", (H,)),
            (p + "self_attn.q_proj.weight", "q", (cfg.q_dim, H)),
            (p + "self_attn.k_proj.weight", "k", (cfg.kv_dim, H)),
            (p + "self_attn.v_proj.weight", "v", (cfg.kv_dim, H)),
        ]
        if cfg.qkv_bias:
            entries += [
                (p + "self_attn.q_proj.bias", "q_b", (cfg.q_dim,)),
                (p + "self_attn.k_proj.bias", "k_b", (cfg.kv_dim,)),
                (p + "self_attn.v_proj.bias", "v_b", (cfg.kv_dim,)),
            ]
        entries.append((p + "self_attn.o_proj.weight", "o", (H, cfg.q_dim)))
        if cfg.o_bias:
            entries.append((p + "self_attn.o_proj.bias", "o_b", (H,)))
        entries += [
            (p + "post_attention_layernorm.weight", "ln2", (H,)),
            (p + "mlp.gate_proj.weight", "gate", (I, H)),
            (p + "mlp.up_proj.weight", "up", (I, H)),
            (p + "mlp.down_proj.weight", "down", (H, I)),
        ]
        units.append(_unit(f"layer.{i}", entries))
    head = [("model.norm.weight", "norm", (H,))]
    if not cfg.tie_word_embeddings:
        head.append(("lm_head.weight", "lm_head", (V, H)))
    units.append(_unit("head", head))
    return units


# ---- tables the job spec, the planner and the engine share (plain Python: the planner and the API read them) ----

# The projections of a decoder layer, in the layer's order, by the name LoRA targets them with (PEFT's
# target_modules) -> (key of the weight in a layer unit, HF module path inside the layer).
PROJECTIONS = {
    "q_proj": ("q", "self_attn.q_proj"),
    "k_proj": ("k", "self_attn.k_proj"),
    "v_proj": ("v", "self_attn.v_proj"),
    "o_proj": ("o", "self_attn.o_proj"),
    "gate_proj": ("gate", "mlp.gate_proj"),
    "up_proj": ("up", "mlp.up_proj"),
    "down_proj": ("down", "mlp.down_proj"),
}
# The norms of a decoder layer (HF module name -> key in a layer unit). With the final norm (HF module
# "model.norm"), the norms LoRA may train beside its adapters (PEFT's modules_to_save).
LAYER_NORMS = {"input_layernorm": "ln1", "post_attention_layernorm": "ln2"}
# Compute dtypes of the layer template and the weights streamed to the device, with their bytes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
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


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of a layer of `cfg` (a ModelConfig, or any shape with
    hidden_size, intermediate_size, q_dim and kv_dim)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (H, cfg.q_dim), "k_proj": (H, cfg.kv_dim), "v_proj": (H, cfg.kv_dim),
            "o_proj": (cfg.q_dim, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}


def modules_to_save_norms(num_layers: int, entries) -> tuple[list[tuple[str, ...]], bool]:
    """Which norms PEFT's ``modules_to_save`` entries select on a decoder-only HF model, by PEFT's rule (a
    module is selected when its dotted name ends with an entry, so "norm" selects every norm): per layer,
    the selected names among LAYER_NORMS, and whether the final norm is selected. Refuses an entry that
    selects nothing, or a module other than a norm, naming it and the fix."""
    per_layer: list[tuple[str, ...]] = [() for _ in range(num_layers)]
    final = False
    if not entries:
        return per_layer, final
    layer_children = ("self_attn", "mlp", "act_fn", *(module for _, module in PROJECTIONS.values()))
    others = ["model", "model.embed_tokens", "model.layers", "model.rotary_emb", "lm_head"]
    for i in range(num_layers):
        others.append(f"model.layers.{i}")
        others += [f"model.layers.{i}.{c}" for c in layer_children]
    norms = ", ".join(LAYER_NORMS)
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
            chosen = [n for n in LAYER_NORMS if f"model.layers.{i}.{n}".endswith(entry)]
            if chosen:
                found = True
                per_layer[i] = tuple(n for n in LAYER_NORMS if n in chosen or n in per_layer[i])
        if not found:
            raise BadInput(f"lora modules_to_save entry {entry!r} selects no module of this model; name norms: "
                           f"{norms}, norm (every norm), or one layer's as 'layers.3.input_layernorm'")
    return per_layer, final
