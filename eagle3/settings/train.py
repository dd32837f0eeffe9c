"""Settings of the train stage."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from eagle3.processes import ProcsPerNode


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttt_steps: int = Field(7, ge=1, description="Training-time-test steps unrolled per sample.")
    ttt_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of step k is decay**k.")
    teacher_temperature: float = Field(1.0, gt=0, description=(
        "The drafter is taught softmax(z / T) of the target's logits z over the draft vocab. 1: the target's own "
        "distribution, right for serving at any sampling temperature (rejection sampling accepts by min(p, q)). "
        "Below 1 sharpens it toward the target's top token: for greedy serving (temperature 0, where a draft "
        "token is accepted iff it is the target's argmax) the drafter's capacity goes to that agreement; "
        "cross-entropy on the argmax is the T -> 0 end of the same idea."))
    epochs: float = Field(1.0, gt=0, description="Passes over the hidden-state shards.")
    feature_noise: float = Field(0.0, ge=0, description=(
        "Training only: each aux layer's hidden state h of each token gets uniform noise U(-a, a) * rms(h), "
        "a = feature_noise, before the drafter's fc (EAGLE-1's feature noise, relative to each layer's scale). A "
        "regulariser for small sample sets trained several epochs; 0: off. Held-out metrics see clean features."))
    loss_tokens: Literal["assistant", "all"] = Field("assistant", description=(
        "Which tokens of a training sample teach the drafter. assistant: the response's (the data stage's loss "
        "mask). all: every token, the prompt's too: the teacher is the target's own logits at each position, which "
        "extract keeps for every token, so a prompt's positions carry the target's predictions as a response's do, "
        "at no extra extraction and the same batches (a sample's tokens are in the batch either way; only the "
        "loss's rows grow, and with them the draft head's time and memory). Held-out metrics stay on the "
        "response's tokens."))
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    batch_tokens: int = Field(16384, ge=1, description="Tokens per optimizer step per process.")
    max_seq_len: int = Field(4096, ge=8, description="Longer samples are cut.")
    pack: bool = Field(True, description="Pack samples into rows of max_seq_len tokens, batch_tokens // max_seq_len "
                       "rows a batch, attention kept inside each sample (one batch shape: compiled once, no padding "
                       "but the rows' tails); off: samples of similar length right-padded together.")
    lr: float = Field(1e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decays to lr·min_lr_ratio.")
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta2: float = Field(0.95, gt=0, lt=1, description="AdamW's second-moment decay (beta1 is 0.9).")
    optimizer: Literal["adamw", "muon"] = Field("adamw", description=(
        "adamw: AdamW over every trained weight. muon: torch.optim.Muon (momentum orthogonalized by Newton-Schulz) "
        "over the drafter layer's weight matrices, AdamW over the draft head and the norms: speculators' default "
        "split. Muon's step is 0.2 lr in RMS (match_rms_adamw), AdamW's is up to lr early on, so Muon wants a larger "
        "lr than AdamW."))
    muon_weight_decay: float = Field(0.1, ge=0, description="Muon's weight decay on its matrices (weight_decay "
                                     "stays AdamW's); speculators' default.")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's (Nesterov) momentum.")
    adamw_lr: float | None = Field(None, gt=0, description=(
        "With optimizer muon: the peak lr of the AdamW group (the trained draft head and the norms), on the same "
        "schedule; unset: lr. AdamW's steps are near lr each, larger than the head wants at the lrs Muon wants: "
        "set it to an lr AdamW alone would train with. Unused with adamw."))
    lm_head: Literal["target-frozen", "target", "random"] = Field("target", description=(
        "The draft head's start: the target's lm_head rows of the draft vocab, trained (target) or kept frozen "
        "(target-frozen, as speculators does: no head gradient to compute); or a random init (random). From "
        "the target's head the drafter's output starts in the target's own final-hidden space; frozen, it stays "
        "there, however large the lr the drafter layer trains with."))
    init_std: float | None = Field(None, gt=0, description="Initial weights of every drafter linear layer ~ "
                                   "normal(0, init_std), as HF's initializer_range; unset: PyTorch's default init.")
    grad_clip: float = Field(0.5, gt=0)
    checkpoint_every: int = Field(500, ge=1, description="Optimizer steps between checkpoints (and on SIGTERM).")
    log_every: int = Field(10, ge=1)
    seed: int = Field(0)
    device: str = Field("auto", description="auto, cpu, cuda.")
    nproc_per_node: ProcsPerNode = Field("auto", description="torchrun processes per node (auto = GPUs, or 1 on CPU).")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="ddp, or fsdp for large drafters.")
    compile: bool = Field(True, description="On CUDA: torch.compile the drafter layer and the fused draft-head KL "
                          "(each falls back to eager, with one warning, where it cannot compile). Not with fsdp.")
    attention: Literal["auto", "flex", "sdpa"] = Field("auto", description="TTT attention: flex (block-sparse, "
                           "compiled on CUDA) or sdpa (dense mask); auto = flex on CUDA, sdpa on CPU.")
    copy_ahead: bool = Field(True, description="On CUDA: copy each batch to the GPU one step ahead on a side stream "
                             "(off: on the compute stream when the step takes it).")
    profile_steps: str | None = Field(None, pattern=r"^\d+:\d+$", description=(
        "A:B profiles optimizer steps A..B-1 with torch.profiler (rank 0): profile/summary.json (wall and device-busy "
        "time per step, data waits, GC pauses, top kernels), kernels.txt, host_ops.txt and trace.json.gz in the "
        "stage output. Pick steps after the first few, which compile."))
    eval_fraction: float = Field(0.02, ge=0, lt=1, description="Share of samples held out for validation metrics.")

    @field_validator("profile_steps")
    @classmethod
    def _profile_range(cls, v: str | None) -> str | None:
        if v is not None:
            a, b = (int(x) for x in v.split(":"))
            if a >= b:
                raise ValueError(f"{v!r}: A must be below B (steps A..B-1 are profiled)")
        return v

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """profile_steps "A:B" as (A, B), validated above."""
        if self.profile_steps is None:
            return None
        a, b = (int(x) for x in self.profile_steps.split(":"))
        return a, b
