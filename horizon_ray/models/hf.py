"""Reading an HF config.json: the fields every family reads alike (geometry, RoPE, the attention pattern, the
refusals), for the family modules to compose. Each reads the field as transformers does, with its defaults."""

from __future__ import annotations

from horizon_ray.errors import BadInput
from horizon_ray.models.blocks import LAYER_TYPES, Layer
from horizon_ray.models.config import ModelConfig

# Config keys that change the math in a way this engine does not implement, with the value it needs.
REFUSED_IF = {
    "mlp_bias": (False, "MLP biases are not supported"),
    "attention_dropout": (0.0, "attention dropout is not supported (the engine trains without dropout)"),
    "resid_pdrop": (0.0, "residual dropout is not supported (the engine trains without dropout)"),
    "embd_pdrop": (0.0, "embedding dropout is not supported (the engine trains without dropout)"),
    "router_jitter_noise": (0.0, "router jitter noise is not supported"),
    "clip_qkv": (None, "clipping q, k and v (clip_qkv) is not supported"),
    "use_bidirectional_attention": (False, "bidirectional attention is not supported (decoder-only training)"),
}


def refuse_unsupported(hf: dict) -> None:
    for key, (ok, why) in REFUSED_IF.items():
        if key in hf and hf[key] not in (ok, None):
            raise BadInput(f"config field {key}={hf[key]!r}: {why}")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise BadInput(f"config field pretraining_tp={hf['pretraining_tp']}: only 1 is supported")


def geometry(hf: dict) -> tuple[int, int, int, int, int]:
    """(hidden, heads, kv heads, head_dim, layers)."""
    hidden = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise BadInput(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return hidden, heads, kv_heads, head_dim, int(hf["num_hidden_layers"])


def silu(hf: dict) -> str:
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", None):
        raise BadInput(f"config field hidden_act={act!r}: only the SwiGLU MLP (hidden_act='silu') is supported")
    return "silu"


def layer_types(hf: dict, layers: int, default: tuple[str, ...], slides: bool = True) -> tuple[str, ...]:
    """Each layer's attention: the config's layer_types, or the family's ``default`` pattern. ``slides``: the
    family has sliding-window layers at all."""
    given = hf.get("layer_types")
    if not given:
        return default
    given = tuple(given)
    if len(given) != layers or not set(given) <= set(LAYER_TYPES):
        raise BadInput(f"config field layer_types must list one of {list(LAYER_TYPES)} per layer "
                       f"({layers} layers), got {sorted(set(given))} x {len(given)}")
    if not slides and set(given) != {"full_attention"}:
        raise BadInput(f"config field layer_types={sorted(set(given))}: only full_attention is supported")
    return given


def window(hf: dict, types: tuple[str, ...], default: int | None = None) -> tuple[tuple[str, ...], int | None]:
    """(layer types, sliding window): HF's default where the config leaves the key out; a sliding layer without
    a window attends to everything (as HF's masks do)."""
    w = hf.get("sliding_window", default)
    if not w:
        return ("full_attention",) * len(types), None
    return types, int(w)


def rope_entry(rope: dict, where: str) -> dict:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise BadInput(f"{where}: partial_rotary_factor != 1 is not supported")
    out: dict = {"theta": float(rope["rope_theta"]), "llama3": None, "linear": 1.0}
    if rope_type == "llama3":
        out["llama3"] = {k: float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                     "original_max_position_embeddings")}
    elif rope_type == "linear":
        out["linear"] = float(rope["factor"])
    elif rope_type != "default":
        raise BadInput(f"{where}: rope type {rope_type!r} is not supported; supported: 'default', 'llama3', "
                       "'linear'")
    return out


def rope(hf: dict) -> dict:
    """The RoPE of every layer: theta, llama3, linear; from rope_parameters (v5) or rope_theta / rope_scaling."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling")
    if legacy:
        params.update(legacy)
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))  # Phi's top-level key
    return rope_entry(params, "rope")


def padding_idx(hf: dict) -> int | None:
    pad = hf.get("pad_token_id")
    return int(pad) if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < int(hf["vocab_size"]) \
        else None


def router_aux_coef(hf: dict, default: float) -> float:
    """The load-balancing loss's weight: router_aux_loss_coef when output_router_logits, else 0 (as HF)."""
    return float(hf.get("router_aux_loss_coef", default)) if hf.get("output_router_logits") else 0.0


def top_k(hf: dict, experts: int, default: int) -> int:
    k = int(hf.get("num_experts_per_tok", default))
    if not 1 <= k <= experts:
        raise BadInput(f"config field num_experts_per_tok={k}: must lie in [1, {experts}] (the number of experts)")
    return k


def sparse_layers(hf: dict, layers: int) -> tuple[bool, ...]:
    """Which layers are MoE in the Qwen MoE families: not in mlp_only_layers, and every decoder_sparse_step-th
    (HF: ``layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0``)."""
    # None (absent or null) is HF's default; 0 is a value, and refused below, as HF would divide by it
    dense = hf.get("mlp_only_layers")
    dense = [] if dense is None else dense
    step = hf.get("decoder_sparse_step")
    step = 1 if step is None else step
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise BadInput(f"config field decoder_sparse_step={step!r}: must be an integer >= 1")
    if not isinstance(dense, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in dense):
        raise BadInput(f"config field mlp_only_layers={dense!r}: must be a list of layer indices")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def model_config(hf: dict, arch: str, layers: list[Layer], *, rope: dict, tie_default: bool = False,
                 sliding_window: int | None = None, local_rope_theta: float | None = None, norm_offset: float = 0.0,
                 hidden_act: str = "silu", embed_scale: bool = False, attn_scale: float | None = None,
                 final_softcap: float | None = None, router_aux: float = 0.0) -> ModelConfig:
    """The ModelConfig of a family's layers, with the fields every family reads alike."""
    hidden, heads, kv_heads, head_dim, num_layers = geometry(hf)
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope["theta"],
        rope_llama3=rope["llama3"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        sliding_window=sliding_window,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        rope_linear=rope["linear"],
        local_rope_theta=local_rope_theta,
        norm_offset=norm_offset,
        hidden_act=hidden_act,
        embed_scale=embed_scale,
        attn_scale=head_dim**-0.5 if attn_scale is None else attn_scale,
        final_softcap=final_softcap,
        router_aux_coef=router_aux,
        padding_idx=padding_idx(hf),
        layers=tuple(layers),
        hf=dict(hf),
    )
