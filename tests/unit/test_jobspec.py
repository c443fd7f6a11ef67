"""The job spec loads strictly: unknown keys and impossible values are errors that name the fix."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from horizon_ray.errors import BadInput
from horizon_ray.jobspec import JobSpec, apply_overrides

ROOT = Path(__file__).resolve().parents[2]

MINIMAL = {
    "model": {"path": "/models/tiny"},
    "data": {"path": "/data/train.jsonl"},
    "training": {"max_steps": 10},
    "output_dir": "/runs/x",
}


def _with(**changes) -> dict:
    """MINIMAL with dotted keys set, e.g. _with(**{"training.lr": 0})."""
    d = copy.deepcopy(MINIMAL)
    return apply_overrides(d, [f"{k}={json.dumps(v)}" for k, v in changes.items()])


def test_minimal_spec_fills_defaults_from_one_place():
    spec = JobSpec.from_dict(MINIMAL)
    assert spec.model.path == "/models/tiny"
    assert spec.method == "full"
    assert spec.data.format == "auto"
    assert spec.training.max_steps == 10 and spec.training.epochs is None
    assert spec.training.schedule.type == "cosine"
    assert spec.checkpoint.keep >= 1
    assert spec.engine.device == "auto"


def test_round_trips_through_dict_json_and_yaml():
    spec = JobSpec.from_dict(_with(**{"training.lr": 1e-4, "training.betas": [0.9, 0.95], "name": "x"}))
    again = JobSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    assert JobSpec.from_dict(yaml.safe_load(spec.to_yaml())) == spec


@pytest.mark.parametrize(
    "data, must_name",
    [
        ({**MINIMAL, "lr": 1e-4}, ["'lr'", "training.lr"]),
        ({**MINIMAL, "trainig": {}}, ["'trainig'", "did you mean 'training'"]),
        (_with(**{"training.learning_rate": 1e-4}), ["training.learning_rate", "did you mean 'training.lr'"]),
        (_with(**{"training.sed": 1}), ["training.sed", "did you mean 'training.seed'", "valid keys in training"]),
        (_with(**{"training.schedule.warmup": 5}), ["training.schedule.warmup", "warmup_steps"]),
        (_with(**{"checkpoint.every": 5}), ["checkpoint.every", "every_steps"]),
        (_with(**{"model.revision": "main"}), ["model.revision", "valid keys in model: path, tokenizer_path"]),
        (_with(**{"method": "lora", "lora.rank": 4}), ["lora.rank", "valid keys in lora: r, alpha"]),
        ({**MINIMAL, "method": "lora", "alpha": 4}, ["'alpha'", "lora.alpha"]),
    ],
)
def test_unknown_keys_are_errors_that_name_the_key_and_the_fix(data, must_name):
    with pytest.raises(ValueError) as err:
        JobSpec.from_dict(data)
    for text in must_name:
        assert text in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "changes, must_name",
    [
        ({"training.seq_len": 4}, "training.seq_len"),
        ({"training.lr": 0}, "training.lr"),
        ({"training.lr": -1e-4}, "training.lr"),
        ({"checkpoint.keep": 0}, "checkpoint.keep"),
        ({"checkpoint.every_steps": -1}, "checkpoint.every_steps"),
        ({"data.eval_fraction": 1.0}, "data.eval_fraction"),
        ({"data.eval_fraction": -0.1}, "data.eval_fraction"),
        ({"data.format": "csv"}, "data.format"),
        ({"training.max_steps": None}, "training.max_steps"),
        ({"training.max_steps": 0}, "training.max_steps"),
        ({"training.epochs": 0}, "training.epochs"),
        ({"training.micro_batch_size": 0}, "training.micro_batch_size"),
        ({"training.grad_accum": 0}, "training.grad_accum"),
        ({"training.schedule.type": "cosin"}, "did you mean 'cosine'"),
        ({"training.schedule.min_lr_ratio": 2}, "min_lr_ratio"),
        ({"training.betas": [0.9]}, "training.betas"),
        ({"training.betas": [0.9, 1.0]}, "training.betas"),
        ({"training.max_grad_norm": 0}, "training.max_grad_norm"),
        ({"training.weight_decay": -0.1}, "training.weight_decay"),
        ({"method": "qlora"}, "did you mean 'lora'"),
        ({"lora.r": 8}, "set method: lora"),
        ({"method": "lora", "lora.r": 0}, "lora.r"),
        ({"method": "lora", "lora.alpha": 0}, "lora.alpha"),
        ({"method": "lora", "lora.dropout": 1.0}, "lora.dropout"),
        ({"method": "lora", "lora.targets": ["q_proj", "c_attn"]}, "use one of q_proj, k_proj"),
        ({"method": "lora", "lora.targets": ["q_proj", "q_proj"]}, "twice"),
        ({"method": "lora", "lora.targets": "q_proj"}, "lora.targets must be a list"),
        ({"method": "lora", "engine.precision": "bf16-state", "engine.compute_dtype": "bfloat16"},
         "leave precision exact"),
        ({"engine.device": "tpu"}, "engine.device"),
        ({"engine.compute_dtype": "fp16"}, "engine.compute_dtype"),
        ({"engine.precision": "bf16-state", "engine.compute_dtype": "float32"}, "engine.compute_dtype"),
        ({"model.path": ""}, "model.path"),
        ({"data.path": ""}, "data.path"),
        ({"output_dir": ""}, "output_dir"),
        ({"training.seq_len": "long"}, "training.seq_len must be an integer"),
        ({"training.seq_len": 12.5}, "training.seq_len must be an integer"),
        ({"training.packing": "yes"}, "training.packing must be true or false"),
        ({"training.lr": None}, "training.lr cannot be null"),
        ({"model": "tiny"}, "model must be a mapping"),
    ],
)
def test_impossible_values_are_errors_that_name_the_field(changes, must_name):
    with pytest.raises(ValueError) as err:
        JobSpec.from_dict(_with(**changes))
    assert must_name in str(err.value), str(err.value)


def test_missing_required_sections_name_the_fix():
    with pytest.raises(ValueError, match="model.path is required"):
        JobSpec.from_dict({})
    with pytest.raises(ValueError, match="set one"):
        JobSpec.from_dict({k: v for k, v in MINIMAL.items() if k != "training"})


def test_lora_section():
    spec = JobSpec.from_dict(_with(method="lora"))
    assert spec.lora is not None and spec.lora.r == 8 and spec.lora.targets == []  # empty: the family's
    assert JobSpec.from_dict(spec.to_dict()) == spec
    custom = JobSpec.from_dict(_with(**{"method": "lora", "lora.r": 16, "lora.alpha": 32, "lora.dropout": 0.05,
                                        "lora.targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
                                        "lora.merge": True}))
    assert (custom.lora.r, custom.lora.alpha, custom.lora.dropout, custom.lora.merge) == (16, 32.0, 0.05, True)
    # the rank changes the trained weights, merge (an output option) does not; full jobs hash as before
    assert custom.training_hash() != JobSpec.from_dict(_with(**{**{"method": "lora", "lora.r": 8, "lora.alpha": 32,
                                                               "lora.dropout": 0.05, "lora.merge": True},
                                                            "lora.targets": custom.lora.targets})).training_hash()
    unmerged = JobSpec.from_dict({**custom.to_dict(), "lora": {**custom.to_dict()["lora"], "merge": False}})
    assert unmerged.training_hash() == custom.training_hash()
    assert "lora" not in json.dumps(JobSpec.from_dict(MINIMAL).to_dict()["training"])


def test_lora_defaults_match_the_engine():
    from horizon_ray.engine import LoraConfig
    from horizon_ray.engine.model import PROJECTIONS
    from horizon_ray.jobspec import LoraSpec

    spec, eng = LoraSpec(), LoraConfig()
    assert (spec.r, spec.alpha, spec.dropout, tuple(spec.targets), tuple(spec.modules_to_save)) == (
        eng.r, eng.alpha, eng.dropout, eng.targets, eng.modules_to_save)
    assert LoraSpec(targets=list(PROJECTIONS)).targets == list(PROJECTIONS)  # every projection, and only them


def test_numbers_yaml_reads_as_strings_are_accepted():
    # PyYAML reads 1e-4 (no dot) as the string "1e-4"; a learning rate written that way must still work.
    spec = JobSpec.from_dict(_with(**{"training.lr": "1e-4", "training.max_steps": "1e3"}))
    assert spec.training.lr == 1e-4
    assert spec.training.max_steps == 1000


def test_from_yaml_applies_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    spec = JobSpec.from_yaml(path, ["training.lr=1e-4", "training.schedule.type=linear",
                                    "training.betas=[0.9, 0.95]", "data.eval_path=/data/eval.jsonl",
                                    "name=my-run", "training.epochs=2"])
    assert spec.training.lr == 1e-4
    assert spec.training.schedule.type == "linear"
    assert spec.training.betas == [0.9, 0.95]
    assert spec.data.eval_path == "/data/eval.jsonl"
    assert spec.name == "my-run"
    assert spec.training.epochs == 2.0
    with pytest.raises(ValueError, match="training.lr=1e-4"):
        JobSpec.from_yaml(path, ["training.lr"])
    with pytest.raises(ValueError, match="training.lerning_rate"):
        JobSpec.from_yaml(path, ["training.lerning_rate=1"])
    with pytest.raises(ValueError, match="output_dir is not a section"):
        JobSpec.from_yaml(path, ["output_dir.x=1"])


def test_from_yaml_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        JobSpec.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        JobSpec.from_yaml(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        JobSpec.from_yaml(listy)


def test_training_hash_ignores_what_may_change_on_resume():
    base = JobSpec.from_dict(MINIMAL)
    same = JobSpec.from_dict(_with(**{"output_dir": "/elsewhere", "checkpoint.every_steps": 7,
                                      "eval.every_steps": 3, "engine.device": "cpu", "name": "n"}))
    other = JobSpec.from_dict(_with(**{"training.lr": 1e-3}))
    assert base.training_hash() == same.training_hash()
    assert base.training_hash() != other.training_hash()


def test_check_paths_names_the_missing_input(tmp_path):
    spec = JobSpec.from_dict(_with(**{"model.path": str(tmp_path / "m"), "data.path": str(tmp_path / "d.jsonl")}))
    with pytest.raises(ValueError, match="not an HF model directory"):
        spec.check_paths()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        spec.check_paths()
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="data.path"):
        spec.check_paths()
    (tmp_path / "d.jsonl").write_text("")
    spec.check_paths()


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_loads_strictly(path):
    spec = JobSpec.from_yaml(path)
    assert spec.name


def test_demo_example_matches_the_embedded_demo_job():
    from horizon_ray.job.demo import ASSETS_VERSION, DEMO_JOB

    spec = JobSpec.from_yaml(ROOT / "examples" / "demo.yaml").to_dict()
    assert f"/demo/assets-v{ASSETS_VERSION}/" in spec["model"]["path"]
    for section in ("training", "eval", "checkpoint"):
        for key, value in DEMO_JOB[section].items():
            assert spec[section][key] == value, f"examples/demo.yaml {section}.{key} drifted from DEMO_JOB"


def test_demo_example_follows_horizon_ray_home(monkeypatch, tmp_path):
    """examples/demo.yaml finds the assets `horizon-ray demo` built, wherever $HORIZON_RAY_HOME puts them."""
    from horizon_ray.job.demo import prepare_demo_assets

    monkeypatch.setenv("HORIZON_RAY_HOME", str(tmp_path / "home"))
    assets, _ = prepare_demo_assets()
    spec = JobSpec.from_yaml(ROOT / "examples" / "demo.yaml")
    assert spec.model.path == str(assets.model_dir) and spec.data.eval_path == str(assets.eval_path)
    spec.check_paths()
    monkeypatch.delenv("HORIZON_RAY_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert JobSpec.from_yaml(ROOT / "examples" / "demo.yaml").data.path == \
        "/home/someone/.cache/horizon-ray/demo/assets-v1/train.jsonl"
    # only a spec read on this machine expands it, and only at the start of a path
    assert JobSpec.parse({"model": {"path": "$HORIZON_RAY_HOME/m"}}).model.path == "$HORIZON_RAY_HOME/m"
    assert JobSpec.from_dict(_with(**{"data.path": "/x/$HORIZON_RAY_HOME/d.jsonl"})).data.path == \
        "/x/$HORIZON_RAY_HOME/d.jsonl"


def test_tilde_is_expanded_in_paths_only(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    spec = JobSpec.from_dict({**_with(**{"output_dir": "~/runs/x", "data.path": "~/d.jsonl"}), "name": "~"})
    assert spec.output_dir == "/home/someone/runs/x" and spec.data.path == "/home/someone/d.jsonl"
    assert spec.name == "~"  # a label, not a path


def test_eval_on_the_training_file_is_refused():
    with pytest.raises(ValueError, match="data.eval_path is the training file itself"):
        JobSpec.from_dict(_with(**{"data.eval_path": "/data/../data/train.jsonl"}))


# ---- one spec, one rule for "auto" ------------------------------------------------------------------------


def test_a_bf16_state_spec_on_a_cpu_node_is_planned_as_the_runner_runs_it():
    """compute_dtype auto with precision bf16-state on a node without a GPU: the runner computes in bfloat16,
    and the planner (hence the coordinator) must plan that, not refuse the spec as float32 compute."""
    pytest.importorskip("torch")
    from horizon_ray.job.runner import engine_config
    from horizon_ray.planner import NodeSpec, plan_for_spec

    spec = JobSpec.from_dict(_with(**{"model.path": "qwen2.5-0.5b", "engine.precision": "bf16-state",
                                      "engine.device": "cpu"}))
    p = plan_for_spec(spec, NodeSpec(gpus=0, gpu_mem_bytes=0))
    cfg = engine_config(spec)  # what `horizon-ray finetune` gives the engine
    cfg.validate()
    assert (p.device, p.compute_dtype, p.mode) == (cfg.device, cfg.compute_dtype, cfg.precision) == \
        ("cpu", "bfloat16", "bf16-state")
    # and device auto on a CPU node: the same
    auto = JobSpec.from_dict(_with(**{"model.path": "qwen2.5-0.5b", "engine.precision": "bf16-state"}))
    assert plan_for_spec(auto, NodeSpec(gpus=0, gpu_mem_bytes=0)).compute_dtype == "bfloat16"


def test_fuse_projections_auto_splits_only_row_groups_of_16384_tokens_on_a_gpu():
    """engine.fuse_projections: auto (the default) splits q, k, v and gate, up into their own GEMMs where a CUDA
    row group holds 16,384 tokens or more, where the H200 ran them faster, and fuses them elsewhere; true and
    false stay what they say."""
    from horizon_ray.workload import SPLIT_PROJECTIONS_FROM_TOKENS, fuse_projections_for

    assert JobSpec.from_dict(MINIMAL).engine.fuse_projections == "auto"
    assert SPLIT_PROJECTIONS_FROM_TOKENS == 16_384
    assert fuse_projections_for("auto", cuda=True, group_tokens=16_384) is False
    assert fuse_projections_for("auto", cuda=True, group_tokens=32_768) is False
    assert fuse_projections_for("auto", cuda=True, group_tokens=8_192) is True
    assert fuse_projections_for("auto", cuda=False, group_tokens=16_384) is True
    assert fuse_projections_for(True, cuda=True, group_tokens=16_384) is True
    assert fuse_projections_for(False, cuda=False, group_tokens=1) is False
    with pytest.raises(BadInput, match="engine.fuse_projections is 'yes'; use auto, true or false"):
        fuse_projections_for("yes", cuda=True, group_tokens=1)
    # the spec's group: a micro-batch's rows cut at layer_chunk_tokens
    spec = JobSpec.from_dict(_with(**{"training.seq_len": 1024, "training.micro_batch_size": 16,
                                      "engine.layer_chunk_tokens": 16384}))
    assert spec.workload().group_tokens == 16_384
    with pytest.raises(BadInput, match="engine.fuse_projections is .yes.; use one of auto, true, false"):
        JobSpec.from_dict(_with(**{"engine.fuse_projections": "yes"}))


def test_engine_config_from_spec_takes_every_field():
    pytest.importorskip("torch")
    from horizon_ray.engine import EngineConfig

    spec = JobSpec.from_dict(_with(**{
        "training.lr": 3e-4, "training.betas": [0.8, 0.95], "training.eps": 1e-6, "training.weight_decay": 0.1,
        "training.max_grad_norm": None, "training.seed": 7, "training.update": "exact", "training.kernels": "torch",
        "engine.device": "cpu", "engine.activation_checkpoint_every": 3, "engine.loss_chunk_tokens": 64,
        "engine.layer_chunk_tokens": 256, "engine.offload_checkpoints": True, "engine.fuse_projections": False,
        "method": "lora", "lora.r": 4,
        "lora.alpha": 8, "lora.dropout": 0.1, "lora.targets": ["v_proj", "q_proj"], "lora.modules_to_save": ["norm"]}))
    cfg = EngineConfig.from_spec(spec)
    cfg.validate()
    assert (cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay, cfg.max_grad_norm, cfg.seed) == (
        3e-4, (0.8, 0.95), 1e-6, 0.1, None, 7)
    assert (cfg.update, cfg.kernels, cfg.device, cfg.compute_dtype, cfg.precision) == (
        "exact", "torch", "cpu", "float32", "exact")
    # a checkpoint offloaded to the host only from a GPU: on the cpu there is nothing to offload
    assert (cfg.checkpoint_every, cfg.loss_chunk_tokens, cfg.layer_chunk_tokens, cfg.offload_checkpoints) == (
        3, 64, 256, False)
    assert cfg.fuse_projections is False
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets, cfg.lora.modules_to_save) == (
        4, 8.0, 0.1, ("v_proj", "q_proj"), ("norm",))
    assert EngineConfig.from_spec(JobSpec.from_dict(MINIMAL), device="cpu").lora is None
    # auto on the CPU: fused, whatever the row group
    big = _with(**{"training.seq_len": 1024, "training.micro_batch_size": 16, "engine.layer_chunk_tokens": 16384})
    assert EngineConfig.from_spec(JobSpec.from_dict(big), device="cpu").fuse_projections is True
    # layer_chunk_tokens auto: the plan's choice where the runner has one (CUDA), else 8,192; a set value stays
    auto = JobSpec.from_dict(_with(**{"training.seq_len": 1024, "training.micro_batch_size": 16}))
    assert EngineConfig.from_spec(auto, device="cpu").layer_chunk_tokens == 8192
    assert EngineConfig.from_spec(auto, device="cpu", layer_chunk_tokens=16384).layer_chunk_tokens == 16384
    assert EngineConfig.from_spec(JobSpec.from_dict(big), device="cpu", layer_chunk_tokens=4096).layer_chunk_tokens \
        == 16384
    for update in ("delayed", "speculative"):
        assert EngineConfig.from_spec(JobSpec.from_dict(_with(**{"training.update": update})), device="cpu").update \
            == update
    with pytest.raises(ValueError, match="training.update delayed hides the host update of full fine-tuning"):
        JobSpec.from_dict(_with(**{"method": "lora", "training.update": "delayed"}))
    with pytest.raises(ValueError, match="update must be one of"):
        EngineConfig(update="later").validate()


@pytest.mark.parametrize("changes, must_name", [
    ({"training.update": "lazy"}, "training.update is 'lazy'; use one of exact, delayed, speculative"),
    ({"training.kernels": "triton"}, "training.kernels is 'triton'; use one of auto, torch, liger"),
    ({"engine.offload_checkpoints": "yes"}, "engine.offload_checkpoints is 'yes'; use one of auto, true, false"),
    ({"engine.layer_chunk_tokens": 0}, "engine.layer_chunk_tokens is 0; give an integer of 1 or more, or auto"),
])
def test_the_new_settings_load_strictly(changes, must_name):
    with pytest.raises(ValueError) as err:
        JobSpec.from_dict(_with(**changes))
    assert must_name in str(err.value), str(err.value)


def test_training_hash_of_a_spec_is_what_it_was_before_the_new_settings():
    # checkpoints written before training.update / training.kernels existed still resume (pinned values)
    assert JobSpec.from_dict(MINIMAL).training_hash() == "49267641990f984e"
    assert JobSpec.from_dict(_with(**{"training.kernels": "torch"})).training_hash() == "49267641990f984e"
    assert JobSpec.from_dict(_with(**{"training.update": "delayed"})).training_hash() != "49267641990f984e"


def test_an_http_spec_keeps_its_tilde_and_a_file_spec_expands_it(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    assert JobSpec.parse({"data": {"path": "~/d.jsonl"}}).data.path == "~/d.jsonl"
    assert JobSpec.parse({"data": {"path": "~/d.jsonl"}}, expand_user=True).data.path == "/home/someone/d.jsonl"


def test_errors_carry_the_field():

    for changes, field in (({"training.lr": "fast"}, "training.lr"), ({"training.sed": 1}, "training.sed"),
                           ({"training.betas": [0.9, "x"]}, "training.betas[1]"), ({"training.lr": -1}, "training.lr")):
        with pytest.raises(BadInput) as err:
            JobSpec.from_dict(_with(**changes))
        assert err.value.field == field


@pytest.mark.parametrize("uri", ["file:///etc", "/var/lib/horizon-ray/other-tenant", "sqlite:///x.db", "mlruns"])
def test_an_mlflow_store_on_the_node_is_refused_and_a_server_is_not(uri):
    """A tenant's tracking_uri names a server: a local store would be written by the engine outside its job."""
    data = {**MINIMAL, "integrations": {"mlflow": {"tracking_uri": uri}}}
    with pytest.raises(ValueError, match=r"integrations.*tracking_uri.*not an MLflow tracking server's http\(s\)"):
        JobSpec.from_dict(data)
    data["integrations"]["mlflow"]["tracking_uri"] = "https://mlflow.example.org"
    assert JobSpec.from_dict(data).integrations.mlflow.tracking_uri == "https://mlflow.example.org"
