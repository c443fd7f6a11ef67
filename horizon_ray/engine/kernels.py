"""The layer template's elementwise work and its weight gradients, fused where the device allows.

Two sets of kernels compute the same functions:
- ``torch``: plain torch ops with HF transformers' arithmetic (RMSNorm in float32, RoPE and SwiGLU in the
  compute dtype, cross-entropy on float32 logits). Always used on the CPU, so the numerics tests pin the
  math against HF.
- ``liger``: Liger-Kernel's Triton kernels (RMSNorm with HF's Llama casting, RoPE, SwiGLU, the
  cross-entropy kernel that writes the logits' gradient in place). CUDA only, when ``liger_kernel`` is
  installed (``pip install horizon-ray[gpu]``). Each kernel rounds once where the torch ops round after
  every op, so bf16 results differ from HF's in the last bits; in float32 they agree to roundoff.

Weight gradients never exist as tensors of their own: ``linear`` takes the fp32 accumulator of its weight
(a view of the unit's gradient buffer on the device) and its backward adds ``dy^T x`` into it, on CUDA
inside the GEMM (``addmm`` with an fp32 output from bf16 operands), so a layer's backward writes each
weight gradient once instead of materialising it in bf16 and adding it in a second pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from horizon_ray.engine.model import KERNELS
from horizon_ray.errors import BadInput

log = logging.getLogger(__name__)

_CUDA_ATTENTION = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]


def liger_available() -> bool:
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
    except Exception:  # not installed, or no triton / GPU backend for it
        return False
    return True


def resolve_kernels(name: str, device: torch.device) -> str:
    """'auto' -> 'liger' on CUDA when Liger-Kernel imports, else 'torch'; 'liger' off CUDA is refused."""
    if name not in KERNELS:
        raise BadInput(f"kernels must be one of {KERNELS}, got {name!r}")
    if name == "torch":
        return "torch"
    if device.type != "cuda":
        if name == "liger":
            raise BadInput("kernels='liger' runs Triton kernels on a CUDA device; this engine runs on "
                             f"{device.type}: use kernels='auto' or 'torch'")
        return "torch"
    if liger_available():
        return "liger"
    if name == "liger":
        raise BadInput("kernels='liger' needs the liger-kernel package (pip install 'horizon-ray[gpu]'); "
                         "or use kernels='auto', which falls back to torch ops")
    log.warning("liger-kernel is not installed: the layer template runs unfused torch ops on CUDA "
                "(pip install 'horizon-ray[gpu]' for the fused kernels)")
    return "torch"


# ---- linear layers with gradient sinks ---------------------------------------------------------------------


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc in fp32: inside the GEMM on CUDA, through a product tensor on the CPU."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif acc.is_cuda:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


class _SinkLinear(torch.autograd.Function):
    """y = x W^T (+ b); the backward returns dL/dx and adds dL/dW (and dL/db) into fp32 accumulators."""

    @staticmethod
    def forward(ctx, x, w, b, gw, gb):
        ctx.save_for_backward(x, w)
        ctx.sinks = (gw, gb)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gw, gb = ctx.sinks
        gy_N = gy.reshape(-1, gy.shape[-1])
        accumulate_mm(gw, gy_N.t(), x.reshape(-1, x.shape[-1]))
        if gb is not None:
            gb.add_(gy_N.sum(0, dtype=gb.dtype))
        gx = gy @ w if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, gw: torch.Tensor | None = None,
           gb: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; with gw (and gb for a bias), the backward accumulates the weight's gradient there."""
    if gw is None or not torch.is_grad_enabled():
        return F.linear(x, w, b)
    return _SinkLinear.apply(x, w, b, gw, gb)


# ---- the elementwise kernels ------------------------------------------------------------------------------


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class Kernels:
    """One set of kernels for the layer template; ``name`` is 'torch' or 'liger' (see the module)."""

    name: str = "torch"

    @property
    def fused(self) -> bool:
        return self.name == "liger"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fused and weight.dtype == x.dtype:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            # in_place=False: the incoming gradient may be read again by the residual branch's add
            return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if weight.dtype == x.dtype:
            return weight * x32.to(x.dtype)  # HF's arithmetic
        # a trained fp32 norm (LoRA's modules_to_save) on narrower activations: the product in fp32, so that
        # the weight is used, and its gradient accumulated, at full precision; HF's bits for a bf16 weight
        return (weight * x32.to(x.dtype).float()).to(x.dtype)

    def rope(self, q_BHTd: torch.Tensor, k_BHTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor):
        """HF's rotate-half RoPE of q and k ([B, heads, T, head_dim]); cos/sin [B, T, head_dim]."""
        if self.fused:
            from liger_kernel.ops.rope import LigerRopeFunction

            return LigerRopeFunction.apply(q_BHTd, k_BHTd, cos_BTd, sin_BTd)
        cos, sin = cos_BTd[:, None], sin_BTd[:, None]
        return q_BHTd * cos + _rotate_half(q_BHTd) * sin, k_BHTd * cos + _rotate_half(k_BHTd) * sin

    def attention(self, q_BHTd, k_BHTd, v_BHTd, mask_B1TT, scale: float) -> torch.Tensor:
        """Causal (or masked) scaled dot-product attention with grouped-query heads, [B, heads, T, head_dim].
        On CUDA with the fused set, cuDNN's attention comes first (0.90 ms against flash's 1.43 ms for the
        forward and backward of a 7B layer's 8 x 1024 tokens on the H200), flash where cuDNN refuses."""
        gqa = q_BHTd.shape[1] != k_BHTd.shape[1]
        kw = {"is_causal": True} if mask_B1TT is None else {"attn_mask": mask_B1TT}
        if not (self.fused and q_BHTd.is_cuda):
            return F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, scale=scale, enable_gqa=gqa, **kw)
        with sdpa_kernel(_CUDA_ATTENTION, set_priority=True):
            return F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, scale=scale, enable_gqa=gqa, **kw)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [..., 2 x ffn] tensor holding gate then up (one GEMM made both)."""
        if self.fused:
            from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

            # on a 2-D view: the kernel's backward returns its gradient as [rows, 2 x ffn]
            rows = gate_up.view(-1, gate_up.shape[-1])
            return LigerFusedGateUpSiLUMulFunction.apply(rows).view(*gate_up.shape[:-1], -1)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def cross_entropy_(self, logits_NV: torch.Tensor, targets_N: torch.Tensor, scale: float,
                       grad: bool) -> torch.Tensor:
        """Sum over the chunk of scale x CE(logits, targets) (float32 scalar, -100 ignored), computed on
        float32 logits as HF does. With grad, the logits are overwritten by the gradient of that sum."""
        if self.fused:
            return _liger_cross_entropy_(logits_NV, targets_N, scale, grad)
        if not grad:
            return F.cross_entropy(logits_NV.float(), targets_N, ignore_index=-100, reduction="sum") * scale
        with torch.enable_grad():
            leaf = logits_NV.detach().requires_grad_()
            loss = F.cross_entropy(leaf.float(), targets_N, ignore_index=-100, reduction="sum") * scale
            (g,) = torch.autograd.grad(loss, [leaf])
        logits_NV.copy_(g)
        return loss.detach()


def _liger_cross_entropy_(logits_NV, targets_N, scale: float, grad: bool) -> torch.Tensor:
    import triton
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel

    n, V = logits_NV.shape
    loss_N = torch.zeros(n, dtype=torch.float32, device=logits_NV.device)
    # reduction "mean" with n_non_ignore = 1/scale: each row's loss and gradient come out multiplied by
    # scale (the step's 1 / target count), written in fp32 (loss) and into the logits (gradient)
    liger_cross_entropy_kernel[(n,)](
        X_ptr=logits_NV, X_stride=logits_NV.stride(-2), Y_ptr=targets_N, Y_stride=targets_N.stride(-1),
        weight_ptr=None, loss_ptr=loss_N, z_loss_ptr=None, loss_stride=loss_N.stride(-1),
        token_accuracy_ptr=None, token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0,
        n_cols=V, n_non_ignore=1.0 / scale, sum_non_ignore_weight=1.0 / scale, weight_sum=0.0, ignore_index=-100,
        lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None, RETURN_Z_LOSS=False,
        RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
        BLOCK_SIZE=min(32768, triton.next_power_of_2(V)), HAS_WEIGHT=False, HAS_SOFTCAPPING=False,
        HAS_GRADIENTS=grad, num_warps=32,
    )
    return loss_N.sum()
