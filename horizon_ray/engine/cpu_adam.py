"""One-pass CPU AdamW kernels: the update's DRAM traffic can't go below what they move.

The host update is bound by memory bandwidth (every byte of the master and moments is read and written
once a step), so each kernel does a unit's chunk in one loop through the cores:
- ``adamw_f32``: fp32 master and moments with a bf16 gradient and a bf16 wire, which may be one buffer
  (exact mode: the gradient is read before the new wire is written over it). Reads the bf16 gradient and
  the master and moments, writes them and the new bf16 wire: 28 bytes a parameter. torch's fused CPU AdamW
  needs an fp32 gradient and leaves the narrowing to another op, so the torch path moves the chunk three
  times through the cores (widen, update, narrow).
- ``adamw_f32_redo``: the speculative update's rollback: inverts an unclipped ``adamw_f32`` step from the
  kept gradient and redoes it clipped, in the same single pass (28 bytes a parameter, like one update).
- ``adamw_bf16``: "bf16-state": master (which is the wire), moments and gradient in bf16, the arithmetic in
  fp32 as torch's fused kernel does for bf16 tensors: 14 bytes a parameter, half of exact's.
Both follow torch.optim.AdamW's arithmetic (decoupled decay, lerp for m, bias corrections as torch computes
them) with the clip coefficient applied to the gradient first, as clip_grad_norm_ does (rounded to bf16 in
bf16-state, where clip_grad_norm_ scales the bf16 gradient in place).

They are compiled on first use with torch.utils.cpp_extension (needs a C++ compiler and ninja) and the
library is kept in the torch extensions cache under a name keyed by the source, flags and torch version, so a
later process loads it; where that is not possible the optimizer falls back to the torch path and says so once.
Each build runs in a fresh private directory and its library is moved into place with one rename:
cpp_extension's own build directory holds a ``lock`` file that a killed build leaves behind, and every later
process would wait on it forever.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
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

struct Hyper {
    float step_size, bc2_sqrt, decay, w1, b2, w2, e, c;
    Hyper(double lr, double beta1, double beta2, double eps, double weight_decay, double step, double clip) {
        const double bc1 = 1.0 - std::pow(beta1, step);
        const double bc2 = 1.0 - std::pow(beta2, step);
        step_size = static_cast<float>(lr / bc1);
        bc2_sqrt = static_cast<float>(std::sqrt(bc2));
        decay = static_cast<float>(1.0 - lr * weight_decay);
        w1 = static_cast<float>(1.0 - beta1);
        b2 = static_cast<float>(beta2);
        w2 = static_cast<float>(1.0 - beta2);
        e = static_cast<float>(eps);
        c = static_cast<float>(clip);
    }
};

static void check_f32(const torch::Tensor& param, const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq,
                      const torch::Tensor& grad, const torch::Tensor& wire) {
    TORCH_CHECK(param.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous() &&
                grad.is_contiguous() && wire.is_contiguous(), "contiguous tensors expected");
    TORCH_CHECK(param.scalar_type() == at::kFloat && grad.scalar_type() == at::kBFloat16 &&
                wire.scalar_type() == at::kBFloat16, "dtypes");
}

// fp32 master and moments; bf16 gradient and bf16 wire (which may be the same buffer)
void adamw_f32(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad,
               torch::Tensor wire, double lr, double beta1, double beta2, double eps, double weight_decay,
               double step, double clip) {
    check_f32(param, exp_avg, exp_avg_sq, grad, wire);
    // the training thread must keep launching device work while this runs: drop the GIL
    pybind11::gil_scoped_release no_gil;
    float* p = param.data_ptr<float>();
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>());
    uint16_t* w = reinterpret_cast<uint16_t*>(wire.data_ptr<at::BFloat16>());
    const Hyper h(lr, beta1, beta2, eps, weight_decay, step, clip);
    at::parallel_for(0, param.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
        #pragma omp simd
        for (int64_t i = begin; i < end; ++i) {
            const float gi = bf16_to_f32(g[i]) * h.c;  // read before w[i] is written: g and w may alias
            const float pi = p[i] * h.decay;
            const float mi = m[i] + h.w1 * (gi - m[i]);
            const float vi = h.b2 * v[i] + h.w2 * gi * gi;
            const float denom = std::sqrt(vi) / h.bc2_sqrt + h.e;
            const float pn = pi - h.step_size * mi / denom;
            m[i] = mi;
            v[i] = vi;
            p[i] = pn;
            w[i] = f32_to_bf16(pn);
        }
    });
}

// Undo an unclipped update of fp32 master and moments from its bf16 gradient (inverting its arithmetic: a few
// ulps, not bit for bit), then redo it with the clip coefficient, in one pass; writes the new bf16 wire
void adamw_f32_redo(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad,
                    torch::Tensor wire, double lr, double beta1, double beta2, double eps, double weight_decay,
                    double step, double clip) {
    check_f32(param, exp_avg, exp_avg_sq, grad, wire);
    pybind11::gil_scoped_release no_gil;
    float* p = param.data_ptr<float>();
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>());
    uint16_t* w = reinterpret_cast<uint16_t*>(wire.data_ptr<at::BFloat16>());
    const Hyper h(lr, beta1, beta2, eps, weight_decay, step, clip);
    // reciprocals: the inverse need not be bit-exact, and multiplies vectorise where divisions crawl
    const float inv_keep1 = 1.0f / (1.0f - h.w1);  // m' = (1 - w1) m + w1 g
    const float inv_decay = 1.0f / h.decay;
    const float inv_b2 = 1.0f / h.b2;
    at::parallel_for(0, param.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
        #pragma omp simd
        for (int64_t i = begin; i < end; ++i) {
            const float gi = bf16_to_f32(g[i]);  // the gradient the speculative update used, unclipped
            const float d1 = std::sqrt(v[i]) / h.bc2_sqrt + h.e;
            const float p0 = (p[i] + h.step_size * m[i] / d1) * inv_decay;
            const float m0 = (m[i] - h.w1 * gi) * inv_keep1;
            const float vr = (v[i] - h.w2 * gi * gi) * inv_b2;
            const float v0 = vr > 0.0f ? vr : 0.0f;
            const float gc = gi * h.c;
            const float mi = m0 + h.w1 * (gc - m0);
            const float vi = h.b2 * v0 + h.w2 * gc * gc;
            const float denom = std::sqrt(vi) / h.bc2_sqrt + h.e;
            const float pn = p0 * h.decay - h.step_size * mi / denom;
            m[i] = mi;
            v[i] = vi;
            p[i] = pn;
            w[i] = f32_to_bf16(pn);
        }
    });
}

// bf16 master (the wire), bf16 moments and gradient; fp32 arithmetic
void adamw_bf16(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor grad,
                double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                double clip) {
    TORCH_CHECK(param.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous() &&
                grad.is_contiguous(), "contiguous tensors expected");
    TORCH_CHECK(param.scalar_type() == at::kBFloat16 && exp_avg.scalar_type() == at::kBFloat16 &&
                exp_avg_sq.scalar_type() == at::kBFloat16 && grad.scalar_type() == at::kBFloat16, "dtypes");
    pybind11::gil_scoped_release no_gil;
    uint16_t* p = reinterpret_cast<uint16_t*>(param.data_ptr<at::BFloat16>());
    uint16_t* m = reinterpret_cast<uint16_t*>(exp_avg.data_ptr<at::BFloat16>());
    uint16_t* v = reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr<at::BFloat16>());
    const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>());
    const Hyper h(lr, beta1, beta2, eps, weight_decay, step, clip);
    const bool clipped = clip < 1.0;
    at::parallel_for(0, param.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
        #pragma omp simd
        for (int64_t i = begin; i < end; ++i) {
            float gi = bf16_to_f32(g[i]);
            if (clipped) gi = bf16_to_f32(f32_to_bf16(gi * h.c));  // clip_grad_norm_ scales the bf16 gradient
            const float m0 = bf16_to_f32(m[i]);
            const float pi = bf16_to_f32(p[i]) * h.decay;
            const float mi = m0 + h.w1 * (gi - m0);
            const float vi = h.b2 * bf16_to_f32(v[i]) + h.w2 * gi * gi;
            const float denom = std::sqrt(vi) / h.bc2_sqrt + h.e;
            p[i] = f32_to_bf16(pi - h.step_size * mi / denom);
            m[i] = f32_to_bf16(mi);
            v[i] = f32_to_bf16(vi);
        }
    });
}
"""

# Tuples, and the builder gets copies: torch's load_inline appends its own libraries to the extra_ldflags list it
# is given, which changed build_name() in a process that had built the library (its next load looked for
# another file).
_FUNCTIONS = ("adamw_f32", "adamw_bf16", "adamw_f32_redo")
# -fno-math-errno lets the compiler vectorise sqrt
_CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp")
_LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_module = None
_failed: str | None = None


def build_name() -> str:
    """The module's name: a change to the source, the flags or torch builds a new library, never reuses one."""
    import torch

    key = hashlib.sha256("\0".join([_SOURCE, *_FUNCTIONS, *_CFLAGS, *_LDFLAGS, torch.__version__]).encode())
    return f"horizon_ray_adamw_{key.hexdigest()[:16]}"


def build_root() -> str:
    """Where libraries are kept: ``TORCH_EXTENSIONS_DIR`` if set, else torch's extensions cache."""
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


def _import(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_or_build():
    from torch.utils.cpp_extension import load_inline

    name, root = build_name(), build_root()
    library = os.path.join(root, f"{name}.so")
    if os.path.exists(library):
        return _import(name, library)
    os.makedirs(root, exist_ok=True)
    # a directory no other process uses: nobody else's lock file (live or left by a killed build) is in it
    private = tempfile.mkdtemp(prefix=f"{name}.build-", dir=root)
    try:
        module = load_inline(name=name, cpp_sources=[_SOURCE], functions=list(_FUNCTIONS),
                             extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS), build_directory=private,
                             verbose=False)
        # one rename on one filesystem: a reader sees no library or a whole one; racing builders each
        # move an identical build, the last one wins
        os.replace(os.path.join(private, f"{name}.so"), library)
        return module
    finally:
        shutil.rmtree(private, ignore_errors=True)


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
                _module = _load_or_build()
            except Exception as exc:  # no compiler or ninja: the torch path is correct, only slower
                _failed = f"{type(exc).__name__}: {exc}"
                log.warning("one-pass CPU AdamW unavailable (%s); using torch's fused AdamW in several passes",
                            _failed.splitlines()[0][:200])
    return _module


def adamw_f32(master, exp_avg, exp_avg_sq, grad, wire, *, lr, betas, eps, weight_decay, step: float,
              clip: float) -> bool:
    """Update one chunk in place (fp32 master, bf16 gradient and wire); False when the kernel is unavailable
    (nothing was touched)."""
    mod = kernel()
    if mod is None:
        return False
    mod.adamw_f32(master, exp_avg, exp_avg_sq, grad, wire, lr, betas[0], betas[1], eps, weight_decay, float(step),
                  float(clip))
    return True


def adamw_f32_redo(master, exp_avg, exp_avg_sq, grad, wire, *, lr, betas, eps, weight_decay, step: float,
                   clip: float) -> bool:
    """Undo a chunk's unclipped update of step ``step`` (fp32 master, bf16 gradient) and redo it with ``clip``,
    in one pass; False when the kernel is unavailable (nothing was touched)."""
    mod = kernel()
    if mod is None:
        return False
    mod.adamw_f32_redo(master, exp_avg, exp_avg_sq, grad, wire, lr, betas[0], betas[1], eps, weight_decay,
                       float(step), float(clip))
    return True


def adamw_bf16(master, exp_avg, exp_avg_sq, grad, *, lr, betas, eps, weight_decay, step: float,
               clip: float) -> bool:
    """Update one chunk in place (bf16 master, moments and gradient); False when the kernel is unavailable."""
    mod = kernel()
    if mod is None:
        return False
    mod.adamw_bf16(master, exp_avg, exp_avg_sq, grad, lr, betas[0], betas[1], eps, weight_decay, float(step),
                   float(clip))
    return True


def adamw_bf16_wire(master, exp_avg, exp_avg_sq, grad_wire, **kw) -> bool:
    """``adamw_f32`` with the gradient and the wire in one buffer (exact mode's layout)."""
    return adamw_f32(master, exp_avg, exp_avg_sq, grad_wire, grad_wire, **kw)
