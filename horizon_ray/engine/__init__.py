"""The RAM-centric streaming trainer. Imports neither ray nor fastapi (a repository guard checks it).

    from horizon_ray.engine import Engine, EngineConfig
    eng = Engine.from_pretrained(model_dir, EngineConfig(device="cpu"))
    loss = eng.train_step([(input_ids, labels), ...])
"""

from horizon_ray.engine.config import EngineConfig
from horizon_ray.engine.engine import Engine
from horizon_ray.engine.model import ModelConfig

__all__ = ["Engine", "EngineConfig", "ModelConfig"]
