"""The planner's view of objective dpo: the pair layout, the second pass of the LM head in the step time, the
reference pass apart, and the host bytes of SFT."""

import pytest

from horizon_ray.planner import plan_for_spec


@pytest.mark.parametrize("method", ["full", "lora"])
def test_dpo_plan_counts_the_second_head_pass_and_the_reference(method):
    base = {"model": {"path": "qwen2.5-7b"}, "data": {"path": "x"}, "method": method,
            "training": {"seq_len": 1024, "micro_batch_size": 16, "grad_accum": 4, "max_steps": 10}}
    sft, dpo = plan_for_spec(base), plan_for_spec({**base, "objective": "dpo"})
    head = 2 * dpo.tokens_per_step * 3584 * 152064  # the 7B's hidden size and vocabulary
    forward_rate = dpo.timing["fwd_flops"] / dpo.timing["forward_s"]
    assert dpo.step_time_s == pytest.approx(sft.step_time_s + head / forward_rate, rel=1e-9)
    assert dpo.timing["preference_head_s"] == pytest.approx(head / forward_rate)
    assert 0 < dpo.reference_step_s < dpo.step_time_s and sft.reference_step_s is None
    assert dpo.host_bytes == sft.host_bytes and dpo.objective == "dpo" and sft.objective == "sft"
    assert "8 pairs a micro-batch" in dpo.reason


def test_the_dpo_recipe_loads_strictly_and_plans():
    from pathlib import Path

    from horizon_ray.jobspec import JobSpec

    path = Path(__file__).resolve().parents[2] / "examples" / "qwen2.5-7b-dpo-lora.yaml"
    spec = JobSpec.from_yaml(path, ["model.path=qwen2.5-7b"])  # the preset of the same shape
    assert spec.objective == "dpo" and spec.method == "lora" and spec.dpo.beta == 0.1
    p = plan_for_spec(spec)
    assert p.fits and p.objective == "dpo" and p.micro_batch_size == 16


def test_the_plan_commands_in_the_examples_run_as_written(capsys):
    """Each `horizon-ray plan` an example's header shows plans on this machine as written (before: the DPO
    recipe's named its /models path, which only its real weights satisfy, and plan took no key=value)."""
    import shlex
    from pathlib import Path

    from horizon_ray.cli import main

    root = Path(__file__).resolve().parents[2]
    commands = [line.lstrip("# ").split("  #")[0] for path in sorted((root / "examples").glob("*.yaml"))
                for line in path.read_text().splitlines() if line.lstrip("# ").startswith("horizon-ray plan ")]
    assert any("qwen2.5-7b-dpo-lora.yaml" in c for c in commands)
    for command in commands:
        argv = [a.replace("examples/", f"{root}/examples/") for a in shlex.split(command)[1:]]
        assert main(argv) == 0, command
        assert "FITS" in capsys.readouterr().out
