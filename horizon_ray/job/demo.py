"""The embedded demo: a tiny Llama-style model, its tokenizer and a checkable instruction dataset.

Everything is generated on first use, deterministically, into ``$HORIZON_RAY_HOME/demo`` (default
``~/.cache/horizon-ray/demo``); nothing is downloaded. The assets directory is built under a temporary
name and renamed into place with a manifest written last, so an interrupted build is rebuilt next time.

    assets = prepare_demo_assets()              # model/ (HF dir with tokenizer), train.jsonl, eval.jsonl
    spec = demo_spec(assets, output_dir)        # the JobSpec the demo trains with
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horizon_ray.atomic import atomic_path
from horizon_ray.home import horizon_home
from horizon_ray.jobspec import JobSpec

# Bump when anything below changes what gets generated; old asset directories are then ignored.
ASSETS_VERSION = 1

# A Llama-style decoder of ~1.4M parameters over the 262-id byte-level demo tokenizer: large enough to
# learn the four demo tasks in a few hundred steps, small enough for a 2-core CPU.
DEMO_MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 262,
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODEL_SEED = 1234
TRAIN_EXAMPLES = 4000
TRAIN_SEED = 1
EVAL_EXAMPLES = 200
EVAL_SEED = 2
EVAL_TASKS = ("copy", "reverse", "sort")
# The demo model's name in the catalogue of a `serve` that offers it (serve --demo-model, the default on a
# cluster serve starts); its data files are then named relative to the demo's data root (train.jsonl, eval.jsonl).
DEMO_MODEL_NAME = "demo-tiny"

# Evaluation by generation of the demo job: greedy answers to the held-out prompts, exact match.
DEMO_GENERATE: dict[str, Any] = {"max_tokens": 8, "metric": "exact_match", "max_prompts": 64, "batch_size": 64}
# The demo job: every training knob in one place (examples/demo.yaml mirrors it).
DEMO_JOB: dict[str, Any] = {
    "name": "demo",
    "method": "full",
    "training": {
        "seq_len": 128,
        "micro_batch_size": 8,
        "grad_accum": 1,
        "max_steps": 400,
        "lr": 3e-3,
        "schedule": {"type": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.1},
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "betas": [0.9, 0.95],
        "seed": 0,
        "packing": True,
    },
    "eval": {"every_steps": 50, "generate": DEMO_GENERATE},
    "checkpoint": {"every_steps": 100, "keep": 1},
    "engine": {"device": "auto"},
}


@dataclass(frozen=True)
class DemoAssets:
    root: Path  # the versioned assets directory
    model_dir: Path  # HF model directory: config.json, model.safetensors and the tokenizer files
    train_path: Path  # training JSONL (messages format)
    eval_path: Path  # held-out JSONL: its prompts never occur in train_path


def _manifest() -> dict[str, Any]:
    return {
        "version": ASSETS_VERSION,
        "model_config": DEMO_MODEL_CONFIG,
        "model_seed": MODEL_SEED,
        "train": [TRAIN_EXAMPLES, TRAIN_SEED],
        "eval": [EVAL_EXAMPLES, EVAL_SEED, list(EVAL_TASKS)],
    }


def prepare_demo_assets(home: Path | None = None, rebuild: bool = False) -> tuple[DemoAssets, bool]:
    """The demo assets, built if missing or stale. Returns (assets, whether they were built now)."""
    root = (home or horizon_home()) / "demo" / f"assets-v{ASSETS_VERSION}"
    assets = DemoAssets(root, root / "model", root / "train.jsonl", root / "eval.jsonl")
    manifest = root / "manifest.json"
    if not rebuild and manifest.is_file():
        try:
            if json.loads(manifest.read_text()) == _manifest():
                return assets, False
        except json.JSONDecodeError:
            pass
    root.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(root) as tmp:
        tmp.mkdir()
        _build(DemoAssets(tmp, tmp / "model", tmp / "train.jsonl", tmp / "eval.jsonl"))
        (tmp / "manifest.json").write_text(json.dumps(_manifest(), indent=2) + "\n")
    return assets, True


def _build(assets: DemoAssets) -> None:
    from horizon_ray.data import build_demo_tokenizer, make_demo_items
    from horizon_ray.engine import Engine, EngineConfig

    eng = Engine.from_config(DEMO_MODEL_CONFIG, EngineConfig(device="cpu", seed=MODEL_SEED))
    try:
        eng.save_pretrained(assets.model_dir)
    finally:
        eng.close()
    build_demo_tokenizer(assets.model_dir)

    train = make_demo_items(TRAIN_EXAMPLES, TRAIN_SEED)
    # Held out for real: no eval prompt occurs in the training data. "add" is left out of the eval set
    # because its 100 single-digit facts all occur in training: it can only be memorised.
    held_out = make_demo_items(EVAL_EXAMPLES, EVAL_SEED, tasks=EVAL_TASKS, exclude={it.prompt for it in train})
    for path, items in ((assets.train_path, train), (assets.eval_path, held_out)):
        with open(path, "w", encoding="utf-8") as f:
            for it in items:
                messages = [{"role": "user", "content": it.prompt}, {"role": "assistant", "content": it.answer}]
                f.write(json.dumps({"messages": messages, "task": it.task}) + "\n")


def demo_spec(assets: DemoAssets, output_dir: Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """The demo's JobSpec, with ``key=value`` overrides applied (e.g. ``training.max_steps=50``)."""
    from horizon_ray.jobspec import apply_overrides

    data = json.loads(json.dumps(DEMO_JOB))  # a deep copy
    data["model"] = {"path": str(assets.model_dir)}
    data["data"] = {"path": str(assets.train_path), "format": "messages", "eval_path": str(assets.eval_path)}
    data["output_dir"] = str(output_dir)
    return JobSpec.from_dict(apply_overrides(data, overrides))
