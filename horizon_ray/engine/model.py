"""The model families the engine trains, described by an HF config.json, and their parameter layout.

Parameters are grouped into *units*, the pieces that stream through the device one at a time:
``embed`` (the token embedding), one unit per decoder layer, and ``head`` (final norm, plus the LM head
unless it is tied to the embedding). Each unit is one flat buffer; ``UnitLayout`` says where each HF
tensor lives in it. Tensors keep their HF names and shapes (what is read from disk is written back), so a
family whose checkpoint stores q, k and v as one ``qkv_proj`` (Phi-3) keeps it fused in its unit, and a
mixture-of-experts layer holds its router and every expert, each expert under its own HF names.

Families (``ARCHITECTURES``), by what their decoder layer adds to Llama's:
- ``qwen2``: q/k/v biases. ``mistral``, ``mixtral``, ``phi3``: a sliding window on every layer, when set.
- ``qwen3``: RMSNorm of each head of q and k before RoPE, an explicit head_dim.
- ``phi3`` (Phi-3, Phi-4): q/k/v fused in ``qkv_proj``, gate/up fused in ``gate_up_proj``.
- ``gemma2``, ``gemma3_text``: (1 + w) RMSNorm computed in fp32, norms before and after attention and the
  MLP, a GELU-tanh gated MLP, embeddings scaled by sqrt(hidden), the softmax scale from
  ``query_pre_attn_scalar``, alternating sliding-window and global layers (Gemma 3: each with its RoPE base,
  and q/k norms), attention (Gemma 2) and final logit soft-capping.
- ``mixtral``, ``qwen3_moe``, ``olmoe``: a mixture of experts in place of the MLP: a router picks the top-k
  experts of each token (``norm_topk_prob``: their weights renormalised), and the config may ask for the
  router's load-balancing loss (``output_router_logits``). Qwen3-MoE has Qwen3's q/k norms, OLMoE norms q and
  k over the whole projection.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from horizon_ray.errors import BadInput

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# Families users bring that the engine does not train, by model_type, with what to do instead.
_REFUSED_FAMILIES = {
    "gemma3": "a Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration); fine-tune its text "
              "model: save model.language_model as a Gemma3ForCausalLM (model_type gemma3_text)",
    "gemma": "Gemma 1 is not supported; Gemma 2 (gemma2) and Gemma 3 text (gemma3_text) are",
    "qwen2_moe": "Qwen2-MoE's shared expert is not supported; Qwen3-MoE (qwen3_moe) is",
    "phimoe": "Phi-3.5-MoE is not supported; Phi-3 / Phi-4 (phi3) and Mixtral (mixtral) are",
    "deepseek_v3": "DeepSeek-V3's latent attention and shared experts are not supported",
}
_FAMILY_NAMES = "Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma 2 / Gemma 3 / Mixtral / Qwen3-MoE / OLMoE"
GEMMA = ("gemma2", "gemma3_text")
MOE = ("mixtral", "qwen3_moe", "olmoe")
# Families whose layers may attend within a sliding window (every layer, or those layer_types names).
_SLIDING = ("mistral", "mixtral", "phi3", "qwen3", "qwen3_moe", "gemma2", "gemma3_text")
_WINDOW_DEFAULT = ("gemma2", "gemma3_text", "qwen3", "qwen3_moe")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Config keys that change the math in a way this engine does not implement, with the value it needs.
_REFUSED_IF = {
    "mlp_bias": (False, "MLP biases are not supported"),
    "attention_dropout": (0.0, "attention dropout is not supported (the engine trains without dropout)"),
    "resid_pdrop": (0.0, "residual dropout is not supported (the engine trains without dropout)"),
    "embd_pdrop": (0.0, "embedding dropout is not supported (the engine trains without dropout)"),
    "router_jitter_noise": (0.0, "router jitter noise is not supported"),
    "clip_qkv": (None, "clipping q, k and v (clip_qkv) is not supported"),
    "use_bidirectional_attention": (False, "bidirectional attention is not supported (decoder-only training)"),
    "mlp_only_layers": ([], "dense layers among the MoE layers (mlp_only_layers) are not supported"),
    "decoder_sparse_step": (1, "MoE on every n-th layer only (decoder_sparse_step) is not supported"),
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the HF model_type: a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width (unused by MoE layers, which use moe_intermediate_size)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # RoPE base of the global (full-attention) layers
    # llama3 rope scaling parameters, or None for plain RoPE.
    rope_llama3: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2, or Llama with attention_bias)
    o_bias: bool  # the output projection carries a bias (Llama with attention_bias)
    sliding_window: int | None  # sliding layers attend to at most this many previous tokens
    initializer_range: float
    # per layer: "full_attention" or "sliding_attention" (the sliding window applies; with local_rope_theta)
    layer_types: tuple[str, ...]
    rope_linear: float  # global layers' position interpolation: frequencies / this (Gemma 3 4B+: 8); 1: none
    local_rope_theta: float | None  # RoPE base of the sliding layers where it is their own (Gemma 3); None: global
    qk_norm: str | None  # RMSNorm of q and k before RoPE: "head" (Qwen3, Gemma 3), "proj" (OLMoE), or None
    norm_offset: float  # 1.0: norms scale by (1 + w) in fp32 (Gemma); 0.0: by w with Llama's casting
    sandwich_norms: bool  # norms also on the attention's and the MLP's outputs (Gemma)
    hidden_act: str  # the gated MLP's activation: "silu" or "gelu_tanh"
    embed_scale: bool  # embeddings multiplied by sqrt(hidden_size) in the compute dtype (Gemma)
    attn_scale: float  # the softmax scale: head_dim^-0.5, or query_pre_attn_scalar^-0.5 (Gemma)
    attn_softcap: float | None  # attention scores s -> c tanh(s / c) (Gemma 2)
    final_softcap: float | None  # logits z -> c tanh(z / c) (Gemma 2, Gemma 3 where set)
    fused_qkv: bool  # q, k, v are one tensor on disk and in the unit (Phi-3's qkv_proj)
    fused_gate_up: bool  # gate and up are one tensor (Phi-3's gate_up_proj)
    num_experts: int  # MoE: experts per layer; 0 for a dense MLP
    experts_per_token: int  # MoE: k of the top-k routing
    moe_intermediate_size: int  # MoE: each expert's MLP width
    norm_topk_prob: bool  # MoE: the top-k routing weights renormalised to sum to 1
    # MoE: the load-balancing loss's weight in the step's loss (router_aux_loss_coef); 0 when the config does
    # not ask for it (output_router_logits false), as HF computes it then.
    router_aux_coef: float
    # the embedding row of pad_token_id, which HF's nn.Embedding(padding_idx=...) gives no gradient; None: none
    padding_idx: int | None
    hf: dict = field(repr=False, compare=False, hash=False)  # the config.json it came from

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def layer_norms(self) -> dict[str, str]:
        return layer_norms(self)

    @property
    def projections(self) -> dict[str, tuple[str, str]]:
        return family_projections(self)

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
        if model_type in _REFUSED_FAMILIES:
            raise BadInput(f"model_type {model_type!r} is not supported: {_REFUSED_FAMILIES[model_type]}")
        if model_type not in ARCHITECTURES:
            raise BadInput(
                f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)} "
                f"(decoder-only {_FAMILY_NAMES})"
            )
        archs = hf.get("architectures") or [ARCHITECTURES[model_type]]
        if archs != [ARCHITECTURES[model_type]]:
            raise BadInput(f"architectures {archs} are not supported; expected [{ARCHITECTURES[model_type]!r}]")
        for key, (ok, why) in _REFUSED_IF.items():
            if key in hf and hf[key] not in (ok, None):
                raise BadInput(f"config field {key}={hf[key]!r}: {why}")
        if model_type == "qwen2" and hf.get("use_sliding_window"):
            raise BadInput("config field use_sliding_window=True: Qwen2 sliding-window attention is not supported")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise BadInput(f"config field pretraining_tp={hf['pretraining_tp']}: only 1 is supported")
        gemma = model_type in GEMMA
        act = _activation(hf, gemma)

        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise BadInput(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        layers = int(hf["num_hidden_layers"])
        types = _layer_types(hf, model_type, layers)
        # the window, with HF's default where the family has one and the config leaves the key out
        window = hf.get("sliding_window", 4096 if model_type in _WINDOW_DEFAULT else None) \
            if model_type in _SLIDING else None
        if model_type in ("qwen3", "qwen3_moe") and not hf.get("use_sliding_window"):
            window = None  # HF's Qwen3 drops the window unless use_sliding_window
        if not window:  # a sliding layer without a window attends to everything (as HF's masks do)
            types, window = ("full_attention",) * layers, None
        global_rope, local_theta = _rope(hf, model_type)
        # (Phi-3's and Mixtral's attention has no biases whatever the field says: HF ignores it there)
        attention_bias = bool(hf.get("attention_bias", False)) and model_type not in ("phi3", "mixtral")
        query_scalar = hf.get("query_pre_attn_scalar", 256) if gemma else None
        caps = _softcaps(hf, model_type)
        experts, top_k, moe_width, renorm, aux = _experts(hf, model_type)
        return ModelConfig(
            arch=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=global_rope["theta"],
            rope_llama3=global_rope["llama3"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            sliding_window=int(window) if window else None,
            initializer_range=float(hf.get("initializer_range", 0.02)),
            layer_types=types,
            rope_linear=global_rope["linear"],
            local_rope_theta=local_theta,
            qk_norm="head" if model_type in ("qwen3", "qwen3_moe", "gemma3_text") else
                    "proj" if model_type == "olmoe" else None,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            hidden_act=act,
            embed_scale=gemma,
            attn_scale=float(query_scalar) ** -0.5 if gemma else head_dim**-0.5,
            attn_softcap=caps[0],
            final_softcap=caps[1],
            fused_qkv=model_type == "phi3",
            fused_gate_up=model_type == "phi3",
            num_experts=experts,
            experts_per_token=top_k,
            moe_intermediate_size=moe_width,
            norm_topk_prob=renorm,
            router_aux_coef=aux,
            padding_idx=_padding_idx(hf),
            hf=dict(hf),
        )


def _padding_idx(hf: dict) -> int | None:
    pad = hf.get("pad_token_id")
    return int(pad) if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < int(hf["vocab_size"]) \
        else None


def _activation(hf: dict, gemma: bool) -> str:
    if gemma:  # Gemma reads hidden_activation (HF ignores hidden_act there)
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise BadInput(f"config field hidden_activation={act!r}: Gemma's MLP is supported with "
                           "'gelu_pytorch_tanh' only")
        return "gelu_tanh"
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", None):
        raise BadInput(f"config field hidden_act={act!r}: only the SwiGLU MLP (hidden_act='silu') is supported")
    return "silu"


def _layer_types(hf: dict, model_type: str, layers: int) -> tuple[str, ...]:
    """Each layer's attention: the config's layer_types, or the family's default pattern."""
    given = hf.get("layer_types")
    if given:
        given = tuple(given)
        if len(given) != layers or not set(given) <= set(LAYER_TYPES):
            raise BadInput(f"config field layer_types must list one of {list(LAYER_TYPES)} per layer "
                           f"({layers} layers), got {sorted(set(given))} x {len(given)}")
        if model_type not in _SLIDING and set(given) != {"full_attention"}:
            raise BadInput(f"config field layer_types={sorted(set(given))}: only full_attention is supported")
        return given
    if model_type == "gemma2":  # even layers slide
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
    if model_type == "gemma3_text":  # five sliding layers, then a global one
        every = int(hf.get("sliding_window_pattern") or 6)
        return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers))
    if model_type in ("qwen3", "qwen3_moe"):  # the layers from max_window_layers on, when use_sliding_window
        first = int(hf.get("max_window_layers") or layers) if hf.get("use_sliding_window") else layers
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    if model_type in ("mistral", "mixtral", "phi3"):  # every layer, when a window is set
        return ("sliding_attention",) * layers
    return ("full_attention",) * layers


def _rope_entry(rope: dict, where: str) -> dict:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise BadInput(f"{where}: partial_rotary_factor != 1 is not supported")
    out = {"theta": float(rope["rope_theta"]), "llama3": None, "linear": 1.0}
    if rope_type == "llama3":
        out["llama3"] = {k: float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings")}
    elif rope_type == "linear":
        out["linear"] = float(rope["factor"])
    elif rope_type != "default":
        raise BadInput(f"{where}: rope type {rope_type!r} is not supported; supported: 'default', 'llama3', "
                       "'linear'")
    return out


def _rope(hf: dict, model_type: str) -> tuple[dict, float | None]:
    """(the global layers' RoPE: theta, llama3, linear; the sliding layers' own base, or None)."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling")
    if model_type == "gemma3_text":
        # per layer type: the v5 config's rope_parameters by type, or rope_theta / rope_scaling for the global
        # layers and rope_local_base_freq for the sliding ones
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if legacy:
            full.update(legacy)
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        glob, loc = _rope_entry(full, "rope of the global layers"), _rope_entry(local, "rope of the sliding layers")
        if loc["llama3"] is not None or loc["linear"] != 1.0:
            raise BadInput("rope of the sliding layers: only plain RoPE ('default') is supported there")
        return glob, loc["theta"]
    if legacy:
        params.update(legacy)
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))  # Phi's top-level key
    return _rope_entry(params, "rope"), None


def _softcaps(hf: dict, model_type: str) -> tuple[float | None, float | None]:
    """(attention, final logits) soft-caps, with HF's defaults where the config leaves them out."""
    if model_type == "gemma2":
        attn, final = hf.get("attn_logit_softcapping", 50.0), hf.get("final_logit_softcapping", 30.0)
    elif model_type == "gemma3_text":
        if hf.get("attn_logit_softcapping") is not None:
            raise BadInput(f"config field attn_logit_softcapping={hf['attn_logit_softcapping']!r}: Gemma 3 does "
                           "not cap attention scores (transformers ignores the field); set it to null")
        attn, final = None, hf.get("final_logit_softcapping")
    else:
        attn = final = None
    return (float(attn) if attn else None), (float(final) if final else None)


def _experts(hf: dict, model_type: str) -> tuple[int, int, int, bool, float]:
    """(experts, top-k, expert width, renormalised top-k, aux loss weight); zeros for a dense family."""
    if model_type not in MOE:
        return 0, 0, 0, False, 0.0
    if model_type == "mixtral":  # Mixtral always renormalises its top-k weights
        n, k, width, renorm = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2), \
            hf["intermediate_size"], True
    elif model_type == "qwen3_moe":
        n = hf.get("num_experts") or hf.get("num_local_experts") or 128
        k, width, renorm = hf.get("num_experts_per_tok", 8), hf.get("moe_intermediate_size", 768), \
            bool(hf.get("norm_topk_prob", False))
    else:  # olmoe
        n = hf.get("num_experts") or hf.get("num_local_experts") or 64
        k, width, renorm = hf.get("num_experts_per_tok", 8), hf["intermediate_size"], \
            bool(hf.get("norm_topk_prob", False))
    n, k, width = int(n), int(k), int(width)
    if not 1 <= k <= n:
        raise BadInput(f"config field num_experts_per_tok={k}: must lie in [1, {n}] (the number of experts)")
    default_coef = 0.01 if model_type == "olmoe" else 0.001
    aux = float(hf.get("router_aux_loss_coef", default_coef)) if hf.get("output_router_logits") else 0.0
    return n, k, width, renorm, aux


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
            ts = [by_key.get(m) for m in members]
            if None in ts or any(a.offset + a.numel != b.offset or a.shape[1:] != b.shape[1:]
                                 for a, b in zip(ts, ts[1:])):
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
    for stack in EXPERT_STACKS:
        members = [t for t in slots if _is_expert_key(t.key) and t.key.split(".")[-1] in
                   (("gate", "up") if stack == "experts.gate_up" else ("down",))]
        if members:
            n = len(members) // (2 if stack == "experts.gate_up" else 1)
            first, last = members[0], members[-1]
            assert last.offset + last.numel - first.offset == sum(t.numel for t in members), "experts not adjacent"
            rows = sum(t.shape[0] for t in members) // n
            stacks.append((stack, first.offset, (n, rows, first.shape[1])))
    return UnitLayout(name, tuple(slots), tuple(stacks))


# HF names of a MoE layer's router and experts: (block, router, per-expert gate, up, down)
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
}


def layer_entries(cfg, i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, key, shape) of every tensor of decoder layer i, in the unit's order. `cfg`: a ModelConfig or
    any shape with its fields (the planner's ModelShape)."""
    H, I, q, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    p = f"model.layers.{i}."
    entries = [(p + "input_layernorm.weight", "ln1", (H,))]
    if cfg.fused_qkv:
        entries.append((p + "self_attn.qkv_proj.weight", "qkv", (q + 2 * kv, H)))
    else:
        entries += [
            (p + "self_attn.q_proj.weight", "q", (q, H)),
            (p + "self_attn.k_proj.weight", "k", (kv, H)),
            (p + "self_attn.v_proj.weight", "v", (kv, H)),
        ]
    if cfg.qkv_bias:
        entries += [
            (p + "self_attn.q_proj.bias", "q_b", (q,)),
            (p + "self_attn.k_proj.bias", "k_b", (kv,)),
            (p + "self_attn.v_proj.bias", "v_b", (kv,)),
        ]
    if cfg.qk_norm:
        per_head = cfg.qk_norm == "head"
        entries += [(p + "self_attn.q_norm.weight", "q_norm", (hd if per_head else q,)),
                    (p + "self_attn.k_norm.weight", "k_norm", (hd if per_head else kv,))]
    entries.append((p + "self_attn.o_proj.weight", "o", (H, q)))
    if cfg.o_bias:
        entries.append((p + "self_attn.o_proj.bias", "o_b", (H,)))
    if cfg.sandwich_norms:
        entries += [(p + "post_attention_layernorm.weight", "ln1_post", (H,)),
                    (p + "pre_feedforward_layernorm.weight", "ln2", (H,))]
    else:
        entries.append((p + "post_attention_layernorm.weight", "ln2", (H,)))
    if cfg.num_experts:
        block, router, gate, up, down = _EXPERT_NAMES[cfg.arch]
        E, W = cfg.num_experts, cfg.moe_intermediate_size
        m = f"{p}{block}."
        entries.append((m + f"{router}.weight", "router", (E, H)))
        # each expert's gate then up rows, expert after expert: one [E, 2W, H] stack; then the downs: [E, H, W]
        for e in range(E):
            entries += [(m + f"experts.{e}.{gate}.weight", f"experts.{e}.gate", (W, H)),
                        (m + f"experts.{e}.{up}.weight", f"experts.{e}.up", (W, H))]
        entries += [(m + f"experts.{e}.{down}.weight", f"experts.{e}.down", (H, W)) for e in range(E)]
    elif cfg.fused_gate_up:
        entries += [(p + "mlp.gate_up_proj.weight", "gate_up", (2 * I, H)),
                    (p + "mlp.down_proj.weight", "down", (H, I))]
    else:
        entries += [
            (p + "mlp.gate_proj.weight", "gate", (I, H)),
            (p + "mlp.up_proj.weight", "up", (I, H)),
            (p + "mlp.down_proj.weight", "down", (H, I)),
        ]
    if cfg.sandwich_norms:
        entries.append((p + "post_feedforward_layernorm.weight", "ln2_post", (H,)))
    return entries


def unit_layouts(cfg: ModelConfig) -> list[UnitLayout]:
    """embed, layer.0 .. layer.{L-1}, head: the streaming order of the forward pass."""
    H, V = cfg.hidden_size, cfg.vocab_size
    units = [_unit("embed", [("model.embed_tokens.weight", "embed", (V, H))])]
    units += [_unit(f"layer.{i}", layer_entries(cfg, i)) for i in range(cfg.num_layers)]
    head = [("model.norm.weight", "norm", (H,))]
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
# The expert targets: PEFT's ParamWrapper adapts one stacked parameter per target, A [r x E, in] and
# B [out, r x E].
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
# The norms of a Llama-style decoder layer (HF module name -> key in a layer unit). With the final norm (HF
# module "model.norm"), the norms LoRA may train beside its adapters (PEFT's modules_to_save); each family's
# own table: layer_norms.
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


def family_projections(cfg) -> dict[str, tuple[str, str]]:
    """The projections LoRA can target on `cfg`'s family (a ModelConfig or the planner's ModelShape), in
    the layer's order: name -> (key, HF module path)."""
    attn = ("qkv_proj",) if cfg.fused_qkv else ("q_proj", "k_proj", "v_proj")
    if cfg.num_experts:
        mlp = EXPERT_TARGETS
    else:
        mlp = ("gate_up_proj", "down_proj") if cfg.fused_gate_up else ("gate_proj", "up_proj", "down_proj")
    return {name: LORA_TARGETS[name] for name in (*attn, "o_proj", *mlp)}


def default_lora_targets(cfg) -> tuple[str, ...]:
    """PEFT's default target_modules for the family (its table of defaults): q_proj and v_proj, Phi-3's
    qkv_proj."""
    return ("qkv_proj",) if cfg.fused_qkv else ("q_proj", "v_proj")


def layer_norms(cfg) -> dict[str, str]:
    """The norms of a decoder layer of `cfg`'s family, HF module name inside the layer -> key in the unit."""
    if cfg.sandwich_norms:
        norms = {"input_layernorm": "ln1", "post_attention_layernorm": "ln1_post",
                 "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ln2_post"}
    else:
        norms = dict(LAYER_NORMS)
    if cfg.qk_norm:
        norms.update({"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"})
    return norms


def check_targets(cfg, targets) -> None:
    """Refuse LoRA targets that `cfg`'s family does not have, naming the ones it has."""
    have = family_projections(cfg)
    bad = [t for t in targets if t not in have]
    if bad:
        why = ""
        if cfg.num_experts and any(t in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") for t in bad):
            why = " (its MLP is a mixture of experts: target experts.gate_up_proj and experts.down_proj)"
        elif cfg.fused_qkv and any(t in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") for t in bad):
            why = " (its checkpoint fuses them: target qkv_proj and gate_up_proj)"
        raise BadInput(f"lora targets {bad} are not projections of this {cfg.arch} model{why}; choose among "
                       f"{', '.join(have)}", field="lora.targets")


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection LoRA can target on `cfg` (a ModelConfig, or any shape
    with hidden_size, intermediate_size, q_dim and kv_dim and the family's fields); an expert target's are
    those of one expert."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    W = cfg.moe_intermediate_size
    every = {"q_proj": (H, cfg.q_dim), "k_proj": (H, cfg.kv_dim), "v_proj": (H, cfg.kv_dim),
             "qkv_proj": (H, cfg.q_dim + 2 * cfg.kv_dim), "o_proj": (cfg.q_dim, H), "gate_proj": (H, I),
             "up_proj": (H, I), "gate_up_proj": (H, 2 * I), "down_proj": (I, H),
             "experts.gate_up_proj": (H, 2 * W), "experts.down_proj": (W, H)}
    return {name: every[name] for name in family_projections(cfg)}


def adapter_params_of(cfg, target: str, r: int) -> int:
    """Parameters of one layer's LoRA adapter on `target`: A [r, in] + B [out, r], per expert for the experts."""
    fan_in, fan_out = projection_shapes(cfg)[target]
    return r * (fan_in + fan_out) * (cfg.num_experts if target in EXPERT_TARGETS else 1)


def modules_to_save_norms(cfg, entries) -> tuple[list[tuple[str, ...]], bool]:
    """Which norms PEFT's ``modules_to_save`` entries select on a decoder-only HF model of `cfg`'s family, by
    PEFT's rule (a module is selected when its dotted name ends with an entry, so "norm" selects every norm,
    Qwen3's q_norm and k_norm included): per layer, the selected names among the family's layer norms, and
    whether the final norm is selected. Refuses an entry that selects nothing, or a module other than a norm,
    naming it and the fix."""
    num_layers, table = cfg.num_layers, layer_norms(cfg)
    per_layer: list[tuple[str, ...]] = [() for _ in range(num_layers)]
    final = False
    if not entries:
        return per_layer, final
    layer_children = ("self_attn", "mlp", "act_fn", *(module for _, module in family_projections(cfg).values()))
    if cfg.num_experts:
        layer_children += (f"{_EXPERT_NAMES[cfg.arch][0]}.gate", f"{_EXPERT_NAMES[cfg.arch][0]}.experts")
    others = ["model", "model.embed_tokens", "model.layers", "model.rotary_emb", "lm_head"]
    for i in range(num_layers):
        others.append(f"model.layers.{i}")
        others += [f"model.layers.{i}.{c}" for c in layer_children]
    norms = ", ".join(n.split(".")[-1] for n in table)
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


def packed_parts(quantize: str, shape: tuple[int, ...], c: int) -> list[tuple[str, int]]:
    """(part, bytes) of one tensor as the store packs it: "w" in the compute dtype (c bytes) when it is not
    quantized; 4-bit: the codes (two a byte), one uint8 scale per block, one fp32 absmax per block of block
    scales and their fp32 offset (their mean); int8: the int8 weights and one fp32 scale a row (SCB)."""
    n = math.prod(shape)
    if quantize in ("nf4", "fp4"):
        blocks = -(-n // QUANT_BLOCK)
        return [("codes", -(-n // 2)), ("absmax", blocks), ("absmax2", 4 * -(-blocks // QUANT_NESTED_BLOCK)),
                ("offset", 4)]
    if quantize == "int8":
        return [("cb", n), ("scb", 4 * shape[0])]
    return [("w", n * c)]


def packed_nbytes(quantize: str, shape: tuple[int, ...], c: int) -> int:
    """Host bytes of one tensor packed (its parts, each rounded up to the alignment)."""
    return sum(-(-b // _PACK_ALIGN) * _PACK_ALIGN for _, b in packed_parts(quantize, shape, c))


def packed_layer_bytes(entries, quantize: str, c: int) -> int:
    """Host bytes of a layer unit with ``quantize`` (entries: layer_entries' (name, key, shape))."""
    return sum(packed_nbytes(quantize if is_quantized(key, quantize) else "none", shape, c)
               for _, key, shape in entries)
