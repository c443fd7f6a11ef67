"""Preference objectives (DPO, IPO) over the sequence log-probabilities the chunked loss computes.

A preference step holds pairs: rows 2i (chosen) and 2i+1 (rejected) of the step's rows, in the order the
micro-batches give them, with the labels of each row -100 everywhere but on its completion. The engine
sums each row's completion log-probabilities in a first pass over the LM head (no logits kept), this module
turns them into the loss and its gradient with respect to each row's summed log-probability, and a second
pass through the head sends that gradient down to every completion token of the row (d logp_row / d logp_t
is 1), so the layers' backward sweep is the same as for SFT.

The losses are TRL 1.16's (trl.trainer.dpo_trainer, ``loss_type`` "sigmoid", "ipo" and "robust"), each the
mean over the step's pairs: sigmoid -log sigmoid(beta x delta), where delta = (chosen - ref chosen) -
(rejected - ref rejected); ipo (delta / completion tokens of each row - 1 / (2 beta))^2 with each row's
log-ratio divided by its completion length first, as TRL does; robust, the unbiased loss of robust DPO
(Chowdhury et al. 2024) for labels flipped with probability e = label_smoothing, (-(1 - e) log sigmoid(beta
delta) + e log sigmoid(-beta delta)) / (1 - 2e) (e = 0 is DPO). sigmoid with label_smoothing e is the
conservative DPO of Mitchell (2023), -(1 - e) log sigmoid(beta delta) - e log sigmoid(-beta delta): TRL < 1.0's
sigmoid (TRL 1.16's sigmoid ignores label_smoothing; its "aot" loss computes this formula for one pair).
``sft_weight`` w adds w x the mean NLL over the chosen completions' tokens of the step (RPO; TRL's
``loss_type=["sigmoid", "sft"], loss_weights=[1, w]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from horizon_ray.engine.objective import DpoConfig
from horizon_ray.errors import BadInput


def check_pairs(rows: int, ref_logps_R: torch.Tensor | None) -> None:
    """A preference step has an even number of rows and, when given, one reference log-prob per row."""
    if rows % 2:
        raise BadInput(f"a preference step holds pairs, rows 2i (chosen) and 2i+1 (rejected); it has {rows} rows: "
                       "give every micro-batch an even number of rows")
    if ref_logps_R is not None and tuple(ref_logps_R.shape) != (rows,):
        got = tuple(ref_logps_R.shape) if isinstance(ref_logps_R, torch.Tensor) else type(ref_logps_R).__name__
        raise BadInput(f"ref_logps must hold one reference log-probability per row of the step ({rows}), got {got}")


def objective(cfg: DpoConfig, logps_R: torch.Tensor, ref_R: torch.Tensor, counts_R: torch.Tensor, n_pairs: int,
              n_chosen_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's loss (its pairs' losses / ``n_pairs``, the step's pairs on every rank; plus
    the RPO term over ``n_chosen_tokens``), and per-pair values for the metrics: [P, 7] in METRICS' order.
    ``logps_R``: the policy's summed completion log-probs of each row (float32, may require grad); ``ref_R``: the
    reference's; ``counts_R``: each row's completion tokens."""
    chosen, rejected = logps_R[0::2], logps_R[1::2]
    chosen_ratio = chosen - ref_R[0::2]
    rejected_ratio = rejected - ref_R[1::2]
    delta = chosen_ratio - rejected_ratio
    if cfg.loss == "sigmoid":
        e = cfg.label_smoothing
        per_pair = -F.logsigmoid(cfg.beta * delta) * (1 - e) - F.logsigmoid(-cfg.beta * delta) * e
    elif cfg.loss == "robust":
        e = cfg.label_smoothing
        per_pair = (-(1 - e) * F.logsigmoid(cfg.beta * delta) + e * F.logsigmoid(-cfg.beta * delta)) / (1 - 2 * e)
    else:
        lengths = counts_R.to(logps_R.dtype).clamp(min=1.0)
        ipo_delta = chosen_ratio / lengths[0::2] - rejected_ratio / lengths[1::2]
        per_pair = (ipo_delta - 1 / (2 * cfg.beta)) ** 2
    loss = per_pair.sum() / n_pairs
    if cfg.sft_weight:
        loss = loss - cfg.sft_weight * chosen.sum() / max(1, n_chosen_tokens)
    with torch.no_grad():
        r_c, r_r = cfg.beta * chosen_ratio, cfg.beta * rejected_ratio
        per = torch.stack([per_pair, r_c, r_r, (r_c > r_r).to(r_c.dtype), r_c - r_r, chosen, rejected], dim=1)
    return loss, per.detach()
