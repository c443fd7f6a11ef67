"""One-pass CPU AdamW for the bf16 wire: the update DRAM traffic can't go below.

With bf16 compute, each parameter's step reads its bf16 gradient (from the buffer that is also its wire
copy), its fp32 master and moments, and writes the master, the moments and the new bf16 wire: 28 bytes.
torch's fused CPU AdamW needs an fp32 gradient and leaves the narrowing to another op, so the torch path
moves the chunk three times through the cores (widen, update, narrow). This kernel does it in one loop,
with torch.optim.AdamW's arithmetic (decoupled decay, lerp for m, bias corrections as torch computes them)
and the clip coefficient applied to the gradient first, as clip_grad_norm_ does.

It is compiled on first use with torch.utils.cpp_extension (needs a C++ compiler and ninja); where that is
not possible the optimizer falls back to the torch path and says so once.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

void adamw_bf16_wire(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                     torch::Tensor grad_wire, double lr, double beta1, double beta2, double eps,
                     double weight_decay, double step, double clip) {
    TORCH_CHECK(param.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous() &&
                grad_wire.is_contiguous(), "contiguous tensors expected");
    TORCH_CHECK(param.scalar_type() == at::kFloat && grad_wire.scalar_type() == at::kBFloat16, "dtypes");
    // the training thread must keep launching device work while this runs: drop the GIL
    pybind11::gil_scoped_release no_gil;
    float* p = param.data_ptr<float>();
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    uint16_t* gw = reinterpret_cast<uint16_t*>(grad_wire.data_ptr<at::BFloat16>());
    const int64_t n = param.numel();
    const double bc1 = 1.0 - std::pow(beta1, step);
    const double bc2 = 1.0 - std::pow(beta2, step);
    const float step_size = static_cast<float>(lr / bc1);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const float decay = static_cast<float>(1.0 - lr * weight_decay);
    const float w1 = static_cast<float>(1.0 - beta1);
    const float b2 = static_cast<float>(beta2);
    const float w2 = static_cast<float>(1.0 - beta2);
    const float e = static_cast<float>(eps);
    const float c = static_cast<float>(clip);
    at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
        #pragma omp simd
        for (int64_t i = begin; i < end; ++i) {
            const float g = bf16_to_f32(gw[i]) * c;
            const float pi = p[i] * decay;
            const float mi = m[i] + w1 * (g - m[i]);
            const float vi = b2 * v[i] + w2 * g * g;
            const float denom = std::sqrt(vi) / bc2_sqrt + e;
            const float pn = pi - step_size * mi / denom;
            m[i] = mi;
            v[i] = vi;
            p[i] = pn;
            gw[i] = f32_to_bf16(pn);
        }
    });
}
"""

_lock = threading.Lock()
_module = None
_failed: str | None = None


def kernel():
    """The compiled module, or None when it cannot be built here (the reason is logged once)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            if os.environ.get("HORIZON_RAY_NO_CPU_KERNEL"):
                _failed = "disabled by HORIZON_RAY_NO_CPU_KERNEL"
                return None
            try:
                from torch.utils.cpp_extension import load_inline

                _module = load_inline(
                    name="horizon_ray_adamw_v3", cpp_sources=[_SOURCE], functions=["adamw_bf16_wire"],
                    # -fno-math-errno lets the compiler vectorise sqrt
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as exc:  # no compiler or ninja: the torch path is correct, only slower
                _failed = f"{type(exc).__name__}: {exc}"
                log.warning("one-pass CPU AdamW unavailable (%s); using torch's fused AdamW in three passes",
                            _failed.splitlines()[0][:200])
    return _module


def adamw_bf16_wire(master, exp_avg, exp_avg_sq, grad_wire, *, lr, betas, eps, weight_decay, step: float,
                    clip: float) -> bool:
    """Update one chunk in place; False when the kernel is unavailable (nothing was touched)."""
    mod = kernel()
    if mod is None:
        return False
    mod.adamw_bf16_wire(master, exp_avg, exp_avg_sq, grad_wire, lr, betas[0], betas[1], eps, weight_decay,
                        float(step), float(clip))
    return True
