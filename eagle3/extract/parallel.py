"""Extraction over several processes (torchrun): the shards still to do, dealt to working ranks.

A rank works when the target fits its own GPU (``cuda:LOCAL_RANK``; or on CPU); when the
target must be spread over all of a node's GPUs, only local rank 0 of each node works and
the node's other ranks wait. Rank 0 has begun the stage attempt before any rank writes; it
decides what is left (its recovered shards), every working rank extracts its share and
writes shards and journal entries itself (:class:`eagle3.manifest.ObjectWriter`), and rank
0 includes them all in its manifest. Coordination is gloo (objects, not tensors). In a
single process nothing here touches torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @classmethod
    def from_env(cls) -> Ranks:
        env = os.environ
        return cls(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")))

    def join(self) -> None:
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("gloo")

    def leave(self) -> None:
        """After the last collective, on every rank: the process group closed, so no gloo thread is left for the
        interpreter's exit to abort ("terminate called without an active exception", the rank killed by SIGABRT
        after the stage committed)."""
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def device(self, base: torch.device) -> torch.device:
        """This rank's device: its own GPU when several processes share a node."""
        if base.type == "cuda" and self.distributed and base.index is None:
            return torch.device("cuda", self.local_rank % max(torch.cuda.device_count(), 1))
        return base


def my_share(todo: list[Any], working: list[bool], rank: int) -> list[Any]:
    """Round-robin share of ``todo`` for ``rank`` among the ranks whose ``working`` flag is set."""
    workers = [r for r, w in enumerate(working) if w]
    if rank not in workers:
        return []
    return todo[workers.index(rank) :: len(workers)]
