"""`horizon-ray finetune` exit codes and messages, as the node agent relies on them (docs/CONTRACTS.md):
0 done, 2 bad input with a one-line message and no traceback, 1 crash."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from horizon_ray.cli import main
from horizon_ray.job import checkpoints as ck
from horizon_ray.job.events import Error, read_events

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def job(tmp_path):
    """A spec whose inputs exist on disk (contents are never read by these tests)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text("")
    spec = {
        "model": {"path": str(model)},
        "data": {"path": str(data)},
        "training": {"max_steps": 5},
        "output_dir": str(tmp_path / "out"),
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    return lines[0]


def test_missing_config_exits_2_with_one_line(tmp_path, capsys):
    assert main(["finetune", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in _one_line_error(capsys.readouterr().err)


def test_unknown_key_exits_2_and_names_it(job, capsys):
    assert main(["finetune", "--config", str(job), "training.lerning_rate=1e-4"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "training.lerning_rate" in line and "training.lr" in line


def test_missing_model_exits_2(job, capsys, tmp_path):
    assert main(["finetune", "--config", str(job), f"model.path={tmp_path / 'missing'}"]) == 2
    assert "model.path" in _one_line_error(capsys.readouterr().err)


def test_existing_run_without_resume_exits_2_and_logs_the_error(job, capsys, tmp_path):
    out = tmp_path / "out"
    ck.write_checkpoint(out / "checkpoints", 3, lambda d: d.mkdir(), {"step": 3})
    assert main(["finetune", "--config", str(job)]) == 2
    assert "--resume" in _one_line_error(capsys.readouterr().err)
    errors = [r for r in read_events(out / "metrics.jsonl") if isinstance(r, Error)]
    assert errors and "--resume" in errors[0].message


def test_resume_of_another_spec_exits_2(job, capsys, tmp_path):
    out = tmp_path / "out"
    ck.write_checkpoint(out / "checkpoints", 3, lambda d: d.mkdir(), {"step": 3, "training_hash": "other"})
    assert main(["finetune", "--config", str(job), "--resume"]) == 2
    assert "different job spec" in _one_line_error(capsys.readouterr().err)


def test_a_second_runner_on_the_same_output_dir_is_refused(job, capsys, tmp_path):
    from horizon_ray.job.runner import _exclusive

    out = tmp_path / "out"
    out.mkdir()
    with _exclusive(out):
        assert main(["finetune", "--config", str(job)]) == 75  # EX_TEMPFAIL: the coordinator retries later
    assert "another job is running" in _one_line_error(capsys.readouterr().err)


# Only BadInput is bad input (exit 2); any other exception, a ValueError of a bug too, is a crash (exit 1).
@pytest.mark.parametrize("exc", [RuntimeError("the engine fell over"), ValueError("too many values to unpack")])
def test_a_crash_exits_1_with_its_traceback(job, capsys, monkeypatch, exc):
    from horizon_ray.job import runner

    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(runner, "run_job", boom)
    assert main(["finetune", "--config", str(job)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.strip().splitlines()[-1] == f"error: the job crashed: {type(exc).__name__}: {exc}"


def test_print_spec_shows_the_resolved_spec(job, capsys):
    assert main(["finetune", "--config", str(job), "--print-spec", "training.lr=3e-4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["training"]["lr"] == 3e-4
    assert printed["training"]["schedule"]["type"] == "cosine"  # defaults filled in


def test_exit_code_2_through_the_console_script(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "horizon_ray", "finetune", "--config", str(tmp_path / "x.yaml")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    _one_line_error(proc.stderr)


def test_submit_of_a_misshapen_spec_exits_2_naming_the_section(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: /models/x\ndata: {path: /d.jsonl}\n")
    assert main(["submit", str(bad)]) == 2  # refused before any connection is made
    assert _one_line_error(capsys.readouterr().err) == "error: model must be a mapping of keys to values, not str"


@pytest.fixture
def malformed_data_job(tmp_path):
    """A spec whose data has a line cut short (line 3), and its paths relative to the spec file."""
    (tmp_path / "data").mkdir()
    good = json.dumps({"text": "a fine line"})
    (tmp_path / "data" / "train.jsonl").write_text(f"{good}\n{good}\n" + '{"text": "cut short\n')
    spec = {"model": {"path": "/models/elsewhere"}, "data": {"path": "data/train.jsonl"},
            "training": {"max_steps": 5}, "output_dir": "out"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_submit_refuses_malformed_data_before_contacting_the_service(malformed_data_job, capsys, monkeypatch):
    """`horizon-ray submit` reads every line of the data it sees: a malformed one is exit 2 at once, naming the
    field, file:line and the column within the line, not a job that fails on its node seconds later."""
    from horizon_ray.commands import submit

    def connect(args):
        raise AssertionError("contacted the service before checking the data")

    monkeypatch.setattr(submit, "connect", connect)
    assert main(["submit", str(malformed_data_job)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    data = malformed_data_job.parent / "data" / "train.jsonl"
    assert line == (f"error: data.path: {data}:3: not valid JSON at column 10: Unterminated string starting; "
                    "fix the line")


def test_finetune_in_a_ray_job_refuses_malformed_data_before_submitting(malformed_data_job, capsys, monkeypatch):
    """The Ray Jobs path (`ray job submit -- horizon-ray finetune ...`) checks the data before it hands the spec
    to the coordinator, like `submit` and the API's uploads."""
    import horizon_ray.cluster as cluster

    monkeypatch.setenv("HORIZON_RAY_SUBMIT", "1")
    monkeypatch.chdir(malformed_data_job.parent)
    monkeypatch.setattr(cluster, "submit_and_follow", lambda spec: pytest.fail("submitted malformed data"))
    assert main(["finetune", "--config", str(malformed_data_job)]) == 2
    assert "data.path: " in _one_line_error(capsys.readouterr().err)


def test_submit_expands_the_spec_files_paths_on_this_machine(tmp_path, monkeypatch):
    from horizon_ray.commands.submit import local_spec

    monkeypatch.setenv("HORIZON_RAY_HOME", str(tmp_path / "home"))
    path = tmp_path / "specs" / "job.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"model": {"path": "$HORIZON_RAY_HOME/m"}, "data": {"path": "d.jsonl"},
                                    "output_dir": "runs/x"}))
    spec = local_spec(path, ["training.max_steps=3"])
    assert spec["model"]["path"] == str(tmp_path / "home" / "m")
    assert spec["data"]["path"] == str(path.parent / "d.jsonl")  # written in the file: relative to the file
    # output_dir stays relative: the service puts it under the tenant's output namespace, jobs/<tenant>/
    assert spec["output_dir"] == "runs/x" and spec["training"] == {"max_steps": 3}
    # typed on the command line: relative to where it was typed
    spec = local_spec(path, ["output_dir=runs/y", "data.eval_path=e.jsonl"], cwd=tmp_path)
    assert spec["output_dir"] == "runs/y" and spec["data"] == {
        "path": str(path.parent / "d.jsonl"), "eval_path": str(tmp_path / "e.jsonl")}


def test_the_agents_child_trains_here_whatever_the_environment(job, tmp_path):
    # `python -m horizon_ray.job` is the node agent's child: never a Ray Jobs entrypoint that submits its spec
    import os

    out = tmp_path / "out"
    ck.write_checkpoint(out / "checkpoints", 3, lambda d: d.mkdir(), {"step": 3, "training_hash": "other"})
    env = {**os.environ, "HORIZON_RAY_SUBMIT": "1", "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    proc = subprocess.run([sys.executable, "-m", "horizon_ray.job", "--config", str(job), "--resume"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr  # refused, here, by the runner (not handed to a coordinator)
    assert "different job spec" in _one_line_error(proc.stderr)
    errors = [e for e in read_events(out / "metrics.jsonl") if isinstance(e, Error)]
    assert errors and "different job spec" in errors[0].message


def test_an_engine_refusing_the_model_files_is_bad_input(tmp_path, capsys):
    # the engine raises ValueError for files it cannot use; reading the spec's model, that is bad input
    from horizon_ray.data import build_demo_tokenizer
    from tests.tiny import llama_config

    model = tmp_path / "model"
    build_demo_tokenizer(model)
    (model / "config.json").write_text(json.dumps(llama_config(2, vocab=262)))  # and no weights
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "say hi", "output": "hi"}\n' * 4)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"model": {"path": str(model)}, "data": {"path": str(data), "eval_fraction": 0},
                                    "training": {"max_steps": 1, "micro_batch_size": 1, "seq_len": 32},
                                    "engine": {"device": "cpu"}, "output_dir": str(tmp_path / "out")}))
    assert main(["finetune", "--config", str(spec)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"model.path {model}" in line and "model.safetensors" in line
