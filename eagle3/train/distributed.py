"""The ranks of one training: this process's place among them, and what they decide together."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from eagle3.errors import StageError


@dataclass
class DistEnv:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_distributed(device_setting: str) -> DistEnv:
    """Join the torchrun process group from env (gloo on CPU, nccl on CUDA); world 1 otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise StageError("train.device=cuda but no CUDA device is visible")
    if device_setting not in ("auto", "cpu", "cuda"):
        raise StageError(f"train.device={device_setting!r}: use auto, cpu or cuda")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return DistEnv(rank, world, local_rank, device)


def sum_over_ranks(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """t summed in place over the ranks (unchanged in a single process)."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def agree(env: DistEnv, no_batch: bool, stop: bool) -> tuple[bool, bool]:
    """(any rank out of batches, any rank asked to stop): one all-reduce across ranks, none
    (and no device synchronisation) in a single process."""
    if not env.distributed:
        return no_batch, stop
    flags = torch.tensor([float(no_batch), float(stop)], device=env.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0].item()), bool(flags[1].item())
