"""Model shapes the benchmark builds at random init (nothing is downloaded), and their model FLOPs.

A shape is one of the planner's presets (``horizon_ray.planner.PRESETS``), ``tiny`` (a ~10M-parameter
CPU smoke test of the whole harness), or either stacked to another depth: ``qwen2.5-14b@20L``, the name
``ModelShape.with_layers`` gives. One description feeds all three systems: the engine and transformers
both read ``ModelShape.to_hf_config()``.
"""

from __future__ import annotations

import re

from horizon_ray.planner import PRESETS, ModelShape

TINY = ModelShape(
    name="tiny", arch="qwen2", hidden_size=256, intermediate_size=768, num_layers=8, num_heads=4,
    num_kv_heads=2, head_dim=64, vocab_size=8192, tie_word_embeddings=False, qkv_bias=True,
    note="10.5M parameters: runs the whole harness on a CPU in seconds",
)

SHAPES: dict[str, ModelShape] = {"tiny": TINY, **PRESETS}

# Shapes --find-largest tries, smallest first, when --shapes is not given.
FIND_LARGEST_SHAPES = ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b")


def resolve_shape(name: str, layers: int | None = None) -> ModelShape:
    """``qwen2.5-7b``, ``tiny``, ``qwen2.5-14b@20L``; ``layers`` restacks the shape to that depth."""
    base, _, depth = name.partition("@")
    if base not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)} (optionally NAME@<layers>L), "
                         "or 'largest' for the largest shape the host holds")
    shape = SHAPES[base]
    if depth:
        m = re.fullmatch(r"(\d+)L", depth)
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"shape {name!r}: write the depth as NAME@<layers>L, e.g. {base}@20L")
        layers = layers or int(m.group(1))
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


def flops_params(shape: ModelShape) -> int:
    """N of the house convention: the weights a token's matmuls multiply by, i.e. the seven projections of
    every layer and the LM head. The embedding is a lookup, norms and biases are elementwise (no matmul)."""
    return shape.num_layers * shape.layer_matmul_params + shape.vocab_size * shape.hidden_size


def model_flops_per_token(shape: ModelShape, seq: int) -> float:
    """House convention (DESIGN.md, Measuring): 6 N + 6 L heads head_dim seq per token, forward and
    backward, causal attention, recompute not counted."""
    return 6 * flops_params(shape) + 6 * shape.num_layers * shape.num_heads * shape.head_dim * seq
