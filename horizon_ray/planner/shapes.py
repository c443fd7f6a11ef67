"""Model shapes: what the planner needs to know of a model, from a preset or an HF config.json.

A shape is the model's family description (``horizon_ray.models``: ``ModelConfig``, plain Python, no torch,
so the planner stays cheap for the coordinator and the API), the same the engine lays its units out from:
``embed`` [V, H], one unit per decoder layer (each its own layer's blocks: the family's norms, fused
projections, and for a mixture of experts the router and every expert; layers may differ), and ``head``
(final norm [H], plus the LM head [V, H] unless it is tied to the embedding). So the parameter counts here
equal the engine's unit sizes element for element; a unit test checks it. A preset is an HF config.json
read the same way, with its name and where its numbers come from.

A MoE layer streams and updates all its experts (host RAM, PCIe, the host AdamW count every one), while a
token's matmuls use only its top-k experts, the router and any shared expert (``active_matmul_params``: the
FLOPs).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from horizon_ray.engine.model import (
    ARCHITECTURES,
    EXPERT_TARGETS,
    adapter_params_of,
    check_targets,
    layer_entries,
    modules_to_save_norms,
)
from horizon_ray.errors import BadInput
from horizon_ray.models import from_hf
from horizon_ray.models.config import ModelConfig
from horizon_ray.workload import Adapters

# The planner's name for a model: its family's description, with a preset's name and note.
ModelShape = ModelConfig


def parse_shape(hf: dict, name: str = "config", note: str = "") -> ModelConfig:
    """From an HF config dict, read by the family's own parser (so that what the engine refuses, MLP biases,
    other rope types, ..., is not planned either)."""
    try:
        cfg = from_hf(hf)
    except KeyError as exc:
        raise BadInput(f"{name}: config lacks {exc.args[0]!r}; give a complete HF config.json") from None
    except ZeroDivisionError:
        raise BadInput(f"{name}: every size in the config must be >= 1") from None
    except ValueError as exc:
        if isinstance(exc, BadInput):
            raise
        raise BadInput(f"{name}: {exc}") from None
    if min(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
           cfg.vocab_size) < 1:
        raise BadInput(f"{name}: every size in the config must be >= 1")
    return cfg.named(name, note)


_HF = "values of the model's config.json on the HF hub"
# What transformers needs beyond a preset's geometry to build the model (the engine ignores what it does not read)
_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 32768}


def _from_config(name: str, note: str = _HF, **hf) -> ModelConfig:
    """A preset of a family: its config.json (the fields the family needs beyond the geometry included), read
    the way the engine reads one, so that to_hf_config gives the model back."""
    heads = hf["num_attention_heads"]
    config = {"architectures": [ARCHITECTURES[hf["model_type"]]], **_DEFAULTS,
              "num_key_value_heads": heads, "head_dim": hf["hidden_size"] // heads, **hf}
    if "hidden_activation" in config:  # Gemma reads hidden_activation only
        del config["hidden_act"]
    return parse_shape(config, name, note)


def _preset(name, arch, H, I, L, heads, kv, V, tied, note, head_dim=None) -> ModelConfig:
    return _from_config(name, note, model_type=arch, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim or H // heads,
                        vocab_size=V, tie_word_embeddings=tied)


def _qwen3(name, H, I, L, heads, tied):
    return _from_config(name, model_type="qwen3", hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                        num_attention_heads=heads, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                        tie_word_embeddings=tied, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def _qwen3_moe(name, H, L, heads, width):
    return _from_config(name, model_type="qwen3_moe", hidden_size=H, intermediate_size=3 * H, num_hidden_layers=L,
                        num_attention_heads=heads, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                        tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=width, norm_topk_prob=True, rope_theta=1_000_000.0)


def _gemma3(name, H, I, L, heads, kv, hd, V, window, scaling):
    rope: dict[str, Any] = {"rope_scaling": {"rope_type": "linear", "factor": 8.0}} if scaling else {}
    return _from_config(name, model_type="gemma3_text", hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, vocab_size=V,
                        tie_word_embeddings=True, query_pre_attn_scalar=hd if name.endswith("27b") else 256,
                        sliding_window=window, sliding_window_pattern=6, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, hidden_activation="gelu_pytorch_tanh", **rope)


def _gemma2(name, H, I, L, heads, kv, hd, scalar):
    return _from_config(name, model_type="gemma2", hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, vocab_size=256000,
                        tie_word_embeddings=True, query_pre_attn_scalar=scalar, sliding_window=4096,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        hidden_activation="gelu_pytorch_tanh")


def _mixtral(name, H, I, L, heads, V):
    return _from_config(name, model_type="mixtral", hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                        num_attention_heads=heads, num_key_value_heads=8, vocab_size=V, tie_word_embeddings=False,
                        num_local_experts=8, num_experts_per_tok=2, rope_theta=1_000_000.0, rms_norm_eps=1e-5)


def _qwen2_moe(name, H, I, L, heads, kv, experts, k, width, shared):
    return _from_config(name, model_type="qwen2_moe", hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=151936,
                        tie_word_embeddings=False, num_experts=experts, num_experts_per_tok=k,
                        moe_intermediate_size=width, shared_expert_intermediate_size=shared, norm_topk_prob=False)


# Known shapes, by name. Family = the name's prefix before the size (see FAMILIES).
PRESETS: dict[str, ModelShape] = {s.name: s for s in [
    _preset("qwen2.5-0.5b", "qwen2", 896, 4864, 24, 14, 2, 151936, True, _HF),
    _preset("qwen2.5-1.5b", "qwen2", 1536, 8960, 28, 12, 2, 151936, True, _HF),
    _preset("qwen2.5-3b", "qwen2", 2048, 11008, 36, 16, 2, 151936, True, _HF),
    _preset("qwen2.5-7b", "qwen2", 3584, 18944, 28, 28, 4, 152064, False, _HF),
    _preset("qwen2.5-14b", "qwen2", 5120, 13824, 48, 40, 8, 152064, False, _HF),
    _preset("qwen2.5-32b", "qwen2", 5120, 27648, 64, 40, 8, 152064, False, _HF),
    _preset("qwen2.5-72b", "qwen2", 8192, 29568, 80, 64, 8, 152064, False, _HF),
    _preset("llama-3.2-1b", "llama", 2048, 8192, 16, 32, 8, 128256, True, _HF),
    _preset("llama-3.2-3b", "llama", 3072, 8192, 28, 24, 8, 128256, True, _HF),
    _preset("llama-3.1-8b", "llama", 4096, 14336, 32, 32, 8, 128256, False, _HF),
    _preset("llama-3.1-70b", "llama", 8192, 28672, 80, 64, 8, 128256, False, _HF),
    _preset("dense-110b", "llama", 10240, 28672, 96, 80, 8, 128256, False,
            "a ~110B dense Llama-style shape: 96 layers, hidden 10240, MLP 28672, GQA with 8 KV heads"),
    _preset("dense-120b", "qwen2", 8192, 29568, 134, 64, 8, 152064, False,
            "the Horizon-LM paper's 120B-on-1.5 TB case: its code trains Qwen2-architecture models and we "
            "found no published shape, so this is Qwen2.5-72B's layer stacked 134 deep (120.2B)"),
    _preset("mistral-large-123b", "mistral", 12288, 28672, 88, 96, 8, 32768, False,
            "a real 120B-class dense shape (Mistral-Large-Instruct-2407's config.json)", head_dim=128),
    _qwen3("qwen3-0.6b", 1024, 3072, 28, 16, True),
    _qwen3("qwen3-1.7b", 2048, 6144, 28, 16, True),
    _qwen3("qwen3-4b", 2560, 9728, 36, 32, True),
    _qwen3("qwen3-8b", 4096, 12288, 36, 32, False),
    _qwen3("qwen3-14b", 5120, 17408, 40, 40, False),
    _qwen3("qwen3-32b", 5120, 25600, 64, 64, False),
    _qwen3_moe("qwen3-30b-a3b", 2048, 48, 32, 768),
    _qwen3_moe("qwen3-235b-a22b", 4096, 94, 64, 1536),
    # Gemma 3 4B-27B are vision-language checkpoints: these are their text models (text_config)
    _gemma3("gemma-3-1b", 1152, 6912, 26, 4, 1, 256, 262144, 512, False),
    _gemma3("gemma-3-4b", 2560, 10240, 34, 8, 4, 256, 262208, 1024, True),
    _gemma3("gemma-3-12b", 3840, 15360, 48, 16, 8, 256, 262208, 1024, True),
    _gemma3("gemma-3-27b", 5376, 21504, 62, 32, 16, 128, 262208, 1024, True),
    _gemma2("gemma-2-2b", 2304, 9216, 26, 8, 4, 256, 256),
    _gemma2("gemma-2-9b", 3584, 14336, 42, 16, 8, 256, 256),
    _gemma2("gemma-2-27b", 4608, 36864, 46, 32, 16, 128, 144),
    _from_config("phi-3-mini", model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False,
                 sliding_window=2047, rope_theta=10000.0, rms_norm_eps=1e-5),
    _from_config("phi-4", model_type="phi3", hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                 num_attention_heads=40, num_key_value_heads=10, vocab_size=100352, tie_word_embeddings=False,
                 rope_theta=250000.0, rms_norm_eps=1e-5),
    _mixtral("mixtral-8x7b", 4096, 14336, 32, 32, 32000),
    _mixtral("mixtral-8x22b", 6144, 16384, 56, 48, 32768),
    _qwen2_moe("qwen1.5-moe-a2.7b", 2048, 5632, 24, 16, 16, 60, 4, 1408, 5632),
    _qwen2_moe("qwen2-57b-a14b", 3584, 18944, 28, 28, 4, 64, 8, 2560, 20480),
    _from_config("olmoe-1b-7b", model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=16, vocab_size=50304, tie_word_embeddings=False,
                 num_experts=64, num_experts_per_tok=8, rms_norm_eps=1e-5),
]}


def _named(prefix: str) -> tuple[str, ...]:
    return tuple(n for n in PRESETS if n.startswith(prefix))


FAMILIES: dict[str, tuple[str, ...]] = {
    "qwen2.5": _named("qwen2.5-"),
    "llama-3": _named("llama-3"),
    "dense": ("dense-110b", "dense-120b", "mistral-large-123b"),
    "qwen3": tuple(n for n in _named("qwen3-") if not PRESETS[n].num_experts),
    "qwen3-moe": tuple(n for n in _named("qwen3-") if PRESETS[n].num_experts),
    "gemma-3": _named("gemma-3-"),
    "gemma-2": _named("gemma-2-"),
    "phi": _named("phi-"),
    "mixtral": _named("mixtral-"),
    "olmoe": _named("olmoe-"),
    "qwen2-moe": ("qwen1.5-moe-a2.7b", "qwen2-57b-a14b"),
    "moe": tuple(n for n in PRESETS if PRESETS[n].num_experts),
    "all": tuple(PRESETS),
}

# Hub ids people type, -> preset.
_ALIASES = {
    "qwen/qwen2.5-0.5b": "qwen2.5-0.5b", "qwen/qwen2.5-1.5b": "qwen2.5-1.5b", "qwen/qwen2.5-3b": "qwen2.5-3b",
    "qwen/qwen2.5-7b": "qwen2.5-7b", "qwen/qwen2.5-14b": "qwen2.5-14b", "qwen/qwen2.5-32b": "qwen2.5-32b",
    "qwen/qwen2.5-72b": "qwen2.5-72b", "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "meta-llama/llama-3.2-3b": "llama-3.2-3b", "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/meta-llama-3.1-70b": "llama-3.1-70b", "mistralai/mistral-large-instruct-2407": "mistral-large-123b",
    **{f"qwen/{n}": n for n in _named("qwen3-")},
    **{f"google/{n}": n for n in (*_named("gemma-3-"), *_named("gemma-2-"))},
    **{f"google/{n}-pt": n for n in (*_named("gemma-3-"),)},
    "microsoft/phi-4": "phi-4", "microsoft/phi-3-mini-4k": "phi-3-mini",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b", "mistralai/mixtral-8x22b-v0.1": "mixtral-8x22b",
    "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b", "mistralai/mixtral-8x22b-instruct-v0.1": "mixtral-8x22b",
    "allenai/olmoe-1b-7b-0924": "olmoe-1b-7b",
    "qwen/qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b", "qwen/qwen2-57b-a14b": "qwen2-57b-a14b",
}


def _preset_key(name: str) -> str | None:
    key, stripped = name.strip().lower(), None
    while stripped != key:  # "-Instruct-2507", "-it", ...
        stripped = key
        for suffix in ("-instruct", "-chat", "-it", "-base", "-2507"):
            key = key.removesuffix(suffix)
    key = _ALIASES.get(key, key)
    return key if key in PRESETS else None


def split_depth(name: str) -> tuple[str, int | None]:
    """``qwen2.5-14b@20L`` -> (``qwen2.5-14b``, 20); a name without ``@`` -> (name, None). The depth suffix is
    the name ``ModelShape.with_layers`` gives a stacked shape (what ``max_model(scan_depth=True)`` prints)."""
    base, at, depth = name.partition("@")
    if not at:
        return name, None
    m = re.fullmatch(r"(\d+)L", depth)
    if not m or int(m.group(1)) < 1:
        raise BadInput(f"shape {name!r}: write the depth as NAME@<layers>L, e.g. {base}@20L")
    return base, int(m.group(1))


def load_model_shape(model: str | Path | dict | ModelShape) -> ModelShape:
    """A preset name (``qwen2.5-7b``, ``Qwen/Qwen2.5-7B-Instruct``), a preset stacked to another depth
    (``qwen2.5-72b@64L``), a config.json path, a model directory holding one, or an HF config dict."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        return parse_shape(model, name=str(model.get("_name_or_path") or model.get("model_type")))
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if config.is_file():
        try:
            hf = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BadInput(f"cannot read {config}: {exc}; give a valid HF config.json") from None
        if not isinstance(hf, dict):
            raise BadInput(f"{config} is not a JSON object; give an HF config.json")
        return parse_shape(hf, name=str(path))
    base, layers = split_depth(str(model))
    key = _preset_key(base)
    if key is not None:
        shape = PRESETS[key]
        return shape if layers is None or layers == shape.num_layers else shape.with_layers(layers)
    guess = closest_preset(base)
    hint = f" (did you mean {guess!r}?)" if guess else ""
    raise BadInput(f"unknown model {str(model)!r}{hint}: not a known preset and no config.json at that path; "
                   f"known presets: {', '.join(PRESETS)} (or one stacked to another depth, NAME@<layers>L); "
                   "or pass an HF model directory / config.json")


def closest_preset(name: str) -> str | None:
    """The preset (or alias) a mistyped model name most likely meant, or None."""
    import difflib

    key = name.strip().lower().rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-chat"):
        key = key.removesuffix(suffix)
    names = [*PRESETS, *_ALIASES]
    found = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return _ALIASES.get(found[0], found[0]) if found else None


def adapter_layer_params(lora: Adapters, shape: ModelConfig, i: int = 0) -> int:
    """LoRA adapter parameters of layer i: A [r, in] + B [out, r] per targeted projection it has (per expert for
    the experts' stacked projections). Refuses a target the family does not have."""
    check_targets(shape, lora.targets)
    return sum(adapter_params_of(shape, t, lora.r, i) for t in lora.targets)


def adapter_active_layer_params(lora: Adapters, shape: ModelConfig, i: int = 0) -> int:
    """Of those, the ones a token's matmuls use: an expert target's k of E experts."""
    full = adapter_layer_params(lora, shape, i)
    moe = shape.layers[i].moe
    per_expert = [t for t in lora.targets if t in EXPERT_TARGETS]
    if not per_expert or moe is None:
        return full
    unused = sum(adapter_params_of(shape, t, lora.r, i) for t in per_expert)
    return full - unused * (moe.num_experts - moe.top_k) // moe.num_experts


def adapter_unit_params(lora: Adapters, shape: ModelConfig) -> list[int]:
    """Trained parameters of each adapter unit, as the engine lays them out: one per layer (its adapters and
    its selected norms), then one for the final norm when it is selected."""
    per_layer, final = modules_to_save_norms(shape, lora.modules_to_save)
    units = []
    for i, norms in enumerate(per_layer):
        size = {name.split(".", 3)[3].removesuffix(".weight"): math.prod(s) for name, _, s in layer_entries(shape, i)}
        units.append(adapter_layer_params(lora, shape, i) + sum(size[n] for n in norms))
    return units + [shape.hidden_size] if final else units


def adapter_params(lora: Adapters, shape: ModelConfig) -> int:
    """Parameters LoRA trains on `shape`: every adapter unit's."""
    return sum(adapter_unit_params(lora, shape))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def human_params(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 10**6 else str(n)


