"""``ModelConfig``: a model as its family module describes it from an HF config.json (no torch).

Model-wide facts are fields (vocabulary, hidden size, RoPE, norms' flavour, the final soft-cap, the
load-balancing loss); each decoder layer is a ``blocks.Layer`` in ``layers`` (its attention and its MLP or
mixture of experts, which may differ from layer to layer). The per-layer flags the engine and the planner read
model-wide (``qkv_bias``, ``num_experts``, ``layer_types``, ...) are derived from the layers, so that a fact
lives in one place. Parameter and FLOP counts come from the layers' blocks; the planner reads them as it reads a
preset (``name``, ``note``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from horizon_ray.models.blocks import DenseMLP, Layer


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the HF model_type: a key of horizon_ray.models.FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width (of the dense layers; MoE layers use their experts' width)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # RoPE base of the global (full-attention) layers
    # llama3 rope scaling parameters, or None for plain RoPE.
    rope_llama3: dict | None
    tie_word_embeddings: bool
    sliding_window: int | None  # sliding layers attend to at most this many previous tokens
    initializer_range: float
    rope_linear: float  # global layers' position interpolation: frequencies / this (Gemma 3 4B+: 8); 1: none
    local_rope_theta: float | None  # RoPE base of the sliding layers where it is their own (Gemma 3); None: global
    norm_offset: float  # 1.0: norms scale by (1 + w) in fp32 (Gemma); 0.0: by w with Llama's casting
    hidden_act: str  # the gated MLPs' activation: "silu" or "gelu_tanh"
    embed_scale: bool  # embeddings multiplied by sqrt(hidden_size) in the compute dtype (Gemma)
    attn_scale: float  # the softmax scale: head_dim^-0.5, or query_pre_attn_scalar^-0.5 (Gemma)
    final_softcap: float | None  # logits z -> c tanh(z / c) (Gemma 2, Gemma 3 where set)
    # MoE: the load-balancing loss's weight in the step's loss (router_aux_loss_coef); 0 when the config does
    # not ask for it (output_router_logits false), as HF computes it then.
    router_aux_coef: float
    # the embedding row of pad_token_id, which HF's nn.Embedding(padding_idx=...) gives no gradient; None: none
    padding_idx: int | None
    layers: tuple[Layer, ...]  # decoder layer i's blocks
    hf: dict = field(repr=False, compare=False, hash=False)  # the config.json it came from
    name: str = field(default="config", compare=False)  # a planner preset's name, or where it was read from
    note: str = field(default="", compare=False)  # where a preset's numbers come from

    # ---- derived from the layers ---------------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Per layer: "full_attention" or "sliding_attention" (the sliding window applies)."""
        return tuple(layer.attn.kind for layer in self.layers)

    @property
    def qkv_bias(self) -> bool:
        return self.layers[0].attn.qkv_bias

    @property
    def o_bias(self) -> bool:
        return self.layers[0].attn.o_bias

    @property
    def qk_norm(self) -> str | None:
        return self.layers[0].attn.qk_norm

    @property
    def fused_qkv(self) -> bool:
        return self.layers[0].attn.fused_qkv

    @property
    def sandwich_norms(self) -> bool:
        return self.layers[0].sandwich_norms

    @property
    def attn_softcap(self) -> float | None:
        return next((layer.attn.softcap for layer in self.layers if layer.attn.softcap), None)

    @property
    def fused_gate_up(self) -> bool:
        return any(isinstance(layer.mlp, DenseMLP) and layer.mlp.fused_gate_up for layer in self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.moe)

    @property
    def moe(self) -> bool:
        return bool(self.moe_layers)

    def _experts(self):
        return self.layers[self.moe_layers[0]].moe if self.moe_layers else None

    @property
    def num_experts(self) -> int:  # experts per MoE layer; 0 for a dense model
        return self._experts().num_experts if self.moe else 0

    @property
    def experts_per_token(self) -> int:  # k of the top-k routing
        return self._experts().top_k if self.moe else 0

    @property
    def moe_intermediate_size(self) -> int:  # each expert's MLP width
        return self._experts().width if self.moe else 0

    @property
    def norm_topk_prob(self) -> bool:  # the top-k routing weights renormalised to sum to 1
        return self._experts().norm_topk_prob if self.moe else False

    @property
    def layer_norms(self) -> dict[str, str]:
        """The norms of a decoder layer, HF module name inside the layer -> key in the unit."""
        return self.layers[0].norms()

    # ---- parameters and FLOPs --------------------------------------------------------------------------

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @property
    def layer_params(self) -> int:
        """The largest decoder layer's unit (what a weight slot holds)."""
        return max(layer.params(self.hidden_size) for layer in self.layers)

    @property
    def num_params(self) -> int:
        return sum(n for _, n in self.units())

    @property
    def matmul_params(self) -> int:
        """Weight elements of all decoder layers' projections (routers and every expert included)."""
        return sum(layer.matmul_params(self.hidden_size) for layer in self.layers)

    @property
    def active_matmul_params(self) -> int:
        """Weight elements a token's matmuls multiply by in all decoder layers (of a MoE layer: the router and
        the token's top-k experts)."""
        return sum(layer.active_matmul_params(self.hidden_size) for layer in self.layers)

    def units(self) -> list[tuple[str, int]]:
        """(name, parameter count) of each unit, in streaming order: embed, layer.0 .. layer.{L-1}, head."""
        H = self.hidden_size
        layers = [(f"layer.{i}", layer.params(H)) for i, layer in enumerate(self.layers)]
        return [("embed", self.embed_params), *layers, ("head", self.head_params)]

    # ---- as a planner shape ----------------------------------------------------------------------------

    def to_hf_config(self) -> dict:
        """The config.json it was read from (what ``Engine.from_config`` and transformers accept)."""
        return dict(self.hf)

    def with_layers(self, num_layers: int) -> ModelConfig:
        """The same model stacked ``num_layers`` deep (the planner's largest-model search)."""
        from horizon_ray.models import from_hf

        cfg = from_hf({**self.hf, "num_hidden_layers": num_layers})
        return cfg.named(f"{self.name}@{num_layers}L", f"{self.name}'s layer stacked {num_layers} deep")

    def named(self, name: str, note: str | None = None) -> ModelConfig:
        return replace(self, name=name, note=self.note if note is None else note)

    # ---- reading ---------------------------------------------------------------------------------------

    @staticmethod
    def load(source) -> ModelConfig:
        """From a config dict, a config.json path or a model directory holding config.json."""
        from horizon_ray.models import load

        return load(source)

    @staticmethod
    def from_hf(hf: dict) -> ModelConfig:
        """The family's description of an HF config dict (``horizon_ray.models.FAMILIES``)."""
        from horizon_ray.models import from_hf

        return from_hf(hf)
