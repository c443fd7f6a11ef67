"""A job's objective as the engine takes it: the preference (DPO) settings and metrics, in plain Python (no torch),
so that the job spec validates them with the engine's own rules; the math is in preference.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from horizon_ray.errors import BadInput

OBJECTIVES = ("sft", "dpo")  # sft: next-token CE on the labels | dpo: preference pairs against a reference
LOSSES = ("sigmoid", "ipo", "robust")  # TRL's loss_type names; what each computes is TRL 1.16's
# TRL's metric names, in the order DpoMetrics.sums lays them out
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class DpoConfig:
    beta: float = 0.1  # strength of the KL penalty against the reference (IPO: its regulariser tau)
    loss: str = "sigmoid"  # "sigmoid" (DPO; conservative DPO with label_smoothing) | "ipo" | "robust" (robust DPO)
    # sigmoid: conservative DPO's smoothing of the preference labels; robust: the probability that a pair's
    # preference is flipped (TRL's meaning); in [0, 0.5)
    label_smoothing: float = 0.0
    sft_weight: float = 0.0  # weight of the chosen completions' mean token NLL added to the loss (RPO)

    def validate(self) -> None:
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise BadInput(f"dpo.beta must be > 0, got {self.beta}", field="dpo.beta")
        if self.loss not in LOSSES:
            raise BadInput(f"dpo.loss must be one of {LOSSES}, got {self.loss!r}", field="dpo.loss")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise BadInput(f"dpo.label_smoothing must lie in [0, 0.5), got {self.label_smoothing}",
                           field="dpo.label_smoothing")
        if self.label_smoothing and self.loss == "ipo":
            raise BadInput("dpo.label_smoothing applies to loss sigmoid (conservative DPO) and robust (robust DPO); "
                           "IPO has none: set it to 0", field="dpo.label_smoothing")
        if not (self.sft_weight >= 0 and math.isfinite(self.sft_weight)):
            raise BadInput(f"dpo.sft_weight must be >= 0, got {self.sft_weight}", field="dpo.sft_weight")


@dataclass(frozen=True)
class DpoMetrics:
    """A preference step's or evaluation's metrics, as sums over its pairs (``mean()`` gives TRL's values)."""

    pairs: int  # pairs the sums run over
    sums: tuple[float, ...]  # one sum per name of METRICS, over the pairs

    def mean(self, prefix: str = "") -> dict[str, float]:
        """TRL's names (``prefix`` + name, e.g. "eval_") -> the mean over the pairs."""
        return {prefix + name: s / max(1, self.pairs) for name, s in zip(METRICS, self.sums)}

    def __add__(self, other: DpoMetrics) -> DpoMetrics:
        return DpoMetrics(self.pairs + other.pairs, tuple(a + b for a, b in zip(self.sums, other.sums)))
