"""DPO, IPO and robust DPO on the streamed engine against TRL's DPOTrainer on tiny models built here.

Reference: TRL 1.16's own loss, ``DPOTrainer._compute_loss`` (the function its training step calls), run on
the HF model (full) or the PEFT model (LoRA) with TRL's fused LM head and precomputed reference log-probs,
on a trainer object that holds just the attributes that function reads (building a whole DPOTrainer needs a
tokenizer, datasets and an accelerator, none of which changes the loss). The step around it is the HF
Trainer's: each micro-batch's loss / accumulation steps, backward, ``clip_grad_norm_``, ``torch.optim.AdamW``.
The batch layout differs as each side wants it: TRL's [chosen..., rejected...], the engine's rows 2i and
2i+1; both hold the same pairs.

Tolerances: float32, rtol 1e-4 on the loss and the gradient norm; the rewards rtol 1e-4 and atol 2e-5 (they
are differences of log-probs near -50); every weight after 3 steps rtol 1e-4 and atol 3e-5 (3 % of lr: AdamW
turns the roundoff of a near-zero gradient into a step of up to lr; one element in thousands leans on it).
Clipping is active on each step, 2 micro-batches of 2 pairs a step (with the RPO term one micro-batch of 4
pairs, see _against_trl).
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.utils import add_fused_lm_head

from horizon_ray.engine import Engine, EngineConfig, LoraConfig
from horizon_ray.engine.objective import DpoConfig
from horizon_ray.errors import BadInput
from tests.tiny import named_tensors, peft_reference, peft_trainable, preference_batches, tiny_llama, tiny_qwen2

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
T = 14


def _engine_batches(mbs):
    return [(ids, labels) for ids, labels, _ in mbs]


def _trl_inputs(ids, mask, ref_R=None):
    """TRL's batch of one micro-batch: chosen rows first, then rejected."""
    order = torch.cat([torch.arange(0, ids.shape[0], 2), torch.arange(1, ids.shape[0], 2)])
    ids, mask = ids[order], mask[order]
    attention = torch.zeros_like(ids)
    for r in range(ids.shape[0]):  # the prompt and the completion; the right padding is masked out
        attention[r, :int(mask[r].nonzero().max()) + 1] = 1
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": mask}
    if ref_R is not None:
        inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref_R[0::2], ref_R[1::2]
    return inputs


def _trl(model, dpo: DpoConfig):
    """The attributes of a DPOTrainer that _compute_loss reads, for ``dpo``'s loss with precomputed references."""
    types, weights = [dpo.loss], [1.0]
    if dpo.sft_weight:
        types, weights = [dpo.loss, "sft"], [1.0, dpo.sft_weight]
    accel = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t,
                            unwrap_model=lambda m: m)
    return SimpleNamespace(accelerator=accel, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
                           f_divergence_type="reverse_kl", loss_types=types, loss_weights=weights, beta=dpo.beta,
                           label_smoothing=dpo.label_smoothing, use_weighting=False, model=model,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                           _total_train_tokens=0, _tp_size=1, ref_model=None, args=SimpleNamespace())


def _trl_step(trainer, model, params, opt, mbs, refs, max_norm):
    """One HF Trainer step of DPOTrainer's loss: (loss, grad norm, TRL's metrics averaged over the step)."""
    opt.zero_grad()
    trainer._metrics["train"].clear()
    total = 0.0
    for (ids, _, mask), ref_R in zip(mbs, refs):
        loss = DPOTrainer._compute_loss(trainer, model, _trl_inputs(ids, mask, ref_R), return_outputs=False)
        (loss / len(mbs)).backward()
        total += float(loss.detach()) / len(mbs)
    norm = float(torch.nn.utils.clip_grad_norm_(params.values(), max_norm))
    opt.step()
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()}
    return total, norm, metrics


def _hf_logps(model, mbs):
    """Each engine row's summed completion log-prob under ``model`` (TRL's fused head), rows 2i / 2i+1."""
    out = []
    with torch.no_grad():
        for ids, _, mask in mbs:
            inputs = _trl_inputs(ids, mask)
            labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
            lp = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                       fused_lm_head=True).log_probs.sum(1)
            P = ids.shape[0] // 2
            rows = torch.empty(2 * P)
            rows[0::2], rows[1::2] = lp[:P], lp[P:]
            out.append(rows)
    return out


def _against_trl(eng, model, params, dpo: DpoConfig, max_norm: float, named):
    """3 steps of the engine and of TRL from the same weights and references; asserted step by step."""
    # RPO's NLL term is the mean over the step's chosen tokens here, over each micro-batch's in TRL (then the
    # mean over micro-batches): one micro-batch a step makes them the same
    steps = preference_batches(3, micro=1, pairs=4) if dpo.sft_weight else preference_batches(3, micro=2, pairs=2)
    opt = torch.optim.AdamW(params.values(), **HP)
    trainer = _trl(model, dpo)
    # the reference pass: the starting weights, as TRL's precompute_ref_log_probs
    refs = [[eng.sequence_logps(_engine_batches([mb])) for mb in mbs] for mbs in steps]
    for mbs, ref in zip(steps, refs):
        for got, want in zip(ref, _hf_logps(model, mbs)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    clipped = 0
    for step, (mbs, ref) in enumerate(zip(steps, refs)):
        loss = eng.train_step(_engine_batches(mbs), dpo=dpo, ref_logps=torch.cat(ref))
        ref_loss, ref_norm, ref_metrics = _trl_step(trainer, model, params, opt, mbs, ref, max_norm)
        got = eng.last_dpo.mean()
        if step == 0 and not dpo.sft_weight:  # the policy is the reference: every pair's delta is 0
            want0 = (1 / (2 * dpo.beta)) ** 2 if dpo.loss == "ipo" else math.log(2)
            assert loss == pytest.approx(want0, rel=1e-6)
            assert got["rewards/margins"] == 0.0 and got["rewards/accuracies"] == 0.0
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert got["loss"] == pytest.approx(ref_loss, rel=1e-4)
        assert eng.last_grad_norm == pytest.approx(ref_norm, rel=1e-4)
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
            # rewards are beta x differences of log-probs near -50: fp32 leaves them an absolute error ~1e-5
            assert got[name] == pytest.approx(ref_metrics[name], rel=1e-4, abs=2e-5), (step, name)
        if step > 0:  # at step 0 every margin is 0 up to roundoff, which decides TRL's ties
            assert got["rewards/accuracies"] == pytest.approx(ref_metrics["rewards/accuracies"])
        clipped += ref_norm > max_norm
    assert clipped == 3
    eng.close()
    assert eng.step == 3
    for name, p in named(eng).items():
        # AdamW divides each gradient by its own RMS: an element whose gradient is near zero takes a step of
        # up to lr whichever way fp32 roundoff tips it (seen: 1 of 4,096 elements 4.2e-5 apart under another
        # package set). So: all but 0.1 % of a tensor's elements within 3e-5 (+1e-4 relative), and none as far
        # as one step of lr (1e-3), which a real difference in the gradients would move every element by
        want = params[name].detach()
        off = (p - want).abs() > 3e-5 + 1e-4 * want.abs()
        assert off.float().mean() <= 1e-3, f"weight {name}: {int(off.sum())} of {off.numel()} elements apart"
        assert float((p - want).abs().max()) < 0.5 * HP["lr"], f"weight {name}: {(p - want).abs().max()}"
    return eng, refs


@pytest.mark.parametrize("dpo", [DpoConfig(beta=0.5), DpoConfig(beta=0.5, loss="ipo"),
                                 DpoConfig(beta=0.5, loss="robust", label_smoothing=0.2),
                                 DpoConfig(beta=0.5, sft_weight=0.3)], ids=["sigmoid", "ipo", "robust", "rpo"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_full_matches_trl_dpo(tmp_path, dpo, family):
    path, cls = (tiny_llama if family == "llama" else tiny_qwen2)(tmp_path)
    model = cls.from_pretrained(path).float()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    model.train()
    max_norm = 0.5
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=max_norm, checkpoint_every=2, device="cpu",
                                                    compute_dtype="float32", loss_chunk_tokens=5))
    _against_trl(eng, model, dict(model.named_parameters()), dpo, max_norm, lambda e: named_tensors(e.store.units))


@pytest.mark.parametrize("dpo", [DpoConfig(beta=0.2), DpoConfig(beta=0.2, loss="ipo"),
                                 DpoConfig(beta=0.2, loss="robust", label_smoothing=0.1)],
                         ids=["sigmoid", "ipo", "robust"])
def test_lora_matches_trl_dpo_with_peft(tmp_path, dpo):
    path, cls = tiny_llama(tmp_path, "base")
    lora = LoraConfig(r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj", "gate_proj", "down_proj"))
    base = cls.from_pretrained(path).float()
    model, init = peft_reference(base, lora, tmp_path)  # B random: A has a gradient from the first step
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    max_norm = 0.05
    eng = Engine.from_pretrained(path, EngineConfig(**HP, max_grad_norm=max_norm, checkpoint_every=1, device="cpu",
                                                    compute_dtype="float32", lora=lora))
    eng.load_adapter(init)
    _against_trl(eng, model, peft_trainable(model), dpo, max_norm, lambda e: named_tensors(e.store.adapters))


@pytest.fixture
def smoothing(tmp_path):
    """What the label-smoothing tests compare on: a tiny Llama as HF (TRL's fused head) and as the engine, one
    micro-batch of 3 pairs, and references apart from the policy (so that every pair's log-ratio differs)."""
    path, cls = tiny_llama(tmp_path)
    model = cls.from_pretrained(path).float()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", compute_dtype="float32"))
    mbs = preference_batches(1, micro=1, pairs=3)[0]
    ref = eng.sequence_logps(_engine_batches(mbs)) + torch.tensor([0.3, -0.2, 0.1, 0.4, -0.5, 0.0])
    yield SimpleNamespace(model=model, eng=eng, mbs=mbs, ref=ref)
    eng.close()


@pytest.mark.parametrize("e", [0.0, 0.1, 0.3, 0.45])
def test_label_smoothing_is_trls_robust_loss(smoothing, e):
    """label_smoothing means what it means in TRL 1.16: robust DPO's flip probability (loss robust), and nothing
    for sigmoid, whose TRL loss ignores it (there it is refused, not ignored). The engine's loss on a reference
    apart from the policy equals TRL's _compute_loss on the same log-probs, for each e."""
    model, eng, mbs, ref = smoothing.model, smoothing.eng, smoothing.mbs, smoothing.ref
    dpo = DpoConfig(beta=0.5, loss="robust", label_smoothing=e)
    want = DPOTrainer._compute_loss(_trl(model, dpo), model, _trl_inputs(mbs[0][0], mbs[0][2], ref),
                                    return_outputs=False).detach()
    plain = DPOTrainer._compute_loss(_trl(model, DpoConfig(beta=0.5)), model, _trl_inputs(mbs[0][0], mbs[0][2], ref),
                                     return_outputs=False)
    assert (float(want) == pytest.approx(float(plain), rel=1e-6)) == (e == 0.0)  # e changes TRL's robust loss
    loss = eng.train_step(_engine_batches(mbs), dpo=dpo, ref_logps=ref)
    assert loss == pytest.approx(float(want), rel=1e-5)
    smoothed = _trl(model, DpoConfig(beta=0.5))
    smoothed.label_smoothing = 0.2
    assert float(DPOTrainer._compute_loss(smoothed, model, _trl_inputs(mbs[0][0], mbs[0][2], ref),
                                          return_outputs=False)) == pytest.approx(float(plain), rel=1e-7)
    with pytest.raises(BadInput, match="IPO has none") as info:
        DpoConfig(loss="ipo", label_smoothing=0.1).validate()
    assert info.value.field == "dpo.label_smoothing"


@pytest.mark.parametrize("e", [0.0, 0.1, 0.3])
def test_sigmoid_with_label_smoothing_is_conservative_dpo(smoothing, e):
    """loss sigmoid with label_smoothing e is conservative DPO, -(1 - e) log s(beta d) - e log s(-beta d) (TRL
    < 1.0's sigmoid; what the spec's label_smoothing has meant since it was added). TRL 1.16's sigmoid ignores
    e, but its "aot" loss computes exactly this for a batch of one pair (sorting one log-ratio changes nothing):
    the engine's loss equals the mean over the pairs of TRL's aot loss of each pair alone."""
    model, eng, mbs, ref = smoothing.model, smoothing.eng, smoothing.mbs, smoothing.ref
    dpo = DpoConfig(beta=0.5, loss="sigmoid", label_smoothing=e)
    aot = _trl(model, DpoConfig(beta=0.5, loss="sigmoid"))
    aot.loss_types, aot.label_smoothing = ["aot"], e
    ids, mask = mbs[0][0], mbs[0][2]
    want = sum(float(DPOTrainer._compute_loss(aot, model, _trl_inputs(ids[2 * i:2 * i + 2], mask[2 * i:2 * i + 2],
                                                                      ref[2 * i:2 * i + 2]), return_outputs=False))
               for i in range(3)) / 3
    loss = eng.train_step(_engine_batches(mbs), dpo=dpo, ref_logps=ref)
    assert loss == pytest.approx(want, rel=1e-5)


def test_pairs_stay_in_one_row_group_and_chunks_change_nothing(tmp_path):
    """Row groups smaller than a pair and loss chunks of any size give the same step."""
    path, _ = tiny_llama(tmp_path)
    mbs = _engine_batches(preference_batches(1, micro=2, pairs=3)[0])
    results = []
    for rows_tokens, chunk in ((8192, 1024), (T, 3), (3 * T, 7)):
        eng = Engine.from_pretrained(path, EngineConfig(**HP, device="cpu", compute_dtype="float32",
                                                        layer_chunk_tokens=rows_tokens, loss_chunk_tokens=chunk))
        ref = eng.sequence_logps(mbs) - 0.1 * torch.arange(12.0)
        loss = eng.train_step(mbs, dpo=DpoConfig(), ref_logps=ref)
        eng.close()
        results.append((loss, eng.last_grad_norm, named_tensors(eng.store.units)))
    for loss, norm, w in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-6)
        assert norm == pytest.approx(results[0][1], rel=1e-5)
        for name, t in w.items():
            torch.testing.assert_close(t, results[0][2][name], rtol=1e-5, atol=1e-5)  # Adam-normalised roundoff


def test_bad_preference_steps_name_the_fix(tmp_path):
    path, _ = tiny_llama(tmp_path)
    eng = Engine.from_pretrained(path, EngineConfig(device="cpu", compute_dtype="float32"))
    mbs = _engine_batches(preference_batches(1, micro=1, pairs=2)[0])
    with pytest.raises(BadInput, match="even number of rows"):
        eng.train_step([(mbs[0][0][:3], mbs[0][1][:3])], dpo=DpoConfig(), ref_logps=torch.zeros(3))
    with pytest.raises(BadInput, match="one reference log-probability per row"):
        eng.train_step(mbs, dpo=DpoConfig(), ref_logps=torch.zeros(3))
    with pytest.raises(BadInput, match="needs ref_logps"):
        eng.train_step(mbs, dpo=DpoConfig())
    with pytest.raises(BadInput, match="dpo.beta"):
        eng.train_step(mbs, dpo=DpoConfig(beta=0.0), ref_logps=torch.zeros(4))
    with pytest.raises(BadInput, match="label_smoothing"):
        DpoConfig(loss="ipo", label_smoothing=0.1).validate()
    assert eng.step == 0
    eng.close()
