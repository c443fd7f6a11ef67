"""Bad input fails with an error that names the problem, and leaves nothing half-written."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from horizon_ray.engine import Engine, EngineConfig, ModelConfig
from horizon_ray.engine import io as engine_io

V = 50


@pytest.fixture
def model_dir(tmp_path):
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V)
    torch.manual_seed(0)
    path = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def test_missing_shard_is_named(model_dir):
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (model_dir / victim).unlink()
    with pytest.raises(ValueError, match=victim):
        Engine.from_pretrained(model_dir, EngineConfig())


def test_config_weights_shape_mismatch(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\..*shape .*does not match"):
        Engine.from_pretrained(model_dir, EngineConfig())


def test_config_with_more_layers_than_weights(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks tensors"):
        Engine.from_pretrained(model_dir, EngineConfig())


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("model_type", "gpt2", "model_type 'gpt2' is not supported"),
    ("hidden_act", "gelu", "hidden_act"),
    ("mlp_bias", True, "mlp_bias"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0}, "rope type 'yarn'"),
])
def test_unsupported_config_is_refused(model_dir, field, value, needle):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf(cfg)


def test_bad_batches(model_dir):
    eng = Engine.from_pretrained(model_dir, EngineConfig())
    ids = torch.randint(0, V, (2, 8))
    with pytest.raises(ValueError, match="nothing to train on"):
        eng.train_step([(ids, torch.full_like(ids, -100))])
    with pytest.raises(ValueError, match="torch.long"):
        eng.train_step([(ids.int(), ids)])
    with pytest.raises(ValueError, match="vocab_size"):
        eng.train_step([(ids + V, ids)])
    with pytest.raises(ValueError, match="shape"):
        eng.train_step([(ids, ids[:, :4])])
    with pytest.raises(ValueError, match="at least one micro-batch"):
        eng.train_step([])
    assert eng.step == 0  # none of them reached the optimizer


def test_bad_engine_config():
    with pytest.raises(ValueError, match="compute_dtype"):
        EngineConfig(compute_dtype="float16").validate()
    with pytest.raises(ValueError, match="checkpoint_every"):
        EngineConfig(checkpoint_every=0).validate()


def test_failed_save_leaves_no_output(model_dir, tmp_path, monkeypatch):
    eng = Engine.from_pretrained(model_dir, EngineConfig(max_shard_bytes=20_000))
    calls = {"n": 0}
    real = engine_io.save_file

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_io, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        eng.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left either


def test_non_finite_gradient_skips_the_update_and_restores_the_wire(model_dir, monkeypatch):
    """With bf16 compute the gradient shares the wire's buffer; a step abandoned after its backward must
    give the wire back the weights, and leave the master untouched."""
    eng = Engine.from_pretrained(model_dir, EngineConfig(compute_dtype="bfloat16"))
    assert eng.store.grad_is_wire
    before = [u.master.clone() for u in eng.store.units]
    real = eng._grad_sink.finish
    monkeypatch.setattr(eng._grad_sink, "finish", lambda: real() * float("inf"))
    ids = torch.randint(0, V, (2, 8))
    with pytest.raises(FloatingPointError, match="update was skipped"):
        eng.train_step([(ids, ids)])
    assert eng.step == 0
    for u, m in zip(eng.store.units, before):
        assert torch.equal(u.master, m)
        assert torch.equal(u.wire, m.to(torch.bfloat16))
    monkeypatch.setattr(eng._grad_sink, "finish", real)
    fresh = Engine.from_pretrained(model_dir, EngineConfig(compute_dtype="bfloat16"))
    assert eng.train_step([(ids, ids)]) == fresh.train_step([(ids, ids)])


def test_a_step_failing_while_the_last_update_runs_leaves_that_update_whole(model_dir, monkeypatch):
    """With bf16 compute the previous step's gradients wait in the wires until the background optimizer
    reaches each unit. A step that fails early (an OOM, Ctrl-C) must let that update finish before it
    rebuilds the wires from the masters, or the late units would be updated with weights as gradients."""
    import time

    cfg = EngineConfig(lr=1e-2, compute_dtype="bfloat16", checkpoint_every=2)
    g = torch.Generator().manual_seed(0)
    b1, b2 = ([(ids, ids.clone())] for ids in (torch.randint(0, V, (2, 16), generator=g) for _ in range(2)))
    ref = Engine.from_pretrained(model_dir, cfg)
    ref.train_step(b1)
    ref.close()

    eng = Engine.from_pretrained(model_dir, cfg)
    update = eng._optimizer.update

    def slow(unit, lr, coef, k=0):  # the head and the top layer are updated late
        if eng.store.units.index(unit) >= 2:
            time.sleep(0.3)
        update(unit, lr, coef)

    monkeypatch.setattr(eng._optimizer, "update", slow)
    eng.train_step(b1)

    def oom(*args, **kwargs):
        raise RuntimeError("simulated out of memory in layer 0")

    monkeypatch.setattr(eng.template, "layer", oom)
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        eng.train_step(b2)
    eng.close()
    for a, b in zip(ref.store.units, eng.store.units):
        assert torch.equal(a.master, b.master), a.layout.name
        assert torch.equal(b.wire, b.master.to(torch.bfloat16)), b.layout.name


def test_an_update_that_failed_partway_refuses_every_later_step(model_dir, monkeypatch):
    """Some units updated, others not: no later step may train on that state, and close() still frees it."""
    eng = Engine.from_pretrained(model_dir, EngineConfig(compute_dtype="float32"))
    update, calls = eng._optimizer.update, [0]

    def failing(unit, lr, coef, k=0):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("simulated failure in the second unit's update")
        update(unit, lr, coef, k)

    monkeypatch.setattr(eng._optimizer, "update", failing)
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    eng.train_step([(ids, ids)])  # the update runs in the background and fails there
    for _ in range(2):
        with pytest.raises(RuntimeError, match="inconsistent: restart from the last checkpoint") as err:
            eng.train_step([(ids, ids)])
        assert isinstance(err.value.__cause__, MemoryError)
    with pytest.raises(RuntimeError, match="inconsistent"):
        eng.close()
    assert eng._optimizer._worker is None  # the worker is stopped all the same
