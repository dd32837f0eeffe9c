"""The train stage's optimizers and their one learning-rate schedule.

``adamw``: one AdamW over every trained weight. ``muon``: ``torch.optim.Muon`` (momentum
orthogonalized by Newton-Schulz iterations) over the drafter's weight matrices, its step scaled
by ``match_rms_adamw`` (0.2 lr in RMS, AdamW's long-run size; early on AdamW steps nearly lr, so
Muon wants a larger lr: TrainSettings.optimizer); AdamW over the rest: the draft head
(embedding-like, kept on AdamW as Muon's authors and speculators do) and the norms. speculators
0.9.0 trains with this split by default.

Every optimizer follows the same warm-up and cosine (``schedule.lr_factor``), each from its own peak: Muon's
``lr``, its AdamW group's ``adamw_lr`` where set. A checkpoint
holds all optimizers' state in one dict keyed by parameter name
(``torch.distributed.checkpoint``'s full state dict), so DDP, FSDP and one process resume alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from eagle3.errors import StageError
from eagle3.settings.train import TrainSettings

VOCAB_MATRICES = ("lm_head.weight", "embed_tokens.weight")  # embedding-like: AdamW, as speculators splits


def muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon trains this parameter: a weight matrix, not a vector stored as one ([1, N]: Muon
    orthogonalizes matrices and fails on these under FSDP) and not the draft head or the embedding."""
    return param.ndim == 2 and min(param.shape) > 1 and not name.endswith(VOCAB_MATRICES)


class Optimizers:
    """The optimizers of one training, stepped and scheduled together."""

    def __init__(self, objective: torch.nn.Module, s: TrainSettings, factor: Callable[[int], float], fused: bool) -> None:
        named = [(n, p) for n, p in objective.named_parameters() if p.requires_grad]
        adamw = {"lr": s.lr, "weight_decay": s.weight_decay, "betas": (0.9, s.adam_beta2), "fused": fused or None}
        if s.optimizer == "muon":
            matrices = [p for n, p in named if muon_matrix(n, p)]
            rest = [p for n, p in named if not muon_matrix(n, p)]
            self.all: list[torch.optim.Optimizer] = [torch.optim.Muon(
                matrices, lr=s.lr, weight_decay=s.muon_weight_decay, momentum=s.muon_momentum,
                adjust_lr_fn="match_rms_adamw")]
            if rest:
                self.all.append(torch.optim.AdamW(rest, **{**adamw, "lr": s.adamw_lr or s.lr}))
        else:
            self.all = [torch.optim.AdamW([p for _, p in named], **adamw)]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.all]

    @property
    def lr(self) -> float:
        """The scheduled lr the next step uses (the first optimizer's: Muon's, or the one AdamW's)."""
        return self.schedulers[0].get_last_lr()[0]

    def step(self) -> None:
        for o in self.all:
            o.step()
        for sch in self.schedulers:
            sch.step()
        for o in self.all:
            o.zero_grad(set_to_none=True)

    def state_dict(self, wrapped: torch.nn.Module) -> dict[str, Any]:
        """Every optimizer's state by parameter name, and the schedule's position. One AdamW keeps
        the layout checkpoints had before Muon: ``scheduler`` is one dict."""
        optim = get_optimizer_state_dict(wrapped, self.all, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        scheds = [sch.state_dict() for sch in self.schedulers]
        return {"optimizer": optim, "scheduler": scheds[0] if len(scheds) == 1 else scheds}

    def load_state_dict(self, wrapped: torch.nn.Module, sd: dict[str, Any]) -> None:
        scheds = sd["scheduler"] if isinstance(sd["scheduler"], list) else [sd["scheduler"]]
        if len(scheds) != len(self.schedulers):
            raise StageError(f"checkpoint holds {len(scheds)} optimizer schedule(s), this training has "
                             f"{len(self.schedulers)}: it was written with another train.optimizer")
        set_optimizer_state_dict(wrapped, self.all, sd["optimizer"], options=StateDictOptions(full_state_dict=True))
        for sch, state in zip(self.schedulers, scheds):
            sch.load_state_dict(state)
