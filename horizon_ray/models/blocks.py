"""The blocks a decoder layer is composed of, as plain descriptions (no torch): attention, a dense gated MLP, a
mixture of experts. Each block knows its tensors under their HF names (``entries``), the projections LoRA can
target in it, and what its weights cost in parameters and per-token matmuls; ``Layer`` composes one attention
and one MLP with the norms around them. The engine's layer template reads a layer's blocks to decide what to
compute (``horizon_ray.engine.layers``), the planner reads the same blocks to count bytes and FLOPs.

An entry is (HF tensor name, key in the layer's unit, shape). The keys are what the template reads ("q", "ln1",
"experts.3.gate", ...); a layer's entries are its unit's order in the host store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Entry = tuple[str, str, tuple[int, ...]]
# A LoRA target of a layer: (key of the weight in the unit, HF module path inside the layer, (in, out) of one
# copy, copies: the experts of a MoE layer adapted as one stacked parameter, else 1)
Target = tuple[str, str, tuple[int, int], int]
LAYER_TYPES = ("full_attention", "sliding_attention")
# The expert targets: PEFT's ParamWrapper adapts one stacked parameter per target, A [r x E, in] and
# B [out, r x E] (PEFT's target_parameters, named without the "mlp.").
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True)
class Attention:
    """Grouped-query self-attention with RoPE."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    kind: str = "full_attention"  # or "sliding_attention": the model's sliding window applies (LAYER_TYPES)
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2, Llama with attention_bias)
    o_bias: bool = False  # the output projection carries a bias (Llama with attention_bias)
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (each head: Qwen3), "proj" (OLMoE)
    fused_qkv: bool = False  # q, k, v are one tensor on disk and in the unit (Phi-3's qkv_proj)
    softcap: float | None = None  # scores s -> c tanh(s / c) (Gemma 2)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def entries(self, p: str, H: int) -> list[Entry]:
        q, kv, hd = self.q_dim, self.kv_dim, self.head_dim
        out: list[Entry]
        if self.fused_qkv:
            out = [(p + "self_attn.qkv_proj.weight", "qkv", (q + 2 * kv, H))]
        else:
            out = [(p + "self_attn.q_proj.weight", "q", (q, H)), (p + "self_attn.k_proj.weight", "k", (kv, H)),
                   (p + "self_attn.v_proj.weight", "v", (kv, H))]
        if self.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", "q_b", (q,)), (p + "self_attn.k_proj.bias", "k_b", (kv,)),
                    (p + "self_attn.v_proj.bias", "v_b", (kv,))]
        if self.qk_norm:
            per_head = self.qk_norm == "head"
            out += [(p + "self_attn.q_norm.weight", "q_norm", (hd if per_head else q,)),
                    (p + "self_attn.k_norm.weight", "k_norm", (hd if per_head else kv,))]
        out.append((p + "self_attn.o_proj.weight", "o", (H, q)))
        if self.o_bias:
            out.append((p + "self_attn.o_proj.bias", "o_b", (H,)))
        return out

    def targets(self, H: int) -> dict[str, Target]:
        q, kv = self.q_dim, self.kv_dim
        if self.fused_qkv:
            qkv = {"qkv_proj": ("qkv", "self_attn.qkv_proj", (H, q + 2 * kv), 1)}
        else:
            qkv = {"q_proj": ("q", "self_attn.q_proj", (H, q), 1), "k_proj": ("k", "self_attn.k_proj", (H, kv), 1),
                   "v_proj": ("v", "self_attn.v_proj", (H, kv), 1)}
        return {**qkv, "o_proj": ("o", "self_attn.o_proj", (q, H), 1)}

    def norms(self) -> dict[str, str]:
        return {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"} if self.qk_norm else {}


@dataclass(frozen=True)
class DenseMLP:
    """The gated MLP: down(act(gate(x)) * up(x))."""

    width: int  # the intermediate size
    act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    fused_gate_up: bool = False  # gate and up are one tensor (Phi-3's gate_up_proj)
    module: str = "mlp"  # its HF module inside the layer (Qwen2-MoE's shared expert: "mlp.shared_expert")
    key: str = ""  # prefix of its keys in the unit ("shared." for the shared expert)

    def entries(self, p: str, H: int) -> list[Entry]:
        m, k, W = f"{p}{self.module}.", self.key, self.width
        if self.fused_gate_up:
            return [(m + "gate_up_proj.weight", k + "gate_up", (2 * W, H)),
                    (m + "down_proj.weight", k + "down", (H, W))]
        return [(m + "gate_proj.weight", k + "gate", (W, H)), (m + "up_proj.weight", k + "up", (W, H)),
                (m + "down_proj.weight", k + "down", (H, W))]

    def targets(self, H: int) -> dict[str, Target]:
        m, W = self.module, self.width
        if self.fused_gate_up:
            return {"gate_up_proj": ("gate_up", f"{m}.gate_up_proj", (H, 2 * W), 1),
                    "down_proj": ("down", f"{m}.down_proj", (W, H), 1)}
        return {"gate_proj": ("gate", f"{m}.gate_proj", (H, W), 1), "up_proj": ("up", f"{m}.up_proj", (H, W), 1),
                "down_proj": ("down", f"{m}.down_proj", (W, H), 1)}

    def active_matmul_params(self, H: int) -> int:
        return 3 * H * self.width


@dataclass(frozen=True)
class MoE:
    """A mixture of experts in place of the MLP: a router picks each token's top-k experts (softmax in fp32,
    ``norm_topk_prob``: their weights renormalised), each a SwiGLU MLP; optionally a shared expert that every
    token passes through, scaled by sigmoid(x w_gate) (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    width: int  # each expert's intermediate size
    norm_topk_prob: bool
    module: str = "mlp"  # the HF module of router and experts (Mixtral: "block_sparse_moe")
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # one expert's gate, up, down
    fp32_combine: bool = False  # the routing weights multiply the experts' outputs in fp32 (HF's Mixtral)
    shared: DenseMLP | None = None  # the shared expert (keys "shared.gate", ...), gated by "shared_gate" [1, H]

    def entries(self, p: str, H: int) -> list[Entry]:
        E, W = self.num_experts, self.width
        gate, up, down = self.expert_names
        m = f"{p}{self.module}."
        out: list[Entry] = [(m + "gate.weight", "router", (E, H))]
        # each expert's gate then up rows, expert after expert: one [E, 2W, H] stack; then the downs: [E, H, W]
        for e in range(E):
            out += [(m + f"experts.{e}.{gate}.weight", f"experts.{e}.gate", (W, H)),
                    (m + f"experts.{e}.{up}.weight", f"experts.{e}.up", (W, H))]
        out += [(m + f"experts.{e}.{down}.weight", f"experts.{e}.down", (H, W)) for e in range(E)]
        if self.shared:
            out += self.shared.entries(p, H) + [(m + "shared_expert_gate.weight", "shared_gate", (1, H))]
        return out

    def targets(self, H: int) -> dict[str, Target]:
        E, W = self.num_experts, self.width
        return {"experts.gate_up_proj": ("experts.gate_up", "mlp.experts", (H, 2 * W), E),
                "experts.down_proj": ("experts.down", "mlp.experts", (W, H), E)}

    def active_matmul_params(self, H: int) -> int:
        """The router, a token's top-k experts and the shared expert with its gate."""
        shared = self.shared.active_matmul_params(H) + H if self.shared else 0
        return self.num_experts * H + self.top_k * 3 * H * self.width + shared

    def modules(self) -> tuple[str, ...]:
        """Its HF modules beyond its LoRA targets' (what PEFT's modules_to_save must not select)."""
        m = self.module
        shared = (self.shared.module, *(module for _, module, _, _ in self.shared.targets(0).values()),
                  f"{m}.shared_expert_gate") if self.shared else ()
        return (f"{m}.gate", f"{m}.experts", *shared)


@dataclass(frozen=True)
class Layer:
    """One decoder layer: norm, attention, residual; norm, MLP, residual. ``sandwich_norms``: norms also on the
    attention's and the MLP's outputs (Gemma: four norms)."""

    attn: Attention
    mlp: DenseMLP | MoE
    sandwich_norms: bool = False

    @property
    def moe(self) -> MoE | None:
        return self.mlp if isinstance(self.mlp, MoE) else None

    def entries(self, i: int, H: int) -> list[Entry]:
        """(HF name, key, shape) of every tensor of decoder layer i, in the unit's order."""
        p = f"model.layers.{i}."
        out = [(p + "input_layernorm.weight", "ln1", (H,)), *self.attn.entries(p, H)]
        if self.sandwich_norms:
            out += [(p + "post_attention_layernorm.weight", "ln1_post", (H,)),
                    (p + "pre_feedforward_layernorm.weight", "ln2", (H,))]
        else:
            out.append((p + "post_attention_layernorm.weight", "ln2", (H,)))
        out += self.mlp.entries(p, H)
        if self.sandwich_norms:
            out.append((p + "post_feedforward_layernorm.weight", "ln2_post", (H,)))
        return out

    def targets(self, H: int) -> dict[str, Target]:
        """The projections LoRA can target in this layer, in the layer's order (a shared expert's are not)."""
        return {**self.attn.targets(H), **self.mlp.targets(H)}

    def norms(self) -> dict[str, str]:
        """HF module name inside the layer -> key in the unit, of each norm."""
        if self.sandwich_norms:
            norms = {"input_layernorm": "ln1", "post_attention_layernorm": "ln1_post",
                     "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ln2_post"}
        else:
            norms = {"input_layernorm": "ln1", "post_attention_layernorm": "ln2"}
        return {**norms, **self.attn.norms()}

    def children(self) -> tuple[str, ...]:
        """Its HF modules that are not norms (what PEFT's modules_to_save must not select)."""
        targets = (module for _, module, _, _ in self.targets(0).values())
        return ("self_attn", "mlp", "act_fn", *targets, *(self.moe.modules() if self.moe else ()))

    def params(self, H: int) -> int:
        """Elements of the layer's unit: projections, biases, norms (all experts)."""
        return sum(math.prod(shape) for _, _, shape in self.entries(0, H))

    def matmul_params(self, H: int) -> int:
        """Weight elements of its projections (router and every expert included): what it streams."""
        return sum(math.prod(shape) for _, _, shape in self.entries(0, H) if len(shape) == 2)

    def active_matmul_params(self, H: int) -> int:
        """Weight elements a token's matmuls multiply by: attention, and the MLP (of a MoE: the router, the
        token's top-k experts and any shared expert)."""
        attn = sum(math.prod(shape) for _, _, shape in self.attn.entries("", H) if len(shape) == 2)
        return attn + self.mlp.active_matmul_params(H)
