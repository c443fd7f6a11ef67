"""The one-pass bf16-wire AdamW kernel against torch.optim.AdamW, and the optimizer with and without it."""

import os
import subprocess
import sys
import time

import pytest
import torch

from horizon_ray.engine import cpu_adam
from horizon_ray.engine.model import _unit
from horizon_ray.engine.optimizer import HostAdamW
from horizon_ray.engine.store import HostStore

if cpu_adam.kernel() is None:  # pragma: no cover - a machine without a C++ toolchain
    pytest.skip(f"one-pass kernel unavailable: {cpu_adam._failed}", allow_module_level=True)

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_kernel_matches_torch_adamw_over_steps_with_clipping():
    n = 1_000_003  # not a multiple of any vector width
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=g)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], **HP)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, clip in enumerate([1.0, 0.3, 0.7], start=1):
        grad = (torch.randn(n, generator=g) * 0.01).bfloat16()
        wire = grad.clone()
        ref.grad = grad.float() * clip  # clip_grad_norm_ multiplies the gradient
        opt.step()
        cpu_adam.adamw_bf16_wire(p, m, v, wire, **HP, step=float(step), clip=clip)
        st = opt.state[ref]
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, st["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-6, atol=1e-12)
        assert torch.equal(wire, p.bfloat16())  # the wire is the master rounded to nearest even


def test_optimizer_one_pass_equals_three_passes():
    n = 300_000
    results = []
    for one_pass in (True, False):
        store = HostStore([_unit("u", [("w", "w", (n,))])], torch.bfloat16, torch.float32, pin=False)
        u = store.units[0]
        u.master.copy_(torch.linspace(-1, 1, n))
        store.refresh_wire(u)
        opt = HostAdamW(store, HP["betas"], HP["eps"], HP["weight_decay"])
        opt.one_pass = one_pass
        for step in range(3):
            u.grad.copy_(torch.sin(torch.arange(n) * (step + 1.0)) * 0.01)
            opt.update(u, HP["lr"], 0.5 if step == 1 else 1.0)
        results.append((u.master.clone(), u.exp_avg.clone(), u.wire.clone()))
    (p1, m1, w1), (p3, m3, w3) = results
    torch.testing.assert_close(p1, p3, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m1, m3, rtol=1e-6, atol=1e-9)
    assert (w1.float() - w3.float()).abs().max() <= 2 ** -7  # at most one bf16 ulp apart


def test_bf16_state_kernel_matches_torch_fused_adamw_on_bf16_tensors():
    """bf16 master, moments and gradient: the one-pass kernel (14 bytes a parameter) against torch's fused
    AdamW on the same bf16 tensors, which both compute in fp32 and round once at the store. They agree to
    one bf16 ulp wherever they differ at all (the order of a multiply-add), on a small share of elements."""
    n = 1_000_003
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g).bfloat16()
    m = (torch.randn(n, generator=g) * 0.01).bfloat16()
    v = (torch.rand(n, generator=g) * 1e-4).bfloat16()
    grad = (torch.randn(n, generator=g) * 0.01).bfloat16()
    for clip in (1.0, 0.5):
        ours = [t.clone() for t in (p, m, v)]
        ref = [t.clone() for t in (p, m, v)]
        ref_grad = grad.clone()
        if clip < 1:
            ref_grad.mul_(clip)  # what clip_grad_norm_ does to a bf16 gradient
        torch._fused_adamw_([ref[0]], [ref_grad], [ref[1]], [ref[2]], [], [torch.tensor(3.0)], lr=HP["lr"],
                            beta1=HP["betas"][0], beta2=HP["betas"][1], weight_decay=HP["weight_decay"],
                            eps=HP["eps"], amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
        assert cpu_adam.adamw_bf16(*ours, grad.clone(), **HP, step=3.0, clip=clip)
        for a, b in zip(ours, ref):
            differ = a != b
            assert differ.float().mean() < 1e-3
            ulp = b.float().abs() * 2 ** -7  # one bf16 ulp is at most 2^-7 relative
            assert ((a.float() - b.float()).abs() <= ulp)[differ].all()


def test_redo_lands_within_a_few_ulps_of_the_clipped_update():
    """The speculative rollback: an update with coefficient 1, then undone and redone with 0.3 in one pass,
    against the update with 0.3 done directly. Inverting divides by beta1, beta2 and the decay factor, so the
    state comes back to within a few fp32 ulps (not bit for bit); the wire is the new master rounded."""
    n = 1_000_003
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=g)
    m0 = torch.randn(n, generator=g) * 1e-3
    v0 = torch.rand(n, generator=g) * 1e-6
    grad = (torch.randn(n, generator=g) * 0.01).bfloat16()
    direct = [t.clone() for t in (p0, m0, v0)]
    direct_wire = torch.empty(n, dtype=torch.bfloat16)
    assert cpu_adam.adamw_f32(*direct, grad, direct_wire, **HP, step=4.0, clip=0.3)
    spec = [t.clone() for t in (p0, m0, v0)]
    wire = torch.empty(n, dtype=torch.bfloat16)
    assert cpu_adam.adamw_f32(*spec, grad, wire, **HP, step=4.0, clip=1.0)
    assert cpu_adam.adamw_f32_redo(*spec, grad, wire, **HP, step=4.0, clip=0.3)
    for a, b in zip(spec, direct):  # within a few fp32 ulps of each tensor's scale (v: 6e-7 seen)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert torch.equal(wire, spec[0].bfloat16())


def _load_kernel_in_a_child(extensions_dir, timeout_s: float) -> float:
    """Seconds a fresh process takes to get the compiled kernel with ``extensions_dir`` as its cache."""
    code = ("import sys, torch\nfrom horizon_ray.engine import cpu_adam\nmod = cpu_adam.kernel()\n"
            "assert mod is not None, cpu_adam._failed\n"
            "p = torch.ones(8); m = torch.zeros(8); v = torch.zeros(8); g = torch.ones(8, dtype=torch.bfloat16)\n"
            "w = torch.empty(8, dtype=torch.bfloat16)\n"
            "mod.adamw_f32(p, m, v, g, w, 0.1, 0.9, 0.999, 1e-8, 0.0, 1.0, 1.0)\n"
            "assert torch.allclose(p, torch.full((8,), 0.9)), p\n")
    # the repository this test file belongs to, whatever the working directory an earlier test left
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir), "PYTHONPATH": root}
    env.pop("HORIZON_RAY_NO_CPU_KERNEL", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=timeout_s, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return time.monotonic() - start


@pytest.mark.slow  # a compile of its own (about 1.5 min on 2 shared cores)
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    # what a build killed mid-compile leaves: cpp_extension's lock file in the build directories, both the
    # name this package used before and the one it uses now
    for name in ("horizon_ray_adamw_v7", cpu_adam.build_name()):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lock").touch()
    _load_kernel_in_a_child(tmp_path, timeout_s=400)  # a compile; the old loader waited here forever
    assert (tmp_path / f"{cpu_adam.build_name()}.so").is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert not list(tmp_path.glob("*.build-*")), "the private build directory is removed"
    # the next process loads the kept library without compiling: the file is the same one, not rebuilt (a check
    # of what happened, not of seconds: a timed bound failed on a loaded CI machine)
    so = tmp_path / f"{cpu_adam.build_name()}.so"
    before = (so.stat().st_ino, so.stat().st_mtime_ns)
    _load_kernel_in_a_child(tmp_path, timeout_s=400)
    assert (so.stat().st_ino, so.stat().st_mtime_ns) == before
    assert not list(tmp_path.glob("*.build-*"))


def test_a_build_leaves_the_library_name_as_it_was(tmp_path, monkeypatch):
    """torch's load_inline appends its libraries to the extra_ldflags list it is handed. Handed the module's own
    list, a process that built the library computed another name afterwards: a fresh CI machine's test process
    (which builds at import, its cache empty) looked for a library under a name the build had not used."""
    import torch.utils.cpp_extension as cpp_extension

    seen = []

    def load_inline(*, name, functions, extra_cflags, extra_ldflags, build_directory, **_):
        seen.append(name)
        extra_ldflags += ["-L/torch/lib", "-lc10", "-ltorch"]  # what torch 2.13's _prepare_ldflags does
        extra_cflags.append("-DTORCH_EXTENSION_NAME=" + name)
        functions.append("extra")
        (tmp_path / "private.so").write_bytes(b"")
        os.replace(tmp_path / "private.so", os.path.join(build_directory, f"{name}.so"))
        return "module"

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_adam.build_name()
    assert cpu_adam._load_or_build() == "module"
    assert seen == [name]
    assert cpu_adam.build_name() == name  # the old code: another name once the build had run
    assert (tmp_path / f"{name}.so").is_file()
