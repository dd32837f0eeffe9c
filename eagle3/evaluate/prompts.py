"""Held-out prompts for evaluation: never the ones the drafter was trained on, when possible."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.config import PipelineConfig
from eagle3.generate.prompts import Prompt, parse_prompts, read_prompts_bytes, select_prompts


@dataclass
class HeldOut:
    prompts: list[Prompt]
    source: str  # where they came from, for the report
    held_out: bool  # False: the fallback re-used training prompts (the report says so)


def held_out_prompts(cfg: PipelineConfig) -> HeldOut:
    """``evaluate.prompts`` if set; else generate's prompts that generate did not use
    (beyond ``generate.max_samples``); else the last ``num_prompts`` training prompts."""
    ev, gen = cfg.evaluate, cfg.generate
    n = ev.num_prompts
    if ev.prompts:
        data = read_prompts_bytes(ev.prompts, cfg.store.endpoint_url, cfg.store.region)
        return HeldOut(parse_prompts(data, ev.prompts, gen.system_prompt)[:n], f"evaluate.prompts ({ev.prompts})", True)
    data = read_prompts_bytes(gen.prompts, cfg.store.endpoint_url, cfg.store.region)
    every = parse_prompts(data, gen.prompts, gen.system_prompt)
    used = {p.sample_id for p in select_prompts(every, gen.max_samples, gen.seed)}  # generate's own choice
    unused = [p for p in every if p.sample_id not in used]
    if unused:
        return HeldOut(unused[:n], f"{gen.prompts}: prompts generate did not use (beyond max_samples)", True)
    trained = [p for p in every if p.sample_id in used]
    return HeldOut(trained[-n:], f"{gen.prompts}: NOT held out: generate used every prompt, so these are the last "
                   f"{min(n, len(trained))} training prompts (set evaluate.prompts or generate.max_samples)", False)
