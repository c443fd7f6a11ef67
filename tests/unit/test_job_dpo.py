"""objective dpo as a job: the demo's checkable preference task learned by the real engine on the CPU, the
reference pass kept in the output directory (resumed after a kill, never recomputed by a resumed job), and
TRL's metrics in metrics.jsonl and TensorBoard."""

import json
import math

import pytest
import torch
import yaml

from horizon_ray.errors import BadInput
from horizon_ray.job import reference
from horizon_ray.job.events import read_events
from horizon_ray.job.runner import run_job
from horizon_ray.jobspec import JobSpec
from tests.tiny import preference_assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return preference_assets(tmp_path_factory.mktemp("dpo-assets"), 128, 32)


def _spec(assets, out, **training):
    t = {"seq_len": 32, "micro_batch_size": 8, "grad_accum": 2, "max_steps": 12, "lr": 3e-3, "seed": 3,
         "schedule": {"type": "constant"}, **training}
    return JobSpec.from_dict({
        "model": {"path": str(assets / "model")},
        "data": {"path": str(assets / "train.jsonl"), "eval_path": str(assets / "eval.jsonl")},
        "objective": "dpo", "dpo": {"beta": 0.1},
        "training": t, "eval": {"every_steps": 6}, "checkpoint": {"every_steps": 2},
        "engine": {"device": "cpu"}, "output_dir": str(out),
    })


def test_held_out_reward_accuracy_rises_to_90_percent(assets, tmp_path):
    result = run_job(_spec(assets, tmp_path / "run"), progress=False)
    events = read_events(tmp_path / "run" / "metrics.jsonl")
    evals = [e for e in events if e.TYPE == "eval"]
    first, last = evals[0].eval_preference, evals[-1].eval_preference
    # before training the policy is the reference: every reward is 0, every pair's loss ln 2
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6) and first["rewards/margins"] == 0.0
    ref = reference.load(tmp_path / "run", _preference_hash(assets, tmp_path / "run"))
    # the random starting model does not prefer the lowercase answers (it ranks a quarter of them first)
    assert float((ref["eval"][0::2] > ref["eval"][1::2]).float().mean()) <= 0.6
    assert last["rewards/accuracies"] >= 0.9
    assert last["rewards/margins"] > 0 and last["rewards/chosen"] > last["rewards/rejected"]
    assert evals[-1].eval_loss < math.log(2)
    train = [e for e in events if e.TYPE == "metrics"]
    assert len(train) == result.total_steps == 12
    (start,) = [e for e in events if e.TYPE == "start"]
    assert (start.train_examples, start.eval_examples) == (128, 32)  # pairs, as the files hold them (not rows)
    assert set(train[-1].preference) == {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                         "rewards/margins", "logps/chosen", "logps/rejected"}
    assert train[-1].loss == pytest.approx(train[-1].preference["loss"])
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert list((tmp_path / "run" / "tensorboard").iterdir())


def _preference_hash(assets, out):
    from horizon_ray.data import load_tokenizer
    from horizon_ray.job import dpo

    spec = _spec(assets, out)
    train, evals, sampler, ev = dpo.load_data(spec, load_tokenizer(assets / "model"))
    return dpo.Preference(spec, out, train, evals, sampler, ev).hash


def test_a_base_of_the_same_shape_copied_over_the_model_invalidates_the_reference(assets, tmp_path, monkeypatch):
    """The same file names and sizes but other weights (another checkpoint of the model written over it) are
    another reference: a resumed job must not score its pairs against the old base's log-probs."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(assets / "model", model)
    monkeypatch.setattr(reference, "SAMPLE_BYTES", 64)  # the tiny file's three samples do not cover it all
    spec = _spec(assets, tmp_path / "run")
    spec.model.path = str(model)
    before = reference.reference_hash(spec, ["rows"])
    (weights,) = model.glob("*.safetensors")
    size = weights.stat().st_size
    # another checkpoint of the same shape: every value other
    tensors = {k: t + 0.5 for k, t in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert weights.stat().st_size == size
    assert reference.reference_hash(spec, ["rows"]) != before
    assert reference.reference_hash(spec, ["rows"]) == reference.reference_hash(spec, ["rows"])


def test_reference_pass_resumes_after_a_kill_and_a_resumed_job_never_recomputes(assets, tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "PART_EVERY_S", 0.0)  # a slice a micro-batch
    calls = []  # micro-batches the reference pass computed
    kill_at = [True]
    real = reference.compute

    def counted(out, digest, splits, logps, *args):
        def logps_counted(mbs):
            calls.append(len(mbs))
            if len(calls) == 5 and kill_at[0]:
                raise KeyboardInterrupt("killed during the reference pass")
            return logps(mbs)

        return real(out, digest, splits, logps_counted, *args)

    monkeypatch.setattr(reference, "compute", counted)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_job(_spec(assets, out, max_steps=4), progress=False)
    assert len(list((out / "reference").glob("part-*.safetensors"))) == 4
    kill_at[0] = False
    calls.clear()
    run_job(_spec(assets, out, max_steps=4), resume=True, progress=False)
    n_batches = 128 * 2 // 8 + 32 * 2 // 8  # train and eval micro-batches of the pass
    assert len(calls) == n_batches - 4  # the slices on disk were not computed again
    assert not list((out / "reference").glob("part-*"))
    resumed = reference.load(out, _preference_hash(assets, out))

    fresh = tmp_path / "fresh"
    calls.clear()
    run_job(_spec(assets, fresh, max_steps=4), progress=False)
    assert len(calls) == n_batches
    torch.testing.assert_close(resumed["train"], reference.load(fresh, _preference_hash(assets, fresh))["train"],
                               rtol=0, atol=0)

    # a job resumed from a checkpoint reads its reference and computes none
    longer = _spec(assets, fresh, max_steps=4)
    (fresh / "DONE").unlink()
    import shutil

    shutil.rmtree(fresh / "final")
    calls.clear()
    assert run_job(longer, resume=True, progress=False).start_step == 2  # from the checkpoint of step 2
    assert calls == []
    # ... and one whose reference is gone is refused: its weights are no longer the starting ones
    (fresh / "DONE").unlink()
    shutil.rmtree(fresh / "final")
    (fresh / "reference" / reference.FINAL).unlink()
    with pytest.raises(BadInput, match="cannot be computed again"):
        run_job(longer, resume=True, progress=False)


def test_dpo_specs_are_checked(assets, tmp_path):
    base = yaml.safe_load(_spec(assets, tmp_path / "x").to_yaml())
    with pytest.raises(BadInput, match="micro_batch_size"):
        JobSpec.from_dict({**base, "training": {**base["training"], "micro_batch_size": 3}})
    with pytest.raises(BadInput, match="packing"):
        JobSpec.from_dict({**base, "training": {**base["training"], "packing": True}})
    with pytest.raises(BadInput, match="dpo.beta"):
        JobSpec.from_dict({**base, "dpo": {"beta": -1.0}})
    with pytest.raises(BadInput, match="objective is sft"):
        JobSpec.from_dict({**base, "objective": "sft"})
    with pytest.raises(BadInput, match="did you mean|valid"):
        JobSpec.from_dict({**base, "dpo": {"betta": 0.1}})
    with pytest.raises(BadInput, match="IPO has none") as info:
        JobSpec.from_dict({**base, "dpo": {"loss": "ipo", "label_smoothing": 0.1}})
    assert info.value.field == "dpo.label_smoothing"
    conservative = JobSpec.from_dict({**base, "dpo": {"label_smoothing": 0.1}}).dpo.config()
    assert (conservative.loss, conservative.label_smoothing) == ("sigmoid", 0.1)
    robust = JobSpec.from_dict({**base, "dpo": {"loss": "robust", "label_smoothing": 0.1}}).dpo.config()
    assert (robust.loss, robust.label_smoothing) == ("robust", 0.1)
    with pytest.raises(BadInput, match=r"\[0, 0.5\)"):
        JobSpec.from_dict({**base, "dpo": {"loss": "robust", "label_smoothing": 0.5}})
    assert JobSpec.from_dict({k: v for k, v in base.items() if k != "dpo"}).dpo.beta == 0.1


def test_rewards_reach_trackers_and_the_terminal():
    from horizon_ray.cluster.follow import format_progress
    from horizon_ray.job.events import Eval, Metrics
    from horizon_ray.job.trackers import scalars

    pref = {"loss": 0.5, "rewards/chosen": 0.2, "rewards/rejected": -0.3, "rewards/accuracies": 0.875,
            "rewards/margins": 0.5, "logps/chosen": -10.0, "logps/rejected": -14.0}
    train = scalars(Metrics(step=3, loss=0.5, preference=pref))
    assert train["train/rewards/accuracies"] == 0.875 and train["train/logps/rejected"] == -14.0
    assert "train/loss" in train and "train/rewards/loss" not in train
    assert scalars(Eval(step=3, eval_loss=0.5, eval_preference=pref))["eval/rewards/margins"] == 0.5
    line = format_progress(Metrics(step=3, loss=0.5, total_steps=10, preference=pref).to_dict())
    assert line == "step 3/10: loss 0.5000, reward accuracy 87.5 %, margin 0.500"


def test_rest_finetune_takes_a_dpo_spec_and_uploads_say_preference(tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.testing import make_testbed

    bed = make_testbed(tmp_path)
    try:
        with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
            line = json.dumps({"prompt": "copy ab", "chosen": " ab", "rejected": " AB"}) + "\n"
            up = http.post("/files?name=pairs.jsonl", content=(line * 4).encode(),
                           headers={**bed.auth("acme"), "Content-Type": "application/x-ndjson"})
            assert up.status_code in (200, 201), up.text
            assert up.json()["format"] == "preference" and up.json()["num_examples"] == 4
            spec = {**bed.spec(data=up.json()["id"], micro_batch_size=4), "objective": "dpo", "dpo": {"beta": 0.2}}
            r = http.post("/finetune", json=spec, headers=bed.auth("acme"))
            assert r.status_code in (200, 201, 202), r.text
            job = bed.client.get("acme", r.json()["id"])
            assert job.spec["objective"] == "dpo" and job.spec["dpo"]["beta"] == 0.2
            bad = http.post("/finetune", json={**spec, "dpo": {"beta": 0}}, headers=bed.auth("acme"))
            assert bad.status_code == 422 and "dpo.beta" in bad.text
    finally:
        bed.close()


def test_the_cli_runs_a_dpo_spec_file(assets, tmp_path, capsys):
    from horizon_ray.cli import main

    spec = yaml.safe_load(_spec(assets, tmp_path / "cli").to_yaml())
    spec["training"]["max_steps"] = 2
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["finetune", "--config", str(path)]) == 0
    # the terminal shows what a DPO run is judged by next to each loss, as `submit --follow` does (before: the
    # losses alone)
    out = capsys.readouterr().out
    assert "eval loss before training: 0.6931, reward accuracy 0.0 %, margin 0.000" in out
    step2 = next(line for line in out.splitlines() if line.startswith("step 2/2 "))
    assert ", reward accuracy " in step2 and ", margin " in step2
    assert "eval loss after training: " in out and out.count("reward accuracy") == 4
    assert (tmp_path / "cli" / "DONE").is_file() and (tmp_path / "cli" / "reference" / reference.FINAL).is_file()
    evals = [e for e in read_events(tmp_path / "cli" / "metrics.jsonl") if e.TYPE == "eval"]
    assert len(evals) == 2 and evals[0].eval_loss == pytest.approx(math.log(2), rel=1e-6)
    assert evals[-1].eval_tokens == 32  # the eval pairs
