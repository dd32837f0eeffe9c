"""Tokenized samples: the contract between generate and everything downstream.

``tokenized.safetensors`` holds flat tensors (no per-sample Python objects):

- ``input_ids``  int32 [N_tokens]   every sample's tokens, concatenated
- ``loss_mask``  uint8 [N_tokens]   1 on assistant tokens (the ones the drafter learns)
- ``offsets``    int64 [N + 1]      sample i is tokens offsets[i]:offsets[i+1]
- ``sample_ids`` int64 [N]          stable ids of the samples (prompt order in the input file)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TOKENIZED = "tokenized.safetensors"


@dataclass
class TokenizedSamples:
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    offsets: torch.Tensor  # int64 [N+1]
    sample_ids: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return int(self.sample_ids.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]

    def validate(self, vocab_size: int | None = None) -> list[str]:
        """Content checks for deep verification; returns problems."""
        problems = []
        n = len(self)
        if self.offsets.numel() != n + 1 or int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.num_tokens:
            problems.append("offsets do not cover input_ids")
        elif bool((self.lengths() <= 0).any()):
            problems.append("empty sample in tokenized data")
        if self.loss_mask.numel() != self.num_tokens:
            problems.append("loss_mask and input_ids differ in length")
        if self.num_tokens and int(self.input_ids.min()) < 0:
            problems.append("negative token id")
        if vocab_size is not None and self.num_tokens and int(self.input_ids.max()) >= vocab_size:
            problems.append(f"token id {int(self.input_ids.max())} >= target vocab size {vocab_size}")
        if self.sample_ids.unique().numel() != n:
            problems.append("duplicate sample ids")
        return problems


def from_lists(samples: list[tuple[int, list[int], list[int]]]) -> TokenizedSamples:
    """(sample_id, input_ids, loss_mask) triples → flat tensors."""
    lengths = [len(ids) for _, ids, _ in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    if samples:
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    flat_ids = [t for _, ids, _ in samples for t in ids]
    flat_mask = [m for _, _, mask in samples for m in mask]
    return TokenizedSamples(
        input_ids=torch.tensor(flat_ids, dtype=torch.int32),
        loss_mask=torch.tensor(flat_mask, dtype=torch.uint8),
        offsets=offsets,
        sample_ids=torch.tensor([sid for sid, _, _ in samples], dtype=torch.int64),
    )


def write_tokenized(path: Path, data: TokenizedSamples) -> None:
    save_file(
        {
            "input_ids": data.input_ids.contiguous(),
            "loss_mask": data.loss_mask.contiguous(),
            "offsets": data.offsets.contiguous(),
            "sample_ids": data.sample_ids.contiguous(),
        },
        str(path),
        metadata={"format": "eagle3.tokenized.v1"},
    )


def read_tokenized(path: Path) -> TokenizedSamples:
    t = load_file(str(path))
    return TokenizedSamples(t["input_ids"], t["loss_mask"], t["offsets"], t["sample_ids"])
