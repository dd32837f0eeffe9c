import json

import torch

from eagle3.context import run_stage
from eagle3.evaluate import stage as evaluate_stage
from eagle3.manifest import verify_stage
from eagle3.store import open_store
from tests.extract.pipeline import (commit_generate, commit_untrained_train, commit_vocab, pipeline_config,
                                    random_samples)


def test_evaluate_stage_reports_acceptance_of_the_export(tmp_path, tiny_target_dir):
    cfg = pipeline_config(tmp_path / "store", tiny_target_dir("llama"), **{
        "generate.max_samples": 4, "evaluate.num_prompts": 2, "evaluate.max_new_tokens": 10,
        "evaluate.num_draft_tokens": 3, "evaluate.check_greedy": 2})
    commit_generate(cfg, random_samples(4), tmp_path)
    run_stage(cfg, "extract")
    counts = torch.arange(1024, 0, -1)
    commit_vocab(cfg, counts, 128, tmp_path)
    commit_untrained_train(cfg, 128, tmp_path)
    run_stage(cfg, "export")
    stats = run_stage(cfg, "evaluate")
    store = open_store(cfg.store.uri)
    report = json.loads(store.get_bytes("t/evaluate/report.json"))
    assert report["held_out"] is True and "did not use" in report["prompt_source"]
    assert report["num_prompts"] == 2 and report["num_draft_tokens"] == 3
    assert report["greedy_check"] == {"prompts_checked": 2, "prompts_matching": 2, "all_match": True}
    assert 1 <= report["mean_acceptance_length"] <= 4
    assert report["draft_tokens_proposed"] == 3 * report["verify_steps"]
    assert len(report["acceptance_rate_per_position"]["conditional"]) == 3
    assert report["aux_layer_ids"] == json.loads(store.get_bytes("t/extract/index.json"))["aux_layer_ids"]
    assert sum(p["tokens_generated"] for p in report["per_prompt"]) == report["tokens_generated"]
    assert stats["mean_acceptance_length"] == report["mean_acceptance_length"]
    assert verify_stage(store, "t", "evaluate", deep=True, content_check=evaluate_stage.deep_check).complete


def test_fallback_to_training_prompts_is_said_in_the_report(tmp_path):
    from eagle3.evaluate.prompts import held_out_prompts

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(5)))
    cfg = pipeline_config(tmp_path / "store", tmp_path, **{"generate.prompts": str(prompts), "evaluate.num_prompts": 2})
    held = held_out_prompts(cfg)
    assert held.held_out is False and "NOT held out" in held.source
    assert [p.sample_id for p in held.prompts] == [3, 4]
    cfg = pipeline_config(tmp_path / "store", tmp_path, **{"generate.prompts": str(prompts), "generate.max_samples": 3,
                                                           "evaluate.num_prompts": 5})
    held = held_out_prompts(cfg)
    assert held.held_out is True and len(held.prompts) == 2
    used = {0, 1, 2, 3, 4} - {p.sample_id for p in held.prompts}
    assert len(used) == 3
