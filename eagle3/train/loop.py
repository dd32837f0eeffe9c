"""The training loop: one code path for 1 CPU process, 1 GPU, N GPUs or several nodes.

:class:`Trainer` sequences its parts: :func:`resume` (the newest checkpoint into the model,
optimizers and RNG), :func:`train_step` (forward, backward, clip, optimizer step),
:class:`StepLog` (metrics records), :class:`Checkpointer` and :func:`final_stats`.
Ranks run in lockstep: before each step they agree (one all-reduce) whether every rank
still has a batch and whether any was asked to stop (SIGTERM). A stop writes a
checkpoint at that step boundary and raises :class:`TrainingInterrupted`.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from eagle3.drafter.loss import TTTObjective, chain_rates, row_counts
from eagle3.drafter.masks import pack_block_lists
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.errors import StageError
from eagle3.extract.shards import HiddenShard
from eagle3.manifest import StageOutput
from eagle3.store import ObjectStore
from eagle3.train import checkpoint as ckpt_io
from eagle3.train.data import Batch, DataPlan
from eagle3.train.distributed import DistEnv, agree, sum_over_ranks
from eagle3.train.metrics import MetricsLog
from eagle3.train.optim import Optimizers
from eagle3.train.prefetch import AheadOnDevice, Prefetcher
from eagle3.train.profiling import StepProfiler
from eagle3.train.schedule import lr_factor
from eagle3.settings.train import TrainSettings

EVAL_MAX_BATCHES = 50


class TrainingInterrupted(StageError):
    """Stopped on request after writing a checkpoint; a rerun resumes from it."""


class StopFlag:
    """SIGTERM sets a flag; the loop checkpoints at the next step boundary and exits non-zero."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __call__(self) -> bool:
        return self.requested

    def install(self) -> StopFlag:
        def handler(signum: int, frame: Any) -> None:
            self.requested = True

        self._previous = signal.signal(signal.SIGTERM, handler)
        return self

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@dataclass
class TrainJob:
    drafter_cfg: DrafterConfig
    embed_weight: torch.Tensor  # [V, H] target embedding
    teacher_head: torch.Tensor  # [N, Ht] target lm_head rows of the draft vocab
    plan: DataPlan
    open_shard: Callable[[str], HiddenShard]
    settings: TrainSettings
    store: ObjectStore
    stage_prefix: str  # this attempt's folder, <run_id>/train/<root>
    output: StageOutput | None  # rank 0 only
    scratch: Path
    progress: Callable[..., None] = lambda *a, **k: None


def _build(job: TrainJob, env: DistEnv) -> tuple[torch.nn.Module, TTTObjective]:
    s = job.settings
    torch.manual_seed(s.seed)  # identical initial weights on every rank
    drafter = Eagle3Drafter(job.drafter_cfg)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(job.embed_weight)
        if s.init_std is not None:
            for m in drafter.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.normal_(0.0, s.init_std)
        if s.lm_head != "random":
            drafter.lm_head.weight.copy_(job.teacher_head)
        drafter.lm_head.weight.requires_grad_(s.lm_head != "target-frozen")
    attention = s.attention if s.attention != "auto" else ("flex" if env.device.type == "cuda" else "sdpa")
    compiled = s.compile and env.device.type == "cuda" and not (env.distributed and s.strategy == "fsdp")
    objective = TTTObjective(drafter, s.ttt_steps, s.ttt_decay, attention=attention, compiled=compiled,
                             temperature=s.teacher_temperature, feature_noise=s.feature_noise).to(env.device)
    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    drafter.embed_tokens.weight.data = drafter.embed_tokens.weight.data.to(dtype)  # frozen: no fp32 master needed
    objective.teacher_head = job.teacher_head.to(env.device, dtype)
    if not env.distributed:
        return objective, objective
    if s.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(drafter.embed_tokens)  # its own group: frozen and (on CUDA) bf16, unlike the rest
        fully_shard(drafter.midlayer)
        fully_shard(objective)
        return objective, objective
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(objective, device_ids=ids), objective


def _full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in sd.items() if k != f"{ckpt_io.DRAFTER_PREFIX}embed_tokens.weight"}


def _gather_rng(env: DistEnv) -> list[dict[str, Any]]:
    mine = ckpt_io.rng_state()
    if not env.distributed:
        return [mine]
    out: list[Any] = [None] * env.world
    dist.all_gather_object(out, mine)
    return out


def _prepared(batches: Iterator[Batch], steps: int, flex: bool, pin: bool) -> Iterator[Batch]:
    """Each batch with what its forward would otherwise derive on the GPU in many small kernels,
    derived from the host copy on the prefetch thread: the counted rows per TTT step and, for
    packed rows on flex attention, every step's block lists."""
    for b in batches:
        b.row_counts = row_counts(b.loss_mask, b.doc_ids, steps)
        packed = pack_block_lists(b.doc_ids, steps, pin) if flex and b.doc_ids is not None else None
        if packed is not None:
            b.block_lists, b.block_layout = packed
        yield b


def _eval(wrapped: torch.nn.Module, objective: TTTObjective, job: TrainJob, env: DistEnv, dtype: torch.dtype,
          pad_to: int) -> dict[str, float]:
    """Loss/accuracy per TTT step on the held-out samples (summed over ranks), uncompiled; with the
    chained accuracy (what decoding accepts) and how often each step repeats step 0's token."""
    steps = job.settings.ttt_steps
    sums = torch.zeros(7, steps, dtype=torch.float64, device=env.device)  # loss·n, hits, n, chain_sums
    it = job.plan.iterate(job.open_shard, 0, dtype, train=False, pad_to=pad_to)
    wrapped.eval()
    with torch.no_grad(), objective.eager():
        for _ in range(EVAL_MAX_BATCHES):
            batch = next(it, None)
            if agree(env, batch is None, False)[0]:
                break
            b = batch.to(env.device)
            with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=env.device.type == "cuda"):
                _, sl, sa, sc, chain = wrapped(b.input_ids, b.aux_hidden, b.final_hidden, b.loss_mask, chain=True)
            sums += torch.cat([torch.stack([sl.double() * sc, sa.double() * sc, sc.double()]), chain.double()])
    wrapped.train()
    sum_over_ranks(sums, env)
    n = sums[2].clamp_min(1)
    if sums[2].sum() == 0:
        return {}
    out = {f"eval_loss_{k}": float(sums[0, k] / n[k]) for k in range(steps)}
    out.update({f"eval_acc_{k}": float(sums[1, k] / n[k]) for k in range(steps)})
    chained, same = chain_rates(sums[3:])
    out.update({f"eval_chain_acc_{k}": chained[k] for k in range(steps)})
    out.update({f"eval_same_as_step0_{k}": same[k] for k in range(1, steps)})
    return out


@dataclass
class Position:
    """Where training stands: what a checkpoint records beside the weights."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_index: int = 0  # batches of this epoch done
    tokens: int = 0  # tokens trained on, all ranks


@dataclass
class StepOut:
    """One optimizer step's loss and per-TTT-step stats (on the device, not yet reduced over ranks)."""

    loss: Tensor
    step_loss: Tensor
    step_acc: Tensor
    step_count: Tensor
    grad_norm: Any
    lr: float  # the scheduled lr the step used


def resume(job: TrainJob, env: DistEnv, wrapped: torch.nn.Module,
           optimizers: Optimizers) -> tuple[int | None, Position, list[dict[str, Any]]]:
    """Load the newest complete checkpoint into the model and optimizers; (its step, or None when
    training starts afresh, the position it records, the metrics records up to it)."""
    # Resume: rank 0 knows the journaled checkpoints; every rank reads the same one.
    latest = None
    records: list[dict[str, Any]] = []
    if job.output is not None:
        latest = _adopt_latest(job.output)
    if env.distributed:
        box = [latest]
        dist.broadcast_object_list(box, src=0)
        latest = box[0]
    at = Position()
    if latest is not None:
        ck = ckpt_io.load_checkpoint(job.store, job.stage_prefix, latest)
        set_model_state_dict(wrapped, ck.model, options=StateDictOptions(full_state_dict=True, strict=False))
        optimizers.load_state_dict(wrapped, ck.optim)
        if len(ck.rng) == env.world:
            ckpt_io.set_rng_state(ck.rng[env.rank])
        at = Position(ck.step, ck.state["epoch"], ck.state["batch_index"], ck.state["tokens"])
        records = [r for r in ck.state.get("metrics", []) if r["step"] <= at.step]
    return latest, at, records


def train_step(wrapped: torch.nn.Module, b: Batch, params: list[torch.nn.Parameter], optimizers: Optimizers,
               grad_clip: float, device: torch.device) -> StepOut:
    """Forward (bf16 autocast on CUDA), backward, clip and one optimizer step on a batch."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        lists = None if b.block_lists is None else (b.block_lists, b.block_layout)
        loss, step_loss, step_acc, step_count = wrapped(b.input_ids, b.aux_hidden, b.final_hidden, b.loss_mask, b.doc_ids,
                                                        counts=b.row_counts, block_lists=lists)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    lr = optimizers.lr
    optimizers.step()
    return StepOut(loss, step_loss, step_acc, step_count, grad_norm, lr)


class StepLog:
    """Metrics records: the last batch's stats reduced over ranks, with the throughput and the
    share of time spent waiting for data over the window since the previous record."""

    def __init__(self, job: TrainJob, env: DistEnv, log: MetricsLog | None, horizon: int, step: int) -> None:
        self.job, self.env, self.log, self.horizon = job, env, log, horizon
        self.logged = step  # the step of the last record
        self.window_t, self.window_tokens, self.window_wait = time.perf_counter(), 0, 0.0

    def waited(self, seconds: float) -> None:
        """Time the loop waited for a batch."""
        self.window_wait += seconds

    def trained(self, tokens: int) -> None:
        """Tokens of a step (all ranks)."""
        self.window_tokens += tokens

    def record(self, at: Position, out: StepOut) -> None:
        """Reduce the last batch's stats over ranks and log one metrics record (every rank calls this)."""
        steps, env = self.job.settings.ttt_steps, self.env
        stats = torch.stack([out.loss.detach().float(), *(out.step_loss * out.step_count),
                             *(out.step_acc * out.step_count), *out.step_count.float()])
        sum_over_ranks(stats, env)
        n = stats[1 + 2 * steps :].clamp_min(1)
        rec = {"step": at.step, "epoch": at.epoch, "loss": float(stats[0] / env.world), "lr": out.lr,
               "grad_norm": float(out.grad_norm)}
        rec.update({f"loss_{k}": float(stats[1 + k] / n[k]) for k in range(steps)})
        rec.update({f"acc_{k}": float(stats[1 + steps + k] / n[k]) for k in range(steps)})
        now = time.perf_counter()
        rec["tokens_per_s"] = round(self.window_tokens / max(now - self.window_t, 1e-9), 1)
        # Share of the window the loop waited for its next batch (input-bound when large).
        rec["data_wait_frac"] = round(self.window_wait / max(now - self.window_t, 1e-9), 4)
        rec["tokens"] = at.tokens
        rec["taught_tokens"] = int(stats[1 + 2 * steps])  # this batch's positions taught at TTT step 0 (all ranks)
        self.window_t, self.window_tokens, self.window_wait = now, 0, 0.0
        self.logged = at.step
        if self.log is not None:
            self.log.log(rec)
        self.job.progress(at.step, self.horizon, "steps", loss=round(rec["loss"], 4), acc_0=round(rec["acc_0"], 4))


class Checkpointer:
    """Writes a checkpoint at a step boundary: every rank hands over its part, rank 0 writes it
    with the metrics so far."""

    def __init__(self, job: TrainJob, env: DistEnv, wrapped: torch.nn.Module, optimizers: Optimizers,
                 log: MetricsLog | None, step: int) -> None:
        self.job, self.env, self.wrapped, self.optimizers, self.log = job, env, wrapped, optimizers, log
        self.last = step  # the step of the newest checkpoint

    def save(self, at: Position) -> None:
        job, env, log = self.job, self.env, self.log
        model_sd = _full_model_state(self.wrapped)
        optim_sd = self.optimizers.state_dict(self.wrapped)
        rng = _gather_rng(env)
        if job.output is not None and log is not None:
            state = {"epoch": at.epoch, "batch_index": at.batch_index, "tokens": at.tokens, "world_size": env.world,
                     "metrics": log.records}
            ck = ckpt_io.Checkpoint(at.step, model_sd, optim_sd, rng, state)
            ckpt_io.save_checkpoint(job.output, ck, job.scratch / "ckpt")
            log.upload(job.output)
        if env.distributed:
            dist.barrier()
        self.last = at.step


def train(job: TrainJob, env: DistEnv, stop: Callable[[], bool]) -> dict[str, Any]:
    """Train (resuming from the newest complete checkpoint); returns stats. Rank 0 writes the store."""
    return Trainer(job, env, stop).run()


class Trainer:
    """One training on this rank: built, resumed, stepped epoch by epoch (ranks in lockstep),
    checkpointed, evaluated on the held-out samples."""

    def __init__(self, job: TrainJob, env: DistEnv, stop: Callable[[], bool]) -> None:
        s = job.settings
        self.job, self.env, self.stop, self.s = job, env, stop, s
        self.wrapped, self.objective = _build(job, env)
        self.params = [p for p in self.objective.parameters() if p.requires_grad]
        fused = env.device.type == "cuda" and s.strategy != "fsdp"
        self.per_epoch = job.plan.estimated_batches_per_epoch()
        horizon = math.ceil(s.epochs * self.per_epoch)
        if s.max_steps is not None:
            horizon = min(horizon, s.max_steps)
        self.optimizers = Optimizers(self.objective, s, lambda st: lr_factor(st, s.warmup_steps, horizon, s.min_lr_ratio), fused)
        self.dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
        self.pad_to = 128 if env.device.type == "cuda" else 1
        self.latest, self.at, records = resume(job, env, self.wrapped, self.optimizers)
        self.log = MetricsLog(job.scratch / "metrics", records) if job.output is not None else None
        self.checkpoints = Checkpointer(job, env, self.wrapped, self.optimizers, self.log, self.at.step)
        self.step_log = StepLog(job, env, self.log, horizon, self.at.step)
        self.profiler = StepProfiler(s.profile_range if job.output is not None else None, env.device, job.scratch / "profile")
        self.max_steps = s.max_steps if s.max_steps is not None else 1 << 62
        self.last: StepOut | None = None  # the latest step's output

    def run(self) -> dict[str, Any]:
        at, s = self.at, self.s
        t_start, tokens_at_start = time.perf_counter(), at.tokens
        full_epochs, frac = int(s.epochs), s.epochs - int(s.epochs)
        total_epochs = full_epochs + (1 if frac > 0 else 0)
        self.wrapped.train()
        while at.epoch < total_epochs and at.step < self.max_steps:
            limit = math.ceil(frac * self.per_epoch) if at.epoch == full_epochs else None
            if not self.epoch(limit):
                break  # max_steps reached inside the epoch: the position stays mid-epoch
            at.epoch, at.batch_index = at.epoch + 1, 0
        self.profiler.finish(at.step)  # the data ran out inside the profiled steps
        if at.step > self.step_log.logged and self.last is not None:
            self.step_log.record(at, self.last)  # the data ran out between log_every boundaries: always log the last step
        if at.step > self.checkpoints.last:
            self.checkpoints.save(at)
        elapsed = time.perf_counter() - t_start
        job, env = self.job, self.env
        eval_metrics = _eval(self.wrapped, self.objective, job, env, self.dtype, self.pad_to) if job.plan.eval_fraction > 0 else {}
        final_sd = _full_model_state(self.wrapped)
        stats = final_stats(self, (at.tokens - tokens_at_start) / max(elapsed, 1e-9), eval_metrics)
        if self.log is not None:
            self.log.close()
        return {"stats": stats, "state": ckpt_io.drafter_weights(final_sd), "log": self.log, "profile": self.profiler.files()}

    def epoch(self, limit: int | None) -> bool:
        """Step through the current epoch (its first ``limit`` batches, when given) from the
        position's batch; False when max_steps was reached inside it."""
        at, env, s = self.at, self.env, self.s
        cuda = env.device.type == "cuda"
        # On CUDA fp8 shards travel as fp8 (half the bytes to copy) and are dequantized on the GPU:
        # dequantizing 16K tokens on the prefetch thread leaves the GPU waiting for data.
        batches = self.job.plan.iterate(self.job.open_shard, at.epoch, self.dtype, skip=at.batch_index, pad_to=self.pad_to,
                                        pin=cuda, raw_fp8=cuda)
        with Prefetcher(_prepared(batches, s.ttt_steps, self.objective.attention == "flex", cuda)) as it:
            on_device = AheadOnDevice(it, env.device, side_stream=s.copy_ahead)
            while at.step < self.max_steps:
                waited = time.perf_counter()
                b: Batch | None = on_device.take() if limit is None or at.batch_index < limit else None
                waited = time.perf_counter() - waited
                self.step_log.waited(waited)
                self.profiler.add_wait(waited)
                no_batch, stopping = agree(env, b is None, self.stop())
                if stopping:
                    if at.step > self.checkpoints.last:
                        self.checkpoints.save(at)
                    raise TrainingInterrupted(f"training stopped on request at step {at.step}; checkpoint saved, rerun to resume")
                if no_batch or b is None:
                    return True
                self.step(b.dequantized(self.dtype))
        return False

    def step(self, b: Batch) -> None:
        """One optimizer step, then the record and the checkpoint that fall due at it."""
        at, env, s = self.at, self.env, self.s
        self.profiler.before_step(at.step)
        self.last = train_step(self.wrapped, b, self.params, self.optimizers, s.grad_clip, env.device)
        at.step, at.batch_index = at.step + 1, at.batch_index + 1
        batch_tokens = int(sum_over_ranks(torch.tensor([b.tokens], device=env.device), env).item()) if env.distributed else b.tokens
        at.tokens += batch_tokens
        self.step_log.trained(batch_tokens)
        self.profiler.after_step(at.step)
        if at.step % s.log_every == 0 or at.step == self.max_steps:
            self.step_log.record(at, self.last)
        if at.step % s.checkpoint_every == 0:
            self.checkpoints.save(at)


def final_stats(trainer: Trainer, tokens_per_s: float, eval_metrics: dict[str, float]) -> dict[str, Any]:
    """The stage's stats: steps, tokens, throughput, where it ran, the last record's loss and
    accuracy, the held-out metrics, and the profile and peak memory when measured."""
    at, env, s, log, profiler = trainer.at, trainer.env, trainer.s, trainer.log, trainer.profiler
    stats: dict[str, Any] = {
        "steps": at.step,
        "tokens": at.tokens,
        "tokens_per_s": round(tokens_per_s, 1),
        "world_size": env.world,
        "strategy": s.strategy if env.distributed else "single",
        "device": env.device.type,
        "resumed_from_step": trainer.latest,
        **eval_metrics,
    }
    if profiler.summary is not None:
        stats["profile"] = {k: v for k, v in profiler.summary.items() if not k.startswith("top_")}
    if env.device.type == "cuda":
        stats["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(env.device) / 2**30, 3)
    if log is not None and log.records:
        last = log.records[-1]
        stats["final_loss"] = last["loss"]
        stats.update({f"final_{k}": v for k, v in last.items() if k.startswith(("loss_", "acc_"))})
    return stats


def _adopt_latest(output: StageOutput) -> int | None:
    """Carry the newest complete checkpoint (and the metrics uploaded with it) into this attempt."""
    names = list(output.recovered(ckpt_io.PREFIX))
    steps = ckpt_io.complete_steps(names)
    if not steps:
        for n in names:
            output.drop(n)  # an incomplete checkpoint of an earlier attempt
        return None
    keep = ckpt_io.step_dir(steps[-1]) + "/"
    for n in names:
        if n.startswith(keep):
            output.adopt(n)
        else:
            output.drop(n)
    for n in output.recovered("tensorboard/"):
        output.adopt(n)  # event files up to the checkpoint; the resumed run adds a new one
    return steps[-1]
