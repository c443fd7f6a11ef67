"""Model shapes: what the planner needs to know of a model, from a preset or an HF config.json.

A shape is split into the engine's *units* (``horizon_ray.engine.model.unit_layouts``): ``embed`` [V, H],
one unit per decoder layer, and ``head`` (final norm [H], plus the LM head [V, H] unless it is tied to
the embedding). The parameter counts here must equal the engine's unit sizes element for element; a
unit test checks it. Parsing mirrors ``ModelConfig.from_hf`` without importing torch, so the planner
stays cheap for the coordinator and the API.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from horizon_ray.engine.model import ARCHITECTURES, ModelConfig, modules_to_save_norms, projection_shapes
from horizon_ray.errors import BadInput
from horizon_ray.workload import Adapters


@dataclass(frozen=True)
class ModelShape:
    name: str  # preset name or the path it was read from
    arch: str  # "llama" | "qwen2" | "mistral"
    hidden_size: int  # H
    intermediate_size: int  # I, the SwiGLU width
    num_layers: int  # L
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # V
    tie_word_embeddings: bool  # the LM head is the embedding (no head [V, H] unit of its own)
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2, or Llama with attention_bias)
    o_bias: bool = False  # the output projection carries a bias (Llama with attention_bias)
    note: str = ""  # where the numbers come from

    # ---- geometry ------------------------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Each projection of a decoder layer as (in_features, out_features)."""
        return projection_shapes(self)

    @property
    def layer_matmul_params(self) -> int:
        """Weight elements of a layer's seven projections (what its matmuls multiply by)."""
        return sum(i * o for i, o in self.linear_shapes().values())

    @property
    def layer_params(self) -> int:
        """One decoder layer's unit: projections, their biases and the two RMSNorm weights."""
        bias = (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.hidden_size * self.o_bias
        return self.layer_matmul_params + bias + 2 * self.hidden_size

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def num_params(self) -> int:
        return self.embed_params + self.num_layers * self.layer_params + self.head_params

    def units(self) -> list[tuple[str, int]]:
        """(name, parameter count) of each unit, in streaming order: embed, layer.0 .. layer.{L-1}, head."""
        return ([("embed", self.embed_params)]
                + [(f"layer.{i}", self.layer_params) for i in range(self.num_layers)]
                + [("head", self.head_params)])

    def with_layers(self, num_layers: int) -> ModelShape:
        return replace(self, name=f"{self.name}@{num_layers}L", num_layers=num_layers,
                       note=f"{self.name}'s layer stacked {num_layers} deep")

    def to_hf_config(self) -> dict:
        """A config.json for this shape (what ``Engine.from_config`` accepts)."""
        cfg = {
            "model_type": self.arch, "architectures": [ARCHITECTURES[self.arch]],
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "max_position_embeddings": 32768,
        }
        if self.arch != "qwen2":
            cfg["attention_bias"] = self.qkv_bias
        return cfg

    # ---- parsing -------------------------------------------------------------------------------------

    @staticmethod
    def from_hf(hf: dict, name: str = "config") -> ModelShape:
        """From an HF config dict, read by the engine's own ``ModelConfig.from_hf`` (so that what the engine
        refuses, MLP biases, other rope types, ..., is not planned either)."""
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise BadInput(f"{name}: model_type {model_type!r} is not supported; supported: "
                           f"{sorted(ARCHITECTURES)} (decoder-only Llama / Qwen2 / Mistral family)")
        try:
            cfg = ModelConfig.from_hf(hf)
        except KeyError as exc:
            raise BadInput(f"{name}: config lacks {exc.args[0]!r}; give a complete HF config.json") from None
        except ZeroDivisionError:
            raise BadInput(f"{name}: every size in the config must be >= 1") from None
        except ValueError as exc:
            raise BadInput(f"{name}: {exc}") from None
        shape = ModelShape(name=name, arch=cfg.arch, hidden_size=cfg.hidden_size,
                           intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                           num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                           qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias)
        if min(shape.hidden_size, shape.intermediate_size, shape.num_layers, shape.num_heads,
               shape.num_kv_heads, shape.head_dim, shape.vocab_size) < 1:
            raise BadInput(f"{name}: every size in the config must be >= 1")
        return shape


def _preset(name, arch, H, I, L, heads, kv, V, tied, note, head_dim=None) -> ModelShape:
    return ModelShape(name=name, arch=arch, hidden_size=H, intermediate_size=I, num_layers=L, num_heads=heads,
                      num_kv_heads=kv, head_dim=head_dim or H // heads, vocab_size=V, tie_word_embeddings=tied,
                      qkv_bias=arch == "qwen2", note=note)


_HF = "values of the model's config.json on the HF hub"
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
]}

FAMILIES: dict[str, tuple[str, ...]] = {
    "qwen2.5": tuple(n for n in PRESETS if n.startswith("qwen2.5-")),
    "llama-3": tuple(n for n in PRESETS if n.startswith("llama-3")),
    "dense": ("dense-110b", "dense-120b", "mistral-large-123b"),
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
}


def _preset_key(name: str) -> str | None:
    key = name.strip().lower()
    for suffix in ("-instruct", "-chat"):
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
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        return ModelShape.from_hf(model, name=str(model.get("_name_or_path") or model.get("model_type")))
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if config.is_file():
        try:
            hf = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BadInput(f"cannot read {config}: {exc}; give a valid HF config.json") from None
        if not isinstance(hf, dict):
            raise BadInput(f"{config} is not a JSON object; give an HF config.json")
        return ModelShape.from_hf(hf, name=str(path))
    base, layers = split_depth(str(model))
    key = _preset_key(base)
    if key is not None:
        shape = PRESETS[key]
        return shape if layers is None or layers == shape.num_layers else shape.with_layers(layers)
    raise BadInput(f"unknown model {str(model)!r}: not a known preset and no config.json at that path; "
                   f"known presets: {', '.join(PRESETS)} (or one stacked to another depth, NAME@<layers>L); "
                   "or pass an HF model directory / config.json")


def adapter_layer_params(lora: Adapters, shape: ModelShape) -> int:
    """LoRA adapter parameters of one layer: A [r, in] + B [out, r] per targeted projection."""
    lin = shape.linear_shapes()
    return sum(lora.r * (lin[t][0] + lin[t][1]) for t in lora.targets)


def adapter_unit_params(lora: Adapters, shape: ModelShape) -> list[int]:
    """Trained parameters of each adapter unit, as the engine lays them out: one per layer (its adapters and
    its selected norms), then one for the final norm when it is selected."""
    per_layer, final = modules_to_save_norms(shape.num_layers, lora.modules_to_save)
    units = [adapter_layer_params(lora, shape) + len(norms) * shape.hidden_size for norms in per_layer]
    return units + [shape.hidden_size] if final else units


def adapter_params(lora: Adapters, shape: ModelShape) -> int:
    """Parameters LoRA trains on `shape`: every adapter unit's."""
    return sum(adapter_unit_params(lora, shape))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def human_params(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 10**6 else str(n)


