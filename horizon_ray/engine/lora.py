"""LoRA on the streamed base: the adapters' configuration, layout, initialisation and PEFT file format.

With ``EngineConfig(lora=LoraConfig(...))`` the base model is frozen: each unit holds only its wire copy in
the compute dtype (2 bytes a parameter in bfloat16; float32 compute keeps an fp32 base), streamed exactly
as in full fine-tuning, with no master, moments or gradient. The trainable parameters are, per decoder
layer and targeted projection W [out, in], the pair A [r, in] and B [out, r], one adapter *unit* per layer
(``lora.{i}``), kept in fp32 with fp32 AdamW moments and an fp32 gradient (16 bytes a parameter): AdamW
on the host with torch.optim.AdamW's semantics, global-norm clipping over the adapters only (what
``clip_grad_norm_`` over a PEFT model's trainable parameters does).

The math is PEFT's, fused into the layer template (``layers.Template.layer``), no module objects:

    y = x W^T (+ b) + (dropout(x) A^T) B^T * alpha / r       in the compute dtype, the sum rounded once

Norms can train beside the adapters, as PEFT's ``modules_to_save`` does (``LoraConfig.modules_to_save``,
PEFT's matching rule: "norm" selects every norm, "input_layernorm" each layer's first). A selected norm is
an fp32 copy of the base's, trained with AdamW like the adapters: a layer's selected norms sit in its
adapter unit under the base's keys ("ln1", "ln2"), so the layer template reads them in place of the base's;
the final norm, when selected, is one more adapter unit (``lora.head``) after the layers'.

Supported: targets among the family's projections (q/k/v/o/gate/up/down_proj; Phi-3's qkv_proj and
gate_up_proj; a MoE layer's experts), one rank and alpha for all, ``use_rslora=False`` (scaling alpha / r),
no DoRA, no bias training, no trainable embeddings or LM head: such adapters are refused on load with the
reason.

The experts of a MoE layer are adapted as PEFT adapts a stacked parameter (``target_parameters``:
``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, named here ``experts.gate_up_proj`` and
``experts.down_proj``): one A [r x E, in] and one B [out, r x E] per layer and target, expert e's update
scaling x B_e A_e with A_e rows e r .. e r + r - 1 and B_e every E-th column from e; PEFT names the innermost
of two wrapped parameters ``experts.base_layer.lora_A`` and allows no dropout there (neither does the engine).

Initialisation is PEFT's default: A kaiming-uniform with a = sqrt(5) (uniform in +-1/sqrt(in)), B zero,
so the adapted model starts as the base; drawn from a generator seeded by ``EngineConfig.seed``.

Files: ``save_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key
names (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``), in fp32, which
``peft.PeftModel.from_pretrained(base, dir)`` loads onto the transformers model; ``load_adapter`` reads
the same format back (an adapter written by PEFT, or by this engine).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from horizon_ray.atomic import atomic_path
from horizon_ray.engine.model import (
    EXPERT_TARGETS,
    LORA_TARGETS,
    QUANTIZE,
    ModelConfig,
    UnitLayout,
    _unit,
    check_targets,
    default_lora_targets,
    layer_entries,
    layer_targets,
    modules_to_save_norms,
    quantize_for,
)
from horizon_ray.errors import BadInput
from horizon_ray.models.blocks import Entry
from horizon_ray.workload import Adapters, check_lora_scaling

ADAPTER_CONFIG = "adapter_config.json"
# Beside an adapter trained on a quantized base (lora.quantize): how that base was quantized, so that generation
# runs the adapter over the base it learned on (PEFT's adapter_config.json has no field for it).
QUANTIZED_BASE = "quantized_base.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class LoraConfig:
    # Rank of every adapter.
    r: int = 8
    # scaling = alpha / r multiplies every adapter's output (PEFT's lora_alpha; use_rslora=False).
    alpha: float = 16.0
    # Dropout probability on each adapter's input while training (a fresh mask per projection).
    dropout: float = 0.0
    # Projections of every decoder layer that get an adapter (PEFT's target_modules); empty: the family's
    # default (model.default_lora_targets: q_proj and v_proj, Phi-3's qkv_proj), resolved by for_model.
    targets: tuple[str, ...] = ()
    # Norms trained beside the adapters, by PEFT's modules_to_save names ("norm": every norm).
    modules_to_save: tuple[str, ...] = ()
    # How the frozen base's projections are kept (model.QUANTIZE): "none" in the compute dtype, "nf4" / "fp4"
    # bitsandbytes' 4-bit with double-quantized scales (QLoRA), "int8" LLM.int8's rows (quant.py).
    quantize: str = "none"

    def validate(self) -> None:
        """The spec's rules (workload.py holds them), for a config built by hand as for one from a spec."""
        if isinstance(self.modules_to_save, str):
            raise BadInput(f"lora modules_to_save must be a list of module names, got the string "
                           f"{self.modules_to_save!r}; write [{self.modules_to_save!r}]")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        check_lora_scaling(self.alpha, self.dropout)
        Adapters(r=self.r, targets=targets, modules_to_save=tuple(self.modules_to_save), quantize=self.quantize).check()

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def for_model(self, cfg) -> LoraConfig:
        """This config on `cfg`'s family: its default targets where none are named; a pre-quantized
        checkpoint's quantize (model.quantize_for)."""
        return replace(self, targets=self.targets or default_lora_targets(cfg),
                       quantize=quantize_for(cfg.hf, self.quantize))

    @property
    def ordered_targets(self) -> tuple[str, ...]:
        """The targets in the layer's order (q, k, v, o, gate, up, down): the adapter unit's layout."""
        chosen = set(self.targets)
        return tuple(t for t in LORA_TARGETS if t in chosen)


def adapter_layouts(cfg: ModelConfig, lora: LoraConfig) -> list[UnitLayout]:
    """One adapter unit per decoder layer, ``lora.{i}``: A [r, in] then B [out, r] of each target (of the
    experts: A [r x E, in], B [out, r x E]), then the layer's selected norms; and ``lora.head`` with the final
    norm when it is selected. The tensor names are PEFT's saved names; the keys ("q.lora_A", "ln1", ...) are
    what the layer template reads."""
    lora = lora.for_model(cfg)
    check_targets(cfg, lora.targets)
    experts = [t for t in lora.ordered_targets if t in EXPERT_TARGETS]
    if experts and lora.dropout > 0:
        raise BadInput(f"lora dropout={lora.dropout} with targets {experts}: PEFT adapts the experts' stacked "
                       "parameters without dropout (ParamWrapper); set dropout to 0 or leave the experts out",
                       field="lora.dropout")
    norms, final = modules_to_save_norms(cfg, lora.modules_to_save)
    H = cfg.hidden_size
    units = []
    for i in range(cfg.num_layers):
        entries: list[Entry] = []
        table, have = cfg.layers[i].norms(), layer_targets(cfg, i)
        # a layer without a target (a dense layer's experts, a MoE layer's MLP) has no adapter there, as in PEFT
        for t in (t for t in lora.ordered_targets if t in have):
            key, module, (fan_in, fan_out), copies = have[t]
            rank = lora.r * copies
            name = f"{_PEFT_PREFIX}model.layers.{i}.{module}"
            if t in EXPERT_TARGETS:
                # PEFT nests one wrapper per stacked parameter, the first of the module's inside
                name += ".base_layer" * (len(experts) - 1 - experts.index(t))
            entries.append((f"{name}.lora_A.weight", f"{key}.lora_A", (rank, fan_in)))
            entries.append((f"{name}.lora_B.weight", f"{key}.lora_B", (fan_out, rank)))
        shape_of = {name: shape for name, _, shape in layer_entries(cfg, i)}
        for n in norms[i]:
            name = f"model.layers.{i}.{n}.weight"
            entries.append((_PEFT_PREFIX + name, table[n], shape_of[name]))
        if not entries:
            raise BadInput(f"lora targets {list(lora.targets)} train nothing in layer {i} (it has "
                           f"{', '.join(have)}); add a target every layer has, e.g. o_proj",
                           field="lora.targets")
        units.append(_unit(f"lora.{i}", entries))
    if final:
        units.append(_unit("lora.head", [(f"{_PEFT_PREFIX}model.norm.weight", "norm", (H,))]))
    return units


def _base_tensor(name: str) -> str:
    """A trained norm's PEFT name -> the base model's tensor it starts from and replaces."""
    return name.removeprefix(_PEFT_PREFIX)


def copy_base_norms(store) -> None:
    """Start every trained norm from the base's weights (once the base is loaded)."""
    base = {t.name: (u, t.key) for u, unit in enumerate(store.units) for t in unit.layout.tensors}
    for unit in store.adapters:
        views = unit.layout.views(unit.master)
        for t in unit.layout.tensors:
            if not t.key.endswith((".lora_A", ".lora_B")):
                u, key = base[_base_tensor(t.name)]
                src, packed = store.units[u], store.packed[u]  # a norm is never quantized
                views[t.key].copy_(src.layout.views(src.wire)[key] if packed is None else packed.plain(src.wire, key))


def init_adapters(adapters, seed: int) -> None:
    """PEFT's default initialisation: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0."""
    # a stream of its own, so that the adapters do not repeat the random numbers of from_config's base
    gen = torch.Generator().manual_seed(mix_seed(seed, 0x4C6F5241))
    for unit in adapters:
        views = unit.layout.views(unit.master)
        for t in unit.layout.tensors:
            if t.key.endswith(".lora_A"):
                bound = 1.0 / math.sqrt(t.shape[1])
                views[t.key].copy_(torch.empty(t.shape).uniform_(-bound, bound, generator=gen))
            elif t.key.endswith(".lora_B"):
                views[t.key].zero_()
            else:  # a trained norm: HF's initial value until copy_base_norms takes the base's
                views[t.key].fill_(1.0)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from several integers (splitmix64 steps), stable across processes and platforms."""
    x = 0
    for p in parts:
        x = ((x ^ (int(p) & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def merge_fn(adapters, lora: LoraConfig, cfg: ModelConfig):
    """For saving a merged model: HF base tensor name, tensor -> W + scaling x B A in fp32 (each expert's
    W + scaling x B_e A_e, split into its gate and up rows where the checkpoint keeps them apart), a trained
    norm in place of the base's (others as is)."""
    # HF name -> (adapter unit, key) or, for an expert, (adapter unit, stacked key, expert, first row, rows)
    where: dict[str, tuple] = {}
    norms, experts = {}, {}
    for unit in adapters:
        for t in unit.layout.tensors:
            if t.key.startswith("experts.") and t.key.endswith(".lora_A"):
                layer = int(t.name.split(".layers.")[1].split(".")[0])
                experts[(layer, t.key.removesuffix(".lora_A"))] = unit
            elif t.key.endswith(".lora_A"):
                where[_base_tensor(t.name).replace(".lora_A.", ".")] = (unit, t.key.removesuffix(".lora_A"))
            elif not t.key.endswith(".lora_B"):
                norms[_base_tensor(t.name)] = (unit, t.key)
    for (layer, key), unit in experts.items():
        moe = cfg.layers[layer].moe
        assert moe is not None, f"expert adapters on layer {layer}, which has no MoE"
        (gate, up, down), W = moe.expert_names, moe.width
        for e in range(moe.num_experts):
            p = f"model.layers.{layer}.{moe.module}.experts.{e}."
            if key == "experts.gate_up":
                where[p + f"{gate}.weight"] = (unit, key, e, 0, W)
                where[p + f"{up}.weight"] = (unit, key, e, W, W)
            else:
                where[p + f"{down}.weight"] = (unit, key, e, 0, cfg.hidden_size)

    def merge(name: str, w: torch.Tensor) -> torch.Tensor:
        if name in norms:
            unit, key = norms[name]
            return unit.layout.views(unit.master)[key].clone()
        if name not in where:
            return w
        unit, key, *expert = where[name]
        views = unit.layout.views(unit.master)
        a, b = views[f"{key}.lora_A"], views[f"{key}.lora_B"]
        if not expert:
            return w.float() + lora.scaling * (b @ a)
        e, lo, rows = expert
        E = cfg.num_experts
        a_e, b_e = a.view(E, lora.r, a.shape[1])[e], b.view(b.shape[0], lora.r, E)[:, :, e]
        return w.float() + lora.scaling * (b_e[lo:lo + rows] @ a_e)

    return merge


# ---- PEFT files ------------------------------------------------------------------------------------------


def adapter_config_json(lora: LoraConfig, base_model: str | None) -> dict:
    """PEFT's adapter_config.json for these adapters (the fields PEFT reads; the rest take its defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": [t for t in lora.ordered_targets if t not in EXPERT_TARGETS],
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": list(lora.modules_to_save) or None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
        # the experts' stacked parameters (PEFT's ParamWrapper), by their path inside a decoder layer
        "target_parameters": [f"mlp.{t}" for t in lora.ordered_targets if t in EXPERT_TARGETS] or None,
    }


def save_adapter(adapters, lora: LoraConfig, base_model: str | None, out_dir: Path,
                 base_quantize: str = "none") -> Path:
    """adapter_config.json + adapter_model.safetensors (fp32) into out_dir, atomically; ``base_quantize``: the
    quantization of the base it was trained on (model.QUANTIZE), recorded in QUANTIZED_BASE unless "none"."""
    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        tensors = {}
        for unit in adapters:
            views = unit.layout.views(unit.master)
            for t in unit.layout.tensors:
                tensors[t.name] = views[t.key].clone()
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        with open(tmp / ADAPTER_CONFIG, "w") as f:
            json.dump(adapter_config_json(lora, base_model), f, indent=2)
        if base_quantize != "none":
            (tmp / QUANTIZED_BASE).write_text(json.dumps({"quantize": base_quantize}) + "\n")
    return out_dir


def generation_quantize(hf: dict, adapter_dir: Path | None, requested: str | None = None) -> str:
    """How generation keeps a base (model.QUANTIZE): ``requested``, else as the adapter in ``adapter_dir`` was
    trained (its QUANTIZED_BASE), else in the compute dtype; a pre-quantized checkpoint as it is stored."""
    if requested is None:
        requested = trained_base_quantize(adapter_dir) if adapter_dir is not None else "none"
    if requested not in QUANTIZE:
        raise BadInput(f"quantize must be one of {', '.join(QUANTIZE)}, got {requested!r}")
    return quantize_for(hf, requested)


def trained_base_quantize(adapter_dir: Path) -> str:
    """The quantization of the base an adapter was trained on ("none": a float base, or not recorded)."""
    path = Path(adapter_dir) / QUANTIZED_BASE
    if not path.is_file():
        return "none"
    try:
        q = json.loads(path.read_text()).get("quantize", "none")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise BadInput(f"cannot read {path}: {exc}; delete it to run the adapter over the float base") from None
    if q not in QUANTIZE:
        raise BadInput(f"{path} names quantization {q!r}; it must be one of {', '.join(QUANTIZE)}")
    return q


def is_adapter_dir(path: Path) -> bool:
    """A PEFT adapter directory (adapter_config.json and no full model of its own)."""
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not any(
        (path / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json"))


def read_adapter_config(adapter_dir: Path) -> tuple[LoraConfig, str | None]:
    """The LoraConfig of a PEFT adapter directory and its base_model_name_or_path; refuses what the engine
    does not implement, naming it."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInput(f"cannot read {path}: {exc}") from None
    if raw.get("peft_type") != "LORA":
        raise BadInput(f"{path}: peft_type {raw.get('peft_type')!r} is not supported; only LORA adapters load")
    # features the template does not implement: each must be off (false, null or empty)
    refused = {
        "use_rslora": "rank-stabilised scaling (use_rslora) is not supported; scaling is lora_alpha / r",
        "use_dora": "DoRA is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
        "lora_bias": "lora_bias is not supported",
        "layers_to_transform": "adapters on a subset of layers (layers_to_transform) are not supported",
        "layer_replication": "layer_replication is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "trainable_token_indices": "trainable tokens are not supported",
        "use_qalora": "QA-LoRA is not supported",
    }
    for key, why in refused.items():
        if raw.get(key):
            raise BadInput(f"{path}: {key}={raw[key]!r}: {why}")
    if raw.get("bias", "none") != "none":
        raise BadInput(f"{path}: bias={raw['bias']!r}: trained biases are not supported (bias must be 'none')")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        raise BadInput(f"{path}: target_modules is the pattern {targets!r}; give a list of projection names "
                       f"among {', '.join(LORA_TARGETS)}")
    stacked = []
    for param in raw.get("target_parameters") or ():
        name = next((t for t in EXPERT_TARGETS if param == t or param.endswith("." + t)), None)
        if name is None:
            raise BadInput(f"{path}: target_parameters entry {param!r} is not supported; the engine adapts the "
                           f"experts' {', '.join('mlp.' + t for t in EXPERT_TARGETS)}")
        stacked.append(name)
    lora = LoraConfig(r=int(raw.get("r", 8)), alpha=float(raw.get("lora_alpha", 8)),
                      dropout=float(raw.get("lora_dropout", 0.0)), targets=(*(targets or ()), *stacked),
                      modules_to_save=tuple(raw.get("modules_to_save") or ()))
    try:
        lora.validate()
    except ValueError as exc:
        raise BadInput(f"{path}: {exc}") from None
    return lora, raw.get("base_model_name_or_path")


def load_adapter(adapters, adapter_dir: Path) -> None:
    """Read adapter_model.safetensors (PEFT's key names, with or without the adapter name) into the
    adapters' fp32 weights."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise BadInput(f"no {ADAPTER_WEIGHTS} in {adapter_dir}: not a PEFT adapter directory (a .bin adapter "
                       "must be converted to safetensors first)")
    with safe_open(path, framework="pt") as f:
        available = {k.replace(".default.weight", ".weight"): k for k in f.keys()}
        expected = {t.name for u in adapters for t in u.layout.tensors}
        missing = sorted(expected - available.keys())
        extra = sorted(available.keys() - expected)
        if missing or extra:
            raise BadInput(f"{path} does not match the engine's LoRA layout: missing {missing[:3]}, unexpected "
                           f"{extra[:3]}; the adapter was trained with other targets or on another model")
        for unit in adapters:
            views = unit.layout.views(unit.master)
            for t in unit.layout.tensors:
                src = f.get_tensor(available[t.name])
                if tuple(src.shape) != t.shape:
                    raise BadInput(f"{path}: {t.name} has shape {tuple(src.shape)}, the engine expects {t.shape} "
                                   "(another rank, or another model)")
                views[t.key].copy_(src)
