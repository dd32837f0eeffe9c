"""``eagle3 stage train``: the drafter trained with TTT on extract's hidden-state shards.

Plain (world size 1) or under torchrun (DDP, or FSDP with ``train.strategy=fsdp``).
Only rank 0 writes the store; ``run_stage`` has already called ``begin()`` on rank 0
when this runs, so every rank first waits at a barrier, then reads checkpoints.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from eagle3.context import StageContext
from eagle3.drafter.adapter import CONFIG, WEIGHTS, check_weights
from eagle3.drafter.model import DrafterConfig
from eagle3.errors import StageError
from eagle3.extract.shards import INDEX, TARGET_HEAD, HiddenShard, read_shard
from eagle3.manifest import Manifest
from eagle3.store import ObjectStore
from eagle3.train.data import DataPlan, shard_refs
from eagle3.train.distributed import init_distributed
from eagle3.train.loop import StopFlag, TrainJob, train
from eagle3.train.metrics import parse_metrics, plot_loss
from eagle3.vocab.mapping import draft_to_target, load_vocab_mapping


def _target_config(ctx: StageContext, index: dict[str, Any]) -> Any:
    """The target's HF config (heads, intermediate size); index.json's fields win where both exist."""
    from eagle3.targets.load import load_target_config

    try:
        return load_target_config(ctx.cfg.target)
    except Exception as e:  # noqa: BLE001 (any loader failure is one line for the user)
        raise StageError(f"train needs the target's config ({ctx.cfg.target.model}) for the drafter shape: {e}") from None


def load_target_head(path: Path, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed [V, H], lm_head rows of the draft vocab [N, H]) from target_head.safetensors."""
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for k in ("embed_tokens.weight", "lm_head.weight"):
            if k not in keys:
                raise StageError(f"{path.name} lacks {k}")
        embed = f.get_tensor("embed_tokens.weight")
        head = f.get_slice("lm_head.weight")
        rows = head.get_shape()[0]
        if int(draft_ids.max()) >= rows:
            raise StageError(f"vocab mapping names target id {int(draft_ids.max())}, the target lm_head has {rows} rows")
        teacher = f.get_tensor("lm_head.weight")[draft_ids]
    return embed, teacher


def chain_stalled(stats: dict[str, Any]) -> str | None:
    """One line when the held-out metrics show a drafter chain that does not advance: TTT step 1
    mostly repeats step 0's token and is rarely right after a right step 0 (decoding then accepts
    about one draft token however many are proposed); None otherwise or without held-out data."""
    same, chained, forced = (stats.get(k) for k in ("eval_same_as_step0_1", "eval_chain_acc_1", "eval_acc_1"))
    if same is None or chained is None or forced is None or same < 0.5 or chained >= 0.5 * forced:
        return None
    return (f"the drafter's chain does not advance: TTT step 1 repeats step 0's token on {same:.0%} of held-out rows and "
            f"is right on {chained:.1%} of rows after a right step 0 ({forced:.1%} teacher-forced); decoding will accept "
            "little past the first draft token — train longer, with a higher train.lr, or from the target's head "
            "(train.lm_head=target)")


def run(ctx: StageContext) -> dict[str, Any]:
    s, env = ctx.cfg.train, init_distributed(ctx.cfg.train.device)
    if env.distributed:
        dist.barrier()  # rank 0 has begun the stage output (and may have wiped a stale attempt)
    index = ctx.upstream_json("extract", INDEX)
    refs = shard_refs(index)
    d2t, t2d = load_vocab_mapping(ctx.upstream_path("vocab", "vocab_mapping.safetensors"))
    vocab = int(index.get("target_vocab_size", t2d.numel()))
    if t2d.numel() != vocab:
        raise StageError(f"vocab mapping covers {t2d.numel()} target tokens, extract's target has {vocab}: they come from different targets")
    target_cfg = _target_config(ctx, index)
    drafter_cfg = DrafterConfig.from_target(target_cfg, ctx.cfg.drafter, d2t.numel(), list(index["aux_layer_ids"]))
    if drafter_cfg.target_hidden_size != int(index["hidden_size"]) or drafter_cfg.vocab_size != vocab:
        raise StageError(
            f"target config (hidden {drafter_cfg.target_hidden_size}, vocab {drafter_cfg.vocab_size}) disagrees with "
            f"extract's index (hidden {index['hidden_size']}, vocab {vocab}): target.model changed since extract"
        )
    embed, teacher = load_target_head(ctx.upstream_path("extract", TARGET_HEAD), draft_to_target(d2t))

    def open_shard(name: str) -> HiddenShard:
        path = ctx.upstream_path("extract", name)
        shard = read_shard(path)
        if ctx.store.local_path(ctx.upstream_key("extract", name)) is None:
            path.unlink(missing_ok=True)  # a downloaded copy: keep local disk bounded to one shard
        return shard

    plan = DataPlan(refs, s.batch_tokens, s.max_seq_len, s.eval_fraction, s.seed, env.rank, env.world, s.pack,
                    s.loss_tokens == "all")
    job = TrainJob(
        drafter_cfg, embed, teacher, plan, open_shard, s, ctx.store, ctx.output_prefix,
        ctx.output, ctx.scratch, progress=ctx.progress if ctx.output is not None else (lambda *a, **k: None),
    )
    flag = StopFlag().install()
    try:
        result = train(job, env, flag)
    finally:
        flag.restore()
    out = ctx.output
    stalled = chain_stalled(result["stats"])
    if out is not None and stalled:
        print(f"train: warning: {stalled}", file=sys.stderr, flush=True)
    if out is not None:
        from eagle3.drafter.adapter import save_drafter_state

        final = ctx.scratch / "final"
        save_drafter_state(result["state"], drafter_cfg, final)
        out.put_file(WEIGHTS, final / WEIGHTS)
        out.put_file(CONFIG, final / CONFIG)
        log = result["log"]
        log.upload(out)
        plot_loss(log.records, final / "loss.png", s.ttt_steps)
        out.put_file("loss.png", final / "loss.png")
        for p in result["profile"]:
            out.put_file(f"profile/{p.name}", p)
        if "profile" in result["stats"]:
            prof = result["stats"]["profile"]
            busy = "" if prof["device_busy_ms_per_step"] is None else (
                f", device busy {prof['device_busy_ms_per_step']} ms ({100 * prof['device_busy_frac']:.0f} %)")
            print(f"train: profiled steps {prof['steps'][0]}..{prof['steps'][1] - 1}: {prof['wall_ms_per_step']} ms a step{busy}, "
                  f"waiting for data {prof['data_wait_ms_per_step']} ms, GC {prof['gc_ms_per_step']} ms; "
                  "tables and trace in the stage output's profile/", file=sys.stderr, flush=True)
    if env.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return {**result["stats"], "draft_vocab_size": drafter_cfg.draft_vocab_size, "aux_layer_ids": drafter_cfg.aux_layer_ids}


def deep_check(store: ObjectStore, manifest: Manifest) -> list[str]:
    """drafter.safetensors agrees with drafter_config.json; metrics.jsonl parses."""
    prefix = manifest.prefix
    problems: list[str] = []
    try:
        cfg = DrafterConfig.from_dict(json.loads(store.get_bytes(f"{prefix}/{CONFIG}")))
    except (ValueError, TypeError) as e:
        return [f"{prefix}/{CONFIG} does not parse as a drafter config: {e}"]
    except StageError as e:
        return [f"{prefix}/{CONFIG}: {e}"]
    with tempfile.TemporaryDirectory() as tmp:
        local = store.local_path(f"{prefix}/{WEIGHTS}") or store.get_file(f"{prefix}/{WEIGHTS}", Path(tmp) / WEIGHTS)
        try:
            with safe_open(str(local), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
            return [f"{prefix}/{WEIGHTS} is not a readable safetensors file: {e}"]
    problems += check_weights(cfg, shapes, f"{prefix}/{WEIGHTS}")
    try:
        records = parse_metrics(store.get_bytes(f"{prefix}/metrics.jsonl").decode())
        if not records:
            problems.append(f"{prefix}/metrics.jsonl holds no records")
    except ValueError as e:
        problems.append(f"{prefix}/metrics.jsonl does not parse: {e}")
    return problems
