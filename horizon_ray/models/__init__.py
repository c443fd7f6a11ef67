"""The model families the engine trains, by HF ``model_type``: one module each, imported when a config of its
family is first read (vLLM's lazily imported registry). A family module reads the config.json into a
``ModelConfig``: its layers composed of the blocks in ``blocks.py``, each layer's tensors under their HF names,
its LoRA targets and norms, its parameter and FLOP counts. CONTRIBUTING.md says how to add one.

Nothing here imports torch: the planner, the API and the coordinator read these descriptions too.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from horizon_ray.errors import BadInput
from horizon_ray.models.config import ModelConfig

# model_type -> (module in horizon_ray.models, function in it, the HF architecture, the family's name)
FAMILIES = {
    "llama": ("llama", "from_hf", "LlamaForCausalLM", "Llama"),
    "qwen2": ("qwen2", "from_hf", "Qwen2ForCausalLM", "Qwen2"),
    "mistral": ("mistral", "from_hf", "MistralForCausalLM", "Mistral"),
    "qwen3": ("qwen3", "from_hf", "Qwen3ForCausalLM", "Qwen3"),
    "phi3": ("phi3", "from_hf", "Phi3ForCausalLM", "Phi-3"),
    "gemma2": ("gemma", "gemma2", "Gemma2ForCausalLM", "Gemma 2"),
    "gemma3_text": ("gemma", "gemma3_text", "Gemma3ForCausalLM", "Gemma 3"),
    "mixtral": ("mixtral", "from_hf", "MixtralForCausalLM", "Mixtral"),
    "qwen3_moe": ("qwen3_moe", "from_hf", "Qwen3MoeForCausalLM", "Qwen3-MoE"),
    "olmoe": ("olmoe", "from_hf", "OlmoeForCausalLM", "OLMoE"),
    "qwen2_moe": ("qwen2_moe", "from_hf", "Qwen2MoeForCausalLM", "Qwen2-MoE"),
}
ARCHITECTURES = {model_type: arch for model_type, (_, _, arch, _) in FAMILIES.items()}
# Families users bring that the engine does not train, by model_type, with what to do instead.
REFUSED_FAMILIES = {
    "gemma3": "a Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration); fine-tune its text "
              "model: save model.language_model as a Gemma3ForCausalLM (model_type gemma3_text)",
    "gemma": "Gemma 1 is not supported; Gemma 2 (gemma2) and Gemma 3 text (gemma3_text) are",
    "phimoe": "Phi-3.5-MoE is not supported; Phi-3 / Phi-4 (phi3) and Mixtral (mixtral) are",
    "deepseek_v3": "DeepSeek-V3's latent attention and shared experts are not supported",
}


def from_hf(hf: dict) -> ModelConfig:
    """The family's description of an HF config dict; refuses what the engine does not implement, by name."""
    from horizon_ray.models.hf import refuse_unsupported

    model_type = hf.get("model_type")
    if model_type in REFUSED_FAMILIES:
        raise BadInput(f"model_type {model_type!r} is not supported: {REFUSED_FAMILIES[model_type]}")
    if model_type not in FAMILIES:
        names = " / ".join(name for *_, name in FAMILIES.values())
        raise BadInput(f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)} "
                       f"(decoder-only {names})")
    module, function, arch, _ = FAMILIES[model_type]
    archs = hf.get("architectures") or [arch]
    if archs != [arch]:
        raise BadInput(f"architectures {archs} are not supported; expected [{arch!r}]")
    refuse_unsupported(hf)
    return getattr(importlib.import_module(f"horizon_ray.models.{module}"), function)(hf)


def load(source: str | Path | dict) -> ModelConfig:
    """From a config dict, a config.json path or a model directory holding config.json."""
    if isinstance(source, dict):
        return from_hf(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise BadInput(f"no config.json at {path}: point at an HF model directory or its config.json")
    with open(path) as f:
        return from_hf(json.load(f))
