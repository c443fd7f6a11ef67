"""The RAM-centric streaming trainer. Imports neither ray nor fastapi (a repository guard checks it).

    from horizon_ray.engine import Engine, EngineConfig, LoraConfig
    eng = Engine.from_pretrained(model_dir, EngineConfig(device="cpu"))
    loss = eng.train_step([(input_ids, labels), ...])
    # LoRA on the frozen, streamed base: only the adapters train; save_pretrained writes a PEFT adapter
    eng = Engine.from_pretrained(model_dir, EngineConfig(lora=LoraConfig(r=8, alpha=16, targets=("q_proj", "v_proj"))))
"""

from horizon_ray.engine.config import EngineConfig
from horizon_ray.engine.engine import Engine
from horizon_ray.engine.lora import LoraConfig
from horizon_ray.engine.model import ModelConfig

__all__ = ["Engine", "EngineConfig", "LoraConfig", "ModelConfig"]
