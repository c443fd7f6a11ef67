"""AdamW's hyper-parameters and their defaults, torch-free: the job spec's ``training`` section and
``EngineConfig`` both take their defaults from ``ADAMW``, so that an engine built by hand trains as a spec
that leaves them out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdamWDefaults:
    lr: float = 2e-5  # the peak learning rate; a schedule sets the step's
    betas: tuple[float, float] = (0.9, 0.999)  # torch.optim.AdamW's
    eps: float = 1e-8  # torch.optim.AdamW's
    weight_decay: float = 0.0  # decoupled decay
    max_grad_norm: float | None = 1.0  # global-norm clipping; None: none


ADAMW = AdamWDefaults()
