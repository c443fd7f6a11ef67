"""The host update modes: exact, speculative (validated, rolled back when clipping triggers) and delayed."""

import math

import pytest
import torch

from horizon_ray.engine import Engine, EngineConfig
from horizon_ray.engine.fence import Fence
from tests.tiny import llama_config, random_batches

CFG = llama_config(4)
HP = dict(lr=1e-3, weight_decay=0.1, seed=0)


def _state(eng, wires=True):
    eng.synchronize()
    return [t.clone() for u in eng.store.trained
            for t in (u.master, u.exp_avg, u.exp_avg_sq, *([u.wire] if wires else []))]


def _run(update, steps=3, max_grad_norm=1e6, batches=None, **kw):
    eng = Engine.from_config(CFG, EngineConfig(**HP, max_grad_norm=max_grad_norm, update=update, **kw))
    batches = batches or random_batches(steps, 2, T=16)
    losses = [eng.train_step(mbs) for mbs in batches]
    return eng, losses


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_is_bit_identical_to_exact_without_clipping(dtype):
    exact, le = _run("exact", compute_dtype=dtype)
    spec, ls = _run("speculative", compute_dtype=dtype)
    spec.synchronize()
    assert le == ls
    for a, b in zip(_state(exact), _state(spec)):
        assert torch.equal(a, b)
    stats = spec.stats()
    # every unit but the embedding was updated during its backward, and none rolled back
    assert stats.speculated_units == len(spec.store.trained) - 1 and stats.rollbacks == 0
    exact.close()
    spec.close()


def _max_deviation(a_state, b_state):
    """Largest |a - b| relative to the largest |a| of the same tensor, over master, m, v."""
    worst = 0.0
    for a, b in zip(a_state, b_state):
        scale = a.float().abs().max().item() or 1.0
        worst = max(worst, (a.float() - b.float()).abs().max().item() / scale)
    return worst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_clipping_step_rolls_back_and_lands_within_tolerance_of_exact(dtype):
    """max_grad_norm just below the first step's norm: every step clips, so every step's speculated units are
    rolled back by inverting their update and the step is redone with the clip coefficient."""
    batches = random_batches(3, 2, T=16)
    probe, _ = _run("exact", batches=batches[:1], compute_dtype=dtype)
    limit = probe.last_grad_norm * 0.999
    probe.close()
    # one step: the same gradients in both runs; the inversion lands within a few fp32 ulps of the state the
    # update started from, so the redone step is within a few ulps of exact mode's
    exact, le = _run("exact", batches=batches[:1], max_grad_norm=limit, compute_dtype=dtype)
    spec, ls = _run("speculative", batches=batches[:1], max_grad_norm=limit, compute_dtype=dtype)
    spec.synchronize()  # stats() describe the updates that have finished
    assert spec.stats().rollbacks == 1 and ls == le
    # (the wires are the masters rounded to bf16: one a few ulps off may round to the other neighbour)
    assert _max_deviation(_state(exact, wires=False), _state(spec, wires=False)) < 1e-5
    # three steps: with bf16 compute a master one fp32 ulp off can round to the other bf16 neighbour on the
    # wire, after which the runs differ at the level of bf16 roundoff, as any two bf16 runs would (up to 1.8e-2
    # of a moment tensor's largest element seen here; which units were speculated before the backward ended
    # depends on timing, so the exact figure varies from run to run)
    for run in (exact, spec):
        for mbs in batches[1:]:
            run.train_step(mbs)
    spec.synchronize()
    # every step clips: after the first rollback no step is speculated (the last one clipped)
    assert spec.stats().rollbacks == 1
    assert _max_deviation(_state(exact), _state(spec)) < (1e-5 if dtype == "float32" else 5e-2)
    exact.close()
    spec.close()


def test_a_non_finite_step_is_rolled_back_and_the_next_one_trains():
    batches = random_batches(3, 2, T=16)
    spec, _ = _run("speculative", batches=batches[:1])
    before = _state(spec)
    real = spec._grad_sink.flush
    calls = [0]

    def poisoned(u, acc, k):  # the fourth gradient to arrive (the second layer from the top) is not finite
        calls[0] += 1
        if calls[0] == 4:
            acc.fill_(float("nan"))
        real(u, acc, k)

    spec._grad_sink.flush = poisoned
    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        spec.train_step(batches[1])
    spec._grad_sink.flush = real
    # the units updated before the NaN arrived are back (to within the inversion's roundoff)
    assert _max_deviation(before, _state(spec)) < 1e-5
    exact, _ = _run("exact", batches=[batches[0], batches[2]])
    spec.train_step(batches[2])
    assert _max_deviation(_state(exact), _state(spec)) < 1e-5
    assert spec.step == 2
    exact.close()
    spec.close()


def test_speculation_stops_once_the_partial_norm_passes_max_grad_norm():
    """The squared norm only grows as gradients arrive (head first): the units whose partial norm is still
    within max_grad_norm are updated speculatively, the rest are not."""
    batches = random_batches(1, 2, T=16)
    probe = Engine.from_config(CFG, EngineConfig(**HP, max_grad_norm=1e6))
    partial = []
    real = probe._grad_sink.flush

    def record(u, acc, k):
        real(u, acc, k)
        partial.append(math.sqrt(float(probe._grad_sink.norm_sq)))

    probe._grad_sink.flush = record
    probe.train_step(batches[0])
    probe.close()
    # max_grad_norm between the partial norms after the 2nd and 3rd gradient: two units speculated
    limit = (partial[1] + partial[2]) / 2
    spec = Engine.from_config(CFG, EngineConfig(**HP, max_grad_norm=limit, update="speculative"))
    seen = []
    real_update = spec._optimizer.update

    def update(unit, lr, coef, k=0):
        seen.append((spec.store.units.index(unit), coef))
        real_update(unit, lr, coef, k)

    spec._optimizer.update = update
    spec.train_step(batches[0])
    spec.synchronize()
    order = spec.units.backward_order(spec.units.count)
    assert seen[:2] == [(order[0], 1.0), (order[1], 1.0)]  # speculated with coefficient 1
    assert all(coef < 1.0 for _, coef in seen[2:]) and len(seen) == 2 + spec.units.count  # all redone, clipped
    assert spec.stats().rollbacks == 1
    spec.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_delayed_step_reads_the_weights_after_the_update_two_steps_back(dtype):
    """Step k of the delayed update trains on the weights after the update of step k - 2 (the initial weights
    for steps 0 and 1), while the update of step k - 1 runs beside it: in its forward and in its backward."""
    batches = random_batches(5, 2, T=16)
    eng = Engine.from_config(CFG, EngineConfig(**HP, update="delayed", compute_dtype=dtype))
    initial = eng.store.units[2].master.clone()
    read, after = {}, {}
    real_weights, real_finish = eng._weights.weights, eng._optimizer._finish

    def capture(u, k):
        w = real_weights(u, k)
        if u == 2:  # layer 1: once in the forward, once in the backward
            read.setdefault(k, []).append(torch.cat([t.reshape(-1) for t in w.values()]).clone())
        return w

    def finish(k, lr, coef):
        real_finish(k, lr, coef)
        after[k] = eng.store.units[2].master.clone()  # the weights after the update of step k

    eng._weights.weights = capture
    eng._optimizer._finish = finish
    for mbs in batches:
        eng.train_step(mbs)
    eng.synchronize()
    cast = lambda t: t.to(getattr(torch, dtype))  # noqa: E731
    flat = lambda m: torch.cat([v.reshape(-1) for v in eng.store.units[2].layout.views(m, fused=True).values()])  # noqa: E731
    for k, reads in read.items():
        want = cast(flat(initial if k < 2 else after[k - 2]))
        assert len(reads) == 2 and all(torch.equal(r, want) for r in reads), k
    # and the newest weights are what evaluation sees
    assert torch.equal(cast(eng.store.units[2].master), eng.store.units[2].wire_of(eng.step + 1))
    eng.close()


def test_set_update_switches_layouts_and_keeps_training():
    batches = random_batches(6, 2, T=16)
    eng = Engine.from_config(CFG, EngineConfig(**HP, compute_dtype="bfloat16"))
    ref = Engine.from_config(CFG, EngineConfig(**HP, compute_dtype="bfloat16"))
    base = eng.store.bytes_by_kind()
    for mode, mbs in zip(["exact", "speculative", "exact", "delayed", "exact", "speculative"], batches):
        eng.set_update(mode)
        eng.train_step(mbs)
        if mode == "speculative":  # 2 bytes a parameter for every unit but the embedding
            extra = sum(u.layout.numel * 2 for u in eng.store.units[1:])
            assert eng.store.bytes_by_kind()["grads"] == base["grads"] + extra
        if mode == "delayed":  # a second bf16 wire for every unit
            assert eng.store.bytes_by_kind()["wire"] == base["wire"] + eng.num_params * 2
    eng.set_update("exact")
    assert eng.store.bytes_by_kind() == base
    for mbs in batches[:3]:
        ref.train_step(mbs)
    eng.close()
    ref.close()


def test_lora_and_bad_update_modes_are_refused():
    from horizon_ray.engine import LoraConfig

    with pytest.raises(ValueError, match="update must be one of"):
        EngineConfig(update="lazy").validate()
    with pytest.raises(ValueError, match="with lora the adapters' update takes milliseconds"):
        EngineConfig(update="delayed", lora=LoraConfig()).validate()


def test_fence_wait_mark_fail_reset():
    import threading

    f = Fence(2, "t")
    got = []
    th = threading.Thread(target=lambda: got.append(f.wait(1, 1)))
    th.start()
    f.mark(0, "a")
    f.mark(1, "b")
    th.join(5)
    assert got == ["b"] and f.version(1) == 1
    f.fail(KeyError("gone"))
    with pytest.raises(KeyError):
        f.wait(0, 2)
    assert f.wait(0, 1) == "a"  # already met: no error
    f.reset([5, 5])
    assert f.version(0) == 5 and f.wait(1, 5) is None


@pytest.mark.parametrize("dtype, precision", [("float32", "exact"), ("bfloat16", "exact"),
                                              ("bfloat16", "bf16-state")])
def test_switching_to_delayed_gives_every_layout_two_wires_apart_from_the_master(dtype, precision):
    """Where the master is the wire (fp32 compute, bf16-state), the delayed update needs two wires beside it:
    with one, a step would read the master while the previous step's update rewrites it, and the result
    would depend on the update's timing. Two runs whose updates take different times must agree bit for bit."""
    import time

    def run(delay):
        eng = Engine.from_config(CFG, EngineConfig(**HP, max_grad_norm=1.0, compute_dtype=dtype, precision=precision))
        update = eng._optimizer.update

        def slow(unit, lr, coef, k=0):
            time.sleep(delay * (eng.store.units.index(unit) % 3))
            update(unit, lr, coef, k)

        eng._optimizer.update = slow
        losses = []
        for i, mbs in enumerate(random_batches(10, 2, T=16)):
            if i in (3, 7):
                eng.set_update({3: "delayed", 7: "exact"}[i])
                if i == 3:
                    assert all(len(u.wires) == 2 and all(w is not u.master for w in u.wires)
                               for u in eng.store.units)
            losses.append(eng.train_step(mbs))
        state = _state(eng)
        eng.close()
        return losses, state

    (la, sa), (lb, sb) = run(0.0), run(0.01)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(sa, sb))


@pytest.mark.parametrize("switch", [0, 3])
def test_delayed_is_adamw_on_the_gradient_of_the_weights_one_update_old(tmp_path, switch):
    """Against HF + torch.optim.AdamW (fp32, clipping on every step): step k of the delayed update computes
    its gradient on the weights after update k - 2 and AdamW applies it to the weights after update k - 1.
    ``switch``: the step at which an exact run turns delayed (the runner's schedule); that step still reads
    the newest weights, the ones after it read one update old."""
    from tests.tiny import reference_step, tiny_llama

    path, cls = tiny_llama(tmp_path)
    reader, master = cls.from_pretrained(path).float(), cls.from_pretrained(path).float()
    opt = torch.optim.AdamW(master.parameters(), lr=HP["lr"], weight_decay=HP["weight_decay"])
    still = torch.optim.SGD(reader.parameters(), lr=0.0)  # reference_step's optimizer: moves nothing
    snapshot = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    history = [snapshot(master)]  # history[k]: the weights after update k - 1
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=0.5, device="cpu", compute_dtype="float32",
                                                    update="delayed" if switch == 0 else "exact"))
    for k, mbs in enumerate(random_batches(7, micro=2)):
        if k == switch and switch:
            eng.set_update("delayed")
        with torch.no_grad():
            for n, p in reader.named_parameters():
                p.copy_(history[k if k <= switch else k - 1][n])
        ref_loss, _, grads = reference_step(reader, dict(reader.named_parameters()), still, mbs, 0.5)
        for n, p in master.named_parameters():
            p.grad = grads[n]
        opt.step()
        history.append(snapshot(master))
        assert eng.train_step(mbs) == pytest.approx(ref_loss, rel=1e-4), k
    eng.synchronize()
    for u in eng.store.trained:
        views = u.layout.views(u.master)
        for t in u.layout.tensors:
            torch.testing.assert_close(views[t.key], history[-1][t.name], rtol=1e-4, atol=1e-5, msg=t.name)
    eng.close()
