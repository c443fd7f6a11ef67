"""The RAM-centric streaming trainer. Imports neither ray nor fastapi (a repository guard checks it).

    from horizon_ray.engine import Engine, EngineConfig, LoraConfig
    eng = Engine.from_pretrained(model_dir, EngineConfig(device="cpu"))
    loss = eng.train_step([(input_ids, labels), ...])
    # LoRA on the frozen, streamed base: only the adapters train; save_pretrained writes a PEFT adapter
    eng = Engine.from_pretrained(model_dir, EngineConfig(lora=LoraConfig(r=8, alpha=16, targets=("q_proj", "v_proj"))))
    # DPO: rows 2i / 2i+1 of the step are a pair's chosen / rejected, labelled on their completions
    ref = eng.sequence_logps(micro_batches)            # the reference, with the starting weights
    loss = eng.train_step(micro_batches, dpo=DpoConfig(beta=0.1), ref_logps=ref); eng.last_dpo.mean()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from horizon_ray.engine.config import EngineConfig
    from horizon_ray.engine.engine import Engine
    from horizon_ray.engine.lora import LoraConfig
    from horizon_ray.engine.model import ModelConfig
    from horizon_ray.engine.objective import DpoConfig

# Imported on first use, so that horizon_ray.engine.model (plain Python: what the engine accepts) loads
# without torch for the planner.
_EXPORTS = {"Engine": "engine", "EngineConfig": "config", "LoraConfig": "lora", "ModelConfig": "model",
            "DpoConfig": "objective"}
__all__ = ["DpoConfig", "Engine", "EngineConfig", "LoraConfig", "ModelConfig"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"horizon_ray.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'horizon_ray.engine' has no attribute {name!r}")
