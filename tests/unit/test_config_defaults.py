"""One default per field: an engine built by hand trains as a job spec that leaves the field out."""

import dataclasses

import pytest

from horizon_ray.engine import EngineConfig, LoraConfig
from horizon_ray.errors import BadInput
from horizon_ray.jobspec import JobSpec, LoraSpec
from horizon_ray.workload import Adapters

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


@pytest.mark.parametrize("bad", [{"r": 0}, {"r": True}, {"alpha": 0.0}, {"alpha": float("inf")}, {"dropout": 1.0},
                                 {"targets": ["q_proj", "nope"]}, {"targets": ["q_proj", "q_proj"]},
                                 {"modules_to_save": [""]}, {"quantize": "q3"}])
def test_one_lora_rule_one_refusal(bad):
    """A LoRA value is refused by the same rule, with the same words and field, whichever view checks it:
    the spec's section, the planner's adapters and the engine's config built by hand."""
    spec_section = LoraSpec.model_construct(**{**LoraSpec().model_dump(), **bad})
    engine = LoraConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in bad.items()})
    refusals = []
    for check in (spec_section.check, engine.validate):
        with pytest.raises(BadInput) as exc:
            check()
        refusals.append((str(exc.value), exc.value.field))
    if not {"alpha", "dropout"} & set(bad):  # the planner's view counts no scaling
        with pytest.raises(BadInput) as exc:
            Adapters.of(bad).check()
        refusals.append((str(exc.value), exc.value.field))
    assert len(set(refusals)) == 1, refusals
    assert refusals[0][1] == f"lora.{next(iter(bad))}"


def test_placement_reads_the_typed_spec():
    """Placement reads engine.device and resources.gpus as the spec does: its defaults where absent, and a
    value the spec refuses is refused by name, not placed under a default of placement's own."""
    from horizon_ray.cluster.placement import gpus_wanted, needs_gpu
    from horizon_ray.jobspec import EngineSpec, ResourcesSpec

    assert gpus_wanted(SPEC) == ResourcesSpec().gpus
    assert needs_gpu(SPEC, 1) == (EngineSpec().device in ("auto", "cuda"))
    assert gpus_wanted({**SPEC, "resources": {"gpus": 3}}) == 3
    for bad, field in (({"resources": {"gpus": 0}}, "resources.gpus"),
                       ({"resources": {"gpus": True}}, "resources.gpus"),
                       ({"engine": {"device": None}}, "engine.device"),
                       ({"engine": {"devise": "cpu"}}, "engine.devise")):
        with pytest.raises(BadInput) as exc:
            needs_gpu({**SPEC, **bad}, 2)
        assert exc.value.field == field, (bad, str(exc.value))
