"""Safetensors in and out of the host store, with no torch model built on the way.

Loading reads each HF tensor straight into its unit's master buffer (with LoRA: into the frozen base's
wire, which is its only copy, cast to the compute dtype on the way; with a quantized base, quantized into the
packed wire on the way, quant.py), one tensor at a time. Saving writes HF-compatible shards (+ index) and
config.json into a temporary directory that is renamed into place only when complete, so a failure never
leaves a half-written model behind; one shard is in memory at a time (a quantized base's merged model is
dequantized shard by shard).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from horizon_ray.atomic import atomic_path
from horizon_ray.engine import heap
from horizon_ray.engine.model import TensorSlot
from horizon_ray.engine.quant import StoredTensor, stored_owner
from horizon_ray.engine.store import HostStore
from horizon_ray.errors import BadInput

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        missing = sorted({v for v in weight_map.values() if not (model_dir / v).is_file()})
        if missing:
            raise BadInput(f"{index} names shard(s) that do not exist: {missing}; copy the complete model")
        return {k: model_dir / v for k, v in weight_map.items()}
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise BadInput(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def load_into(store: HostStore, model_dir: Path, tied: bool, device: torch.device | None = None) -> None:
    """``device``: where a quantized base's tensors are quantized (the engine's; default the CPU). A checkpoint
    saved quantized by transformers + bitsandbytes has each weight's quant state beside it (quant.StoredTensor):
    the packed store takes it as it is (quant.PackedLayout.take)."""
    device = device or torch.device("cpu")
    files = _weight_files(model_dir)
    expected = {t.name for u in store.layouts for t in u.tensors}
    companions: dict[str, list[str]] = {}  # weight -> its quant state's tensors
    for k in files:
        owner = stored_owner(k)
        if owner != k:
            companions.setdefault(owner, []).append(k)
    unexpected = sorted(k for k in files if stored_owner(k) not in expected and not k.endswith(_IGNORED_SUFFIXES)
                        and not (tied and stored_owner(k) == "lm_head.weight"))
    if unexpected:
        raise BadInput(f"{model_dir} holds tensors the config does not describe, e.g. {unexpected[:3]}: "
                         "the config.json does not match the weights")
    missing = sorted(expected - files.keys())
    if missing:
        raise BadInput(f"{model_dir} lacks tensors the config needs, e.g. {missing[:3]} "
                         f"({len(missing)} missing): the config.json does not match the weights")
    handles: dict[Path, Any] = {}  # safetensors' safe_open handles

    def read(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt").__enter__()
        return handles[path].get_tensor(name)

    try:
        for unit, packed in zip(store.units, store.packed):
            for t in unit.layout.tensors:
                src = StoredTensor(t.name, read(t.name), {k: read(k) for k in companions.get(t.name, ())})
                if src.shape != t.shape:
                    raise BadInput(f"tensor {t.name} has shape {src.shape} in {files[t.name].name} but the "
                                     f"config implies {t.shape}: the config.json does not match the weights")
                if packed is not None:
                    packed.take(unit.master, t.key, src, device)
                else:  # floats, or a weight the checkpoint quantized and this store keeps unpacked
                    t.view_of(unit.master).copy_(src.dequantized(unit.master.dtype))
                del src  # one source tensor at a time
            store.refresh_wire(unit)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
        heap.give_back()  # the tensors read and the quantization's chunks, freed one at a time


def save_pretrained(store: HostStore, hf_config: dict, out_dir: Path, dtype: torch.dtype, max_shard_bytes: int,
                    tied: bool, merge: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Path:
    """``merge``: HF name, weights -> the weights to write (LoRA's merged W + scaling B A)."""
    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:  # the directory appears whole or not at all
        tmp.mkdir(parents=True)
        # the shards' members first (their names need the count), then one shard in memory at a time
        plan: list[list[tuple[int, TensorSlot]]] = [[]]
        size = 0
        for u, unit in enumerate(store.units):
            for t in unit.layout.tensors:
                nbytes = t.numel * dtype.itemsize
                if plan[-1] and size + nbytes > max_shard_bytes:
                    plan.append([])
                    size = 0
                plan[-1].append((u, t))
                size += nbytes
        total = sum(t.numel for members in plan for _, t in members) * dtype.itemsize
        weight_map = {}
        for i, members in enumerate(plan):
            shard = {}
            for u, t in members:
                unit, packed = store.units[u], store.packed[u]
                w = t.view_of(unit.master) if packed is None else packed.dequantize(unit.master, t.key)
                w = w if merge is None else merge(t.name, w)
                shard[t.name] = w.to(dtype).contiguous()
            name = "model.safetensors" if len(plan) == 1 else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
            save_file(shard, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            del shard
        if len(plan) > 1:
            with open(tmp / "model.safetensors.index.json", "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = dict(hf_config)
        config.pop("quantization_config", None)  # a pre-quantized base's: what is written here are floats
        dtype_name = str(dtype).removeprefix("torch.")
        config["torch_dtype"] = dtype_name
        config["dtype"] = dtype_name
        config["tie_word_embeddings"] = tied
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2)
    return out_dir


def save_state(store: HostStore, out_dir: Path) -> None:
    """Exact training state (master, moments, step counts) of the trained units (with LoRA: the adapters;
    the frozen base is the model directory's) as safetensors, written into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for u in store.trained:
        name = u.layout.name
        tensors[f"{name}.master"] = u.master
        tensors[f"{name}.exp_avg"] = u.exp_avg
        tensors[f"{name}.exp_avg_sq"] = u.exp_avg_sq
        tensors[f"{name}.step"] = u.step.reshape(1)
    save_file(tensors, out_dir / "engine_state.safetensors")


def load_steps(store: HostStore, state_dir: Path) -> None:
    """Only the AdamW step counts of a saved state (a rank of several: another rank loads the shared tensors)."""
    path = Path(state_dir) / "engine_state.safetensors"
    with safe_open(path, framework="pt") as f:
        for u in store.trained:
            u.step.copy_(f.get_tensor(f"{u.layout.name}.step")[0])


def load_state(store: HostStore, state_dir: Path) -> None:
    path = Path(state_dir) / "engine_state.safetensors"
    if not path.is_file():
        raise BadInput(f"no engine_state.safetensors in {state_dir}: not an engine checkpoint")
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        if store.frozen != any(k.startswith("lora.") for k in keys):
            want, got = ("LoRA", "full fine-tuning") if store.frozen else ("full fine-tuning", "LoRA")
            raise BadInput(f"{path} holds the state of a {got} run and this engine does {want}: resume "
                             "with the settings the checkpoint was written with")
        for u in store.trained:
            name = u.layout.name
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                key = f"{name}.{kind}"
                if key not in keys:
                    raise BadInput(f"{path} lacks {key}: it was written for another model")
                src = f.get_tensor(key)
                dst = getattr(u, kind)
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise BadInput(f"{path}: {key} is {tuple(src.shape)} {src.dtype}, the engine expects "
                                     f"{tuple(dst.shape)} {dst.dtype} (another model, precision mode or LoRA "
                                     "rank/targets)")
                dst.copy_(src)
            u.step.copy_(f.get_tensor(f"{name}.step")[0])
            store.refresh_wire(u)
