"""eval.generate: a job answers its held-out prompts by greedy generation at each eval and logs the share answered
right next to the eval loss; the number equals what the saved final model answers, scored independently."""

import json

import pytest

from horizon_ray.data import evaluate_demo, read_demo_items
from horizon_ray.engine.generate import Generator
from horizon_ray.engine.sampling import Request, SamplingParams
from horizon_ray.errors import BadInput
from horizon_ray.jobspec import JobSpec
from tests.tiny import job_assets


def _spec(assets, out, generate):
    return JobSpec.parse({
        "model": {"path": str(assets / "model")},
        "data": {"path": str(assets / "train.jsonl"), "eval_path": str(assets / "eval.jsonl")},
        "training": {"seq_len": 64, "micro_batch_size": 8, "max_steps": 30, "lr": 1e-2, "seed": 0},
        "eval": {"every_steps": 15, "generate": generate},
        "engine": {"device": "cpu"}, "output_dir": str(out)})


def test_each_eval_logs_the_generation_metric_of_the_current_weights(tmp_path, monkeypatch):
    from horizon_ray.data import make_demo_dataset
    from horizon_ray.job import generate_eval
    from horizon_ray.job.runner import run_job

    seen = []  # the answers of each eval, as the job generated them
    real = generate_eval.evaluate
    monkeypatch.setattr(generate_eval, "evaluate", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    assets = job_assets(tmp_path, 300)
    make_demo_dataset(assets / "eval.jsonl", 12, seed=9)
    result = run_job(_spec(assets, tmp_path / "out", {"max_tokens": 6, "metric": "exact_match", "max_prompts": 10,
                                                      "batch_size": 4}), progress=False)
    evals = [e for e in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())
             if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, 15, 30]
    assert all(e["generate_metric"] == "exact_match" and e["generate_prompts"] == 10 for e in evals)
    assert all(0.0 <= e["generate_score"] <= 1.0 and e["eval_loss"] > 0 for e in evals)
    # the last eval scored the weights that final/ holds: the same answers, generated from the saved model
    items = read_demo_items(assets / "eval.jsonl")[:10]
    gen = Generator.from_pretrained(result.final_dir, device="cpu")
    answers = gen.generate([Request(gen.chat_prompt([{"role": "user", "content": it.prompt}]),
                                    SamplingParams(max_tokens=6)) for it in items])
    assert seen[-1][1] == [a.text for a in answers]
    assert evals[-1]["generate_score"] == pytest.approx(evaluate_demo(items, [a.text for a in answers]).accuracy)
    assert seen[0][1] != seen[-1][1]  # training changed the answers
    assert [e["generate_score"] for e in evals] == [s for s, _ in seen]


def test_the_spec_refuses_an_unknown_metric():
    with pytest.raises(BadInput, match="metric"):
        JobSpec.parse({"model": {"path": "m"}, "data": {"path": "d.jsonl"},
                       "eval": {"generate": {"metric": "bleu"}}})
