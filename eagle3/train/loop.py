"""The training loop: one code path for 1 CPU process, 1 GPU, N GPUs or several nodes.

Ranks run in lockstep: before each step they agree (one all-reduce) whether every rank
still has a batch and whether any was asked to stop (SIGTERM). A stop writes a
checkpoint at that step boundary and raises :class:`TrainingInterrupted`.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
from eagle3.train.metrics import MetricsLog
from eagle3.train.optim import Optimizers
from eagle3.train.prefetch import AheadOnDevice, Prefetcher
from eagle3.train.profiling import StepProfiler
from eagle3.train.schedule import lr_factor
from eagle3.train.settings import TrainSettings

EVAL_MAX_BATCHES = 50


class TrainingInterrupted(StageError):
    """Stopped on request after writing a checkpoint; a rerun resumes from it."""


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


def _reduce(t: torch.Tensor, env: DistEnv, op: Any = None) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def _agree(env: DistEnv, no_batch: bool, stop: bool) -> tuple[bool, bool]:
    """(any rank out of batches, any rank asked to stop): one all-reduce across ranks, none
    (and no device synchronisation) in a single process."""
    if not env.distributed:
        return no_batch, stop
    flags = torch.tensor([float(no_batch), float(stop)], device=env.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0].item()), bool(flags[1].item())


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
            if _agree(env, batch is None, False)[0]:
                break
            b = batch.to(env.device)
            with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=env.device.type == "cuda"):
                _, sl, sa, sc, chain = wrapped(b.input_ids, b.aux_hidden, b.final_hidden, b.loss_mask, chain=True)
            sums += torch.cat([torch.stack([sl.double() * sc, sa.double() * sc, sc.double()]), chain.double()])
    wrapped.train()
    _reduce(sums, env)
    n = sums[2].clamp_min(1)
    if sums[2].sum() == 0:
        return {}
    out = {f"eval_loss_{k}": float(sums[0, k] / n[k]) for k in range(steps)}
    out.update({f"eval_acc_{k}": float(sums[1, k] / n[k]) for k in range(steps)})
    chained, same = chain_rates(sums[3:])
    out.update({f"eval_chain_acc_{k}": chained[k] for k in range(steps)})
    out.update({f"eval_same_as_step0_{k}": same[k] for k in range(1, steps)})
    return out


def train(job: TrainJob, env: DistEnv, stop: Callable[[], bool]) -> dict[str, Any]:
    """Train (resuming from the newest complete checkpoint); returns stats. Rank 0 writes the store."""
    s = job.settings
    wrapped, objective = _build(job, env)
    params = [p for p in objective.parameters() if p.requires_grad]
    fused = env.device.type == "cuda" and s.strategy != "fsdp"
    per_epoch = job.plan.estimated_batches_per_epoch()
    horizon = math.ceil(s.epochs * per_epoch)
    if s.max_steps is not None:
        horizon = min(horizon, s.max_steps)
    optimizers = Optimizers(objective, s, lambda st: lr_factor(st, s.warmup_steps, horizon, s.min_lr_ratio), fused)
    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    pad_to = 128 if env.device.type == "cuda" else 1

    # Resume: rank 0 knows the journaled checkpoints; every rank reads the same one.
    latest = None
    records: list[dict[str, Any]] = []
    if job.output is not None:
        latest = _adopt_latest(job.output)
    if env.distributed:
        box = [latest]
        dist.broadcast_object_list(box, src=0)
        latest = box[0]
    step, epoch, batch_idx, tokens_seen = 0, 0, 0, 0
    if latest is not None:
        ck = ckpt_io.load_checkpoint(job.store, job.stage_prefix, latest)
        set_model_state_dict(wrapped, ck.model, options=StateDictOptions(full_state_dict=True, strict=False))
        optimizers.load_state_dict(wrapped, ck.optim)
        if len(ck.rng) == env.world:
            ckpt_io.set_rng_state(ck.rng[env.rank])
        step, epoch, batch_idx, tokens_seen = ck.step, ck.state["epoch"], ck.state["batch_index"], ck.state["tokens"]
        records = [r for r in ck.state.get("metrics", []) if r["step"] <= step]
    log = MetricsLog(job.scratch / "metrics", records) if job.output is not None else None

    def save(step: int) -> None:
        model_sd = _full_model_state(wrapped)
        optim_sd = optimizers.state_dict(wrapped)
        rng = _gather_rng(env)
        if job.output is not None and log is not None:
            state = {"epoch": epoch, "batch_index": batch_idx, "tokens": tokens_seen, "world_size": env.world, "metrics": log.records}
            ck = ckpt_io.Checkpoint(step, model_sd, optim_sd, rng, state)
            ckpt_io.save_checkpoint(job.output, ck, job.scratch / "ckpt")
            _upload_metrics(job.output, log)
        if env.distributed:
            dist.barrier()

    full_epochs, frac = int(s.epochs), s.epochs - int(s.epochs)
    total_epochs = full_epochs + (1 if frac > 0 else 0)
    max_steps = s.max_steps if s.max_steps is not None else 1 << 62
    t_start, tokens_at_start, last_ckpt = time.perf_counter(), tokens_seen, step
    window_t, window_tokens, window_wait = time.perf_counter(), 0, 0.0

    def record(step: int, loss: Tensor, step_loss: Tensor, step_acc: Tensor, step_count: Tensor, grad_norm: Any, lr: float) -> None:
        """Reduce the last batch's stats over ranks and log one metrics record (every rank calls this)."""
        nonlocal window_t, window_tokens, window_wait
        stats = torch.stack([loss.detach().float(), *(step_loss * step_count), *(step_acc * step_count), *step_count.float()])
        _reduce(stats, env)
        n = stats[1 + 2 * s.ttt_steps :].clamp_min(1)
        rec = {"step": step, "epoch": epoch, "loss": float(stats[0] / env.world), "lr": lr, "grad_norm": float(grad_norm)}
        rec.update({f"loss_{k}": float(stats[1 + k] / n[k]) for k in range(s.ttt_steps)})
        rec.update({f"acc_{k}": float(stats[1 + s.ttt_steps + k] / n[k]) for k in range(s.ttt_steps)})
        now = time.perf_counter()
        rec["tokens_per_s"] = round(window_tokens / max(now - window_t, 1e-9), 1)
        # Share of the window the loop waited for its next batch (input-bound when large).
        rec["data_wait_frac"] = round(window_wait / max(now - window_t, 1e-9), 4)
        rec["tokens"] = tokens_seen
        rec["taught_tokens"] = int(stats[1 + 2 * s.ttt_steps])  # this batch's positions taught at TTT step 0 (all ranks)
        window_t, window_tokens, window_wait = now, 0, 0.0
        if log is not None:
            log.log(rec)
        job.progress(step, horizon, "steps", loss=round(rec["loss"], 4), acc_0=round(rec["acc_0"], 4))

    logged = step
    cuda = env.device.type == "cuda"
    profiler = StepProfiler(s.profile_range if job.output is not None else None, env.device, job.scratch / "profile")
    wrapped.train()
    while epoch < total_epochs and step < max_steps:
        limit = math.ceil(frac * per_epoch) if epoch == full_epochs else None
        # On CUDA fp8 shards travel as fp8 (half the bytes to copy) and are dequantized on the GPU:
        # dequantizing 16K tokens on the prefetch thread left the GPU waiting ~30 % of the time (run 8).
        batches = job.plan.iterate(job.open_shard, epoch, dtype, skip=batch_idx, pad_to=pad_to, pin=cuda, raw_fp8=cuda)
        with Prefetcher(_prepared(batches, s.ttt_steps, objective.attention == "flex", cuda)) as it:
            on_device = AheadOnDevice(it, env.device, side_stream=s.copy_ahead)
            while step < max_steps:
                waited = time.perf_counter()
                b: Batch | None = on_device.take() if limit is None or batch_idx < limit else None
                waited = time.perf_counter() - waited
                window_wait += waited
                profiler.add_wait(waited)
                no_batch, stopping = _agree(env, b is None, stop())
                if stopping:
                    if step > last_ckpt:
                        save(step)
                    raise TrainingInterrupted(f"training stopped on request at step {step}; checkpoint saved, rerun to resume")
                if no_batch or b is None:
                    break
                b = b.dequantized(dtype)
                profiler.before_step(step)
                with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cuda):
                    lists = None if b.block_lists is None else (b.block_lists, b.block_layout)
                    loss, step_loss, step_acc, step_count = wrapped(b.input_ids, b.aux_hidden, b.final_hidden, b.loss_mask, b.doc_ids,
                                                                    counts=b.row_counts, block_lists=lists)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
                lr = optimizers.lr
                optimizers.step()
                step, batch_idx = step + 1, batch_idx + 1
                batch_tokens = int(_reduce(torch.tensor([b.tokens], device=env.device), env).item()) if env.distributed else b.tokens
                tokens_seen += batch_tokens
                window_tokens += batch_tokens
                profiler.after_step(step)
                if step % s.log_every == 0 or step == max_steps:
                    record(step, loss, step_loss, step_acc, step_count, grad_norm, lr)
                    logged = step
                if step % s.checkpoint_every == 0:
                    save(step)
                    last_ckpt = step
            else:
                break  # max_steps reached inside the epoch: the position stays mid-epoch
        epoch, batch_idx = epoch + 1, 0
    profiler.finish(step)  # the data ran out inside the profiled steps
    if step > logged:  # the data ran out between log_every boundaries: always log the last step
        record(step, loss, step_loss, step_acc, step_count, grad_norm, lr)
    if step > last_ckpt:
        save(step)
    elapsed = time.perf_counter() - t_start
    eval_metrics = _eval(wrapped, objective, job, env, dtype, pad_to) if job.plan.eval_fraction > 0 else {}
    final_sd = _full_model_state(wrapped)
    stats: dict[str, Any] = {
        "steps": step,
        "tokens": tokens_seen,
        "tokens_per_s": round((tokens_seen - tokens_at_start) / max(elapsed, 1e-9), 1),
        "world_size": env.world,
        "strategy": s.strategy if env.distributed else "single",
        "device": env.device.type,
        "resumed_from_step": latest,
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
    if log is not None:
        log.close()
    return {"stats": stats, "state": ckpt_io.drafter_weights(final_sd), "log": log, "profile": profiler.files()}


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


def _upload_metrics(output: StageOutput, log: MetricsLog) -> None:
    log.flush()
    output.put_file("metrics.jsonl", log.path)
    for p in log.tb_files():
        output.put_file(f"tensorboard/{p.relative_to(log.tb_dir).as_posix()}", p)
