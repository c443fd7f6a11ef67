"""Model shapes the benchmark builds at random init (nothing is downloaded), and their model FLOPs.

A shape is one of the planner's presets (``horizon_ray.planner.PRESETS``), ``tiny`` (a ~10M-parameter
CPU smoke test of the whole harness), or either stacked to another depth: ``qwen2.5-14b@20L``, the name
``ModelShape.with_layers`` gives. One description feeds all three systems: the engine and transformers
both read ``ModelShape.to_hf_config()``.
"""

from __future__ import annotations

from horizon_ray.planner import PRESETS, ModelShape, load_model_shape
from horizon_ray.planner.shapes import split_depth
from horizon_ray.planner.timing import flops_params, model_flops_per_token

# The house convention's FLOPs live with the planner (one definition for its MFU and the benchmark's).
__all__ = ["FIND_LARGEST_SHAPES", "SHAPES", "TINY", "flops_params", "hf_config", "model_flops_per_token",
           "resolve_shape"]

TINY = load_model_shape({
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192,
    "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768,
}).named("tiny", "10.5M parameters: runs the whole harness on a CPU in seconds")

SHAPES: dict[str, ModelShape] = {"tiny": TINY, **PRESETS}

# Shapes --find-largest tries, smallest first, when --shapes is not given.
FIND_LARGEST_SHAPES = ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b")


def resolve_shape(name: str, layers: int | None = None) -> ModelShape:
    """``qwen2.5-7b``, ``tiny``, ``qwen2.5-14b@20L``; ``layers`` restacks the shape to that depth."""
    base, depth = split_depth(name)
    if base not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)} (optionally NAME@<layers>L), "
                         "or 'largest' for the largest shape the host holds")
    shape = SHAPES[base]
    layers = layers or depth
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        if layers != shape.num_layers:
            shape = shape.with_layers(layers)
    return shape


def hf_config(shape: ModelShape) -> dict:
    """The HF config.json of the shape, as the engine and ``transformers.AutoConfig.for_model`` read it."""
    cfg = shape.to_hf_config()
    cfg["initializer_range"] = 0.02
    if shape.arch == "mistral":
        cfg["sliding_window"] = None  # the engine attends to the whole sequence; the peers must too
    return cfg
