"""The demo job under each update mode (benchmarks/update_modes_demo.py): speculative, which is exact AdamW,
ends where exact does and reports its rollbacks; delayed runs exact until its switch step (the same losses, bit
for bit), then one update behind, and still learns the task (not to exact's loss: on this small-batch,
high-learning-rate task the stale gradient costs a lot, docs/engine.md has the numbers)."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("update_modes_demo", ROOT / "benchmarks" / "update_modes_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_update_modes_on_the_demo_task(tmp_path):
    result = _load().run_modes(200, tmp_path, extra=["eval.every_steps=100"])
    exact, spec, delayed = result["exact"], result["speculative"], result["delayed"]
    assert exact["final_eval_loss"] < 1.0  # the task was learned, not only started
    switch = delayed["exact_steps"]
    # the switch step still reads the newest weights; the next one reads them one update old
    assert delayed["loss"][:switch + 1] == exact["loss"][:switch + 1]
    assert delayed["loss"][switch + 1] != exact["loss"][switch + 1]
    assert delayed["final_eval_loss"] < 1.0
    # every step that did not clip was the exact step; the ones that did were rolled back and redone
    assert abs(spec["final_eval_loss"] - exact["final_eval_loss"]) <= 0.01 * exact["final_eval_loss"]
    assert spec["loss"][0] == exact["loss"][0]
    assert 0 <= spec["rollbacks"] <= spec["clipped_steps"]
