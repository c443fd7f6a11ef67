"""One default per field: an engine built by hand trains as a job spec that leaves the field out."""

import dataclasses

from horizon_ray.engine import EngineConfig, LoraConfig
from horizon_ray.jobspec import JobSpec

SPEC = {"model": {"path": "/models/tiny"}, "data": {"path": "/data/train.jsonl"}, "training": {"max_steps": 10},
        "output_dir": "/runs/x"}
# what from_spec resolves for this machine rather than copies ("auto" in the spec, a concrete value in the engine)
RESOLVED = {"device", "compute_dtype", "offload_checkpoints"}


def test_engine_defaults_are_the_spec_defaults():
    from_spec = EngineConfig.from_spec(JobSpec.from_dict(SPEC), device="cpu")
    by_hand = EngineConfig()
    differ = {f.name: (getattr(by_hand, f.name), getattr(from_spec, f.name))
              for f in dataclasses.fields(EngineConfig)
              if f.name not in RESOLVED and getattr(by_hand, f.name) != getattr(from_spec, f.name)}
    assert differ == {}
    assert by_hand.lr == from_spec.lr == 2e-5  # the spec's documented default


def test_lora_defaults_are_the_spec_defaults():
    spec = JobSpec.from_dict({**SPEC, "method": "lora"})
    lora = EngineConfig.from_spec(spec, device="cpu").lora
    by_hand = LoraConfig()
    # targets: the spec names the model's defaults, the engine resolves () to them (for_model)
    differ = {f.name: (getattr(by_hand, f.name), getattr(lora, f.name)) for f in dataclasses.fields(LoraConfig)
              if f.name != "targets" and getattr(by_hand, f.name) != getattr(lora, f.name)}
    assert differ == {}
